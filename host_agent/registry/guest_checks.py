"""The guests' preflight checks, across an ensemble's members (pure).

Each guest reports ``preflight: [{"name", "result", "message"}]`` (imex-guest-agent
preflight, run at its start and every 10 minutes). ``GuestChecks`` on the ImexEnsemble
is False, with a reason naming the failing check and a message naming the members,
when any member's fresh report has a FAIL; True when every member that reported checks
has none; Unknown before any member reported them. :func:`check_counts` is what
``imex_ensemble_guest_checks{check,result}`` counts: members, never a series per member.
It never makes an ensemble Degraded or not Ready: the day-two issue adds its alert.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any, Final

from host_agent.state.snapshot import EnsembleSnapshot, GuestReport, report_counts

ALL_PASS: Final = "AllChecksPass"
NONE_REPORTED: Final = "NoChecksReported"
_LIST_MAX = 12


def preflight_of(report: GuestReport | None) -> list[Mapping[str, Any]]:
    value = report.fields.get("preflight") if report is not None else None
    if not isinstance(value, Sequence) or isinstance(value, str):
        return []
    return [c for c in value if isinstance(c, Mapping) and isinstance(c.get("name"), str)
            and c.get("result") in ("PASS", "WARN", "FAIL")]


def member_checks(snap: EnsembleSnapshot, now: float, stale_after: float
                  ) -> dict[int, list[Mapping[str, Any]]]:
    """index -> checks of the published members whose fresh report carries them."""
    out: dict[int, list[Mapping[str, Any]]] = {}
    for pub in snap.members:
        r = snap.reports.get(pub.index)
        if r is None or not report_counts(pub, r) or now - r.received_at > stale_after:
            continue
        checks = preflight_of(r)
        if checks:
            out[pub.index] = checks
    return out


def check_counts(snap: EnsembleSnapshot, now: float, stale_after: float
                 ) -> Counter[tuple[str, str]]:
    """(check, result) -> how many members report it."""
    counts: Counter[tuple[str, str]] = Counter()
    for checks in member_checks(snap, now, stale_after).values():
        for c in checks:
            counts[(str(c["name"]), str(c["result"]))] += 1
    return counts


def camel(name: str) -> str:
    return "".join(part[:1].upper() + part[1:] for part in name.split("_") if part)


def _members(indices: Sequence[int]) -> str:
    named = ", ".join(map(str, indices[:_LIST_MAX]))
    more = len(indices) - _LIST_MAX
    word = "member" if len(indices) == 1 else "members"
    return f"{word} {named}" + (f" and {more} more" if more > 0 else "")


def guest_checks(snap: EnsembleSnapshot, now: float, stale_after: float
                 ) -> tuple[str, str, str]:
    """(status "True"|"False"|"Unknown", reason, message) of ``GuestChecks``."""
    by_member = member_checks(snap, now, stale_after)
    if not by_member:
        return "Unknown", NONE_REPORTED, "no member has reported its preflight checks yet"
    failing: dict[str, list[int]] = {}
    first: dict[str, str] = {}
    warns = 0
    for index, checks in sorted(by_member.items()):
        for c in checks:
            if c["result"] == "FAIL":
                failing.setdefault(str(c["name"]), []).append(index)
                first.setdefault(str(c["name"]), str(c.get("message", "")))
            elif c["result"] == "WARN":
                warns += 1
    if not failing:
        return "True", ALL_PASS, (f"{len(by_member)} members report no failing check"
                                  + (f" ({warns} warnings)" if warns else ""))
    order = sorted(failing, key=lambda n: (-len(failing[n]), n))
    parts = [f"{n} FAIL on {_members(failing[n])}: {first[n]}" for n in order]
    return "False", f"{camel(order[0])}Failed", "; ".join(parts)
