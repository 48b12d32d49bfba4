"""Injected failures and request counters: pure bookkeeping, no I/O.

TEST STAND-IN, never product code. Imitates what clients of a real
apiserver meet under trouble: 500 InternalError storms, 429 TooManyRequests
with `Retry-After` (API Priority and Fairness rejecting a request), slow
answers. A rule applies to the next `count` matching requests, or for
`duration` seconds, or until cleared; `verbs` ({"get", "list", "watch",
"create", "update", "patch", "apply", "delete", "discovery"}) and
`resources` (plural, e.g. "endpointslices", or "virtualmachineinstances/status")
narrow it. Rules are checked in the order they were added; the first failing
rule that matches decides.

The counters count requests as the audit log would: one per API request
that passed authentication, by (verb, resource), whether or not a fault
then answered it, so a test can assert "no spurious write" by counting what
the client attempted.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

from .errors import ApiError

WRITE_VERBS = frozenset({"create", "update", "patch", "apply", "delete"})
VERBS = frozenset({"get", "list", "watch", "discovery"}) | WRITE_VERBS


@dataclass
class Rule:
    status: int  # 0 for a pure delay
    delay: float
    remaining: int | None
    until: float | None
    retry_after: int | None
    verbs: frozenset[str] | None
    resources: frozenset[str] | None

    def matches(self, verb: str, resource: str, now: float) -> bool:
        if self.until is not None and now >= self.until:
            return False
        if self.remaining is not None and self.remaining <= 0:
            return False
        if self.verbs is not None and verb not in self.verbs:
            return False
        return self.resources is None or resource in self.resources or \
            resource.split("/")[0] in self.resources

    def spent(self, now: float) -> bool:
        return (self.remaining is not None and self.remaining <= 0) or \
            (self.until is not None and now >= self.until)


def _frozen(values: Iterable[str] | None,
            known: frozenset[str] | None = None) -> frozenset[str] | None:
    if values is None:
        return None
    out = frozenset([values] if isinstance(values, str) else values)
    if known is not None and not out <= known:
        raise ValueError(f"unknown verbs {sorted(out - known)}; known: {sorted(known)}")
    return out


class Faults:
    """The active fault rules; `decide()` is called once per API request."""

    def __init__(self) -> None:
        self.rules: list[Rule] = []

    def add(self, *, status: int = 0, delay: float = 0.0, count: int | None = None,
            duration: float | None = None, retry_after: int | None = None,
            verbs: Iterable[str] | None = None, resources: Iterable[str] | None = None,
            now: float) -> Rule:
        if status and status not in (429, 500, 502, 503, 504):
            raise ValueError(f"status must be one of 429, 500, 502, 503, 504, not {status}")
        if count is not None and count < 1:
            raise ValueError("count must be at least 1")
        rule = Rule(status, delay, count, now + duration if duration is not None else None,
                    retry_after if retry_after is not None else (1 if status == 429 else None),
                    _frozen(verbs, VERBS), _frozen(resources))
        self.rules.append(rule)
        return rule

    def clear(self) -> None:
        self.rules.clear()

    def decide(self, verb: str, resource: str, now: float) -> tuple[float, ApiError | None]:
        """(seconds to delay, error to answer with or None) for one request."""
        delay = 0.0
        error: ApiError | None = None
        for rule in self.rules:
            if not rule.matches(verb, resource, now):
                continue
            if rule.status == 0:
                delay = max(delay, rule.delay)
                if rule.remaining is not None:
                    rule.remaining -= 1
            elif error is None:
                delay = max(delay, rule.delay)
                error = _error(rule)
                if rule.remaining is not None:
                    rule.remaining -= 1
        self.rules = [r for r in self.rules if not r.spent(now)]
        return delay, error


def _error(rule: Rule) -> ApiError:
    if rule.status == 429:
        return ApiError(429, "TooManyRequests",
                        "Too many requests, please try again later. (injected by the sandbox)",
                        {"retryAfterSeconds": rule.retry_after},
                        {"Retry-After": str(rule.retry_after)})
    headers = {"Retry-After": str(rule.retry_after)} if rule.retry_after else {}
    reason = {500: "InternalError", 503: "ServiceUnavailable", 504: "Timeout"}.get(
        rule.status, "InternalError")
    return ApiError(rule.status, reason,
                    f"Internal error occurred: injected by the sandbox ({rule.status})",
                    None, headers)


class Counters:
    """Requests per (verb, resource), as the audit log would count them; a dry run's
    verb is ``dry-run <verb>`` (it writes nothing, so ``writes`` leaves it out)."""

    def __init__(self) -> None:
        self.requests: Counter[tuple[str, str]] = Counter()
        self.faulted: Counter[tuple[str, str]] = Counter()

    def count(self, verb: str, resource: str) -> None:
        self.requests[(verb, resource)] += 1

    def writes(self, resource: str | None = None, verb: str | None = None,
               served_only: bool = False) -> int:
        """Write requests received (create/update/patch/apply/delete), optionally narrowed.

        `served_only` leaves out the requests an injected fault answered.
        """
        def count(counter: Counter[tuple[str, str]]) -> int:
            return sum(n for (v, r), n in counter.items()
                       if v in WRITE_VERBS and (verb is None or v == verb)
                       and (resource is None or r == resource or r.split("/")[0] == resource))
        return count(self.requests) - (count(self.faulted) if served_only else 0)

    def reset(self) -> None:
        self.requests.clear()
        self.faulted.clear()

    def snapshot(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (verb, resource), n in sorted(self.requests.items()):
            out.setdefault(resource, {})[verb] = n
        return out
