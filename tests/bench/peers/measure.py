"""Pure readings for the peers benchmark: attempt logs, audit events, CoreDNS metrics, ratios.

Every figure of ``make bench-peers`` is computed here from text that real processes wrote:
the IMEX stand-ins' attempt logs (``--attempt-log``: one JSON line per outgoing connection
attempt), kube-apiserver's audit log (when a status write reached the API) and CoreDNS's
own ``prometheus`` metrics (queries it received). No I/O, so each rule is a unit test.

Clocks: the attempt logs and the audit log both use the system's wall clock
(``CLOCK_REALTIME``) on the one machine, so their times subtract directly.
"""

from __future__ import annotations

import datetime
import json
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass


class MeasureError(Exception):
    """Input that should have come from our own processes does not parse."""


# ------------------------------------------------------------------ attempt logs


@dataclass(frozen=True, slots=True)
class Attempt:
    """One line of an IMEX stand-in's attempt log (see ``imex_standin.AttemptLog``)."""

    ev: str  # "attempt" | "lost" | "listening"
    t: float  # start of the attempt (wall clock)
    te: float  # end (for "lost" and "listening": the same as t)
    peer: int  # the node id dialled (-1 for "listening": the daemon's own address)
    ip: str | None
    outcome: str  # connected, mismatch, no_address, refused, timeout, unreachable, error, lost


def parse_attempts(text: str) -> list[Attempt]:
    """All complete lines of an attempt log; a last line without its newline (still being
    written) is left for the next read. A complete line that does not parse is an error."""
    out: list[Attempt] = []
    lines = text.split("\n")
    for n, line in enumerate(lines[:-1], 1):  # the part after the last \n is incomplete
        if not line.strip():
            continue
        try:
            doc = json.loads(line)
            ev = str(doc["ev"])
            t = float(doc["t"])
            out.append(Attempt(ev, t, float(doc.get("te", t)), int(doc.get("peer", -1)),
                               None if doc.get("ip") is None else str(doc["ip"]),
                               str(doc.get("outcome", "lost" if ev == "lost" else ""))))
        except (ValueError, KeyError, TypeError) as e:
            raise MeasureError(f"attempt log line {n}: {e}: {line[:200]!r}") from e
    return out


def events_since(events: Sequence[Attempt], t: float, slack: float = 5.0) -> list[Attempt]:
    """The events that started or ended at ``t`` or later, scanning only the log's tail:
    lines are appended in time order, give or take an attempt's duration (``slack``)."""
    lo = 0
    for i in range(len(events) - 1, -1, -1):
        if events[i].te < t - slack:
            lo = i + 1
            break
    return [a for a in events[lo:] if a.t >= t or a.te >= t]


def first_connected(attempts: Iterable[Attempt], peer: int, ip: str, after: float
                    ) -> float | None:
    """When this log's IMEX first finished a CONNECTED handshake with ``peer`` at ``ip``
    after ``after`` (None: not yet)."""
    times = [a.te for a in attempts if a.ev == "attempt" and a.outcome == "connected"
             and a.peer == peer and a.ip == ip and a.te >= after]
    return min(times) if times else None


def all_connected_at(logs: Mapping[str, Sequence[Attempt]], peer: int, ip: str,
                     after: float) -> float | None:
    """The moment the last of ``logs`` (one per peer VM) connected to ``peer`` at ``ip``."""
    times = []
    for attempts in logs.values():
        t = first_connected(attempts, peer, ip, after)
        if t is None:
            return None
        times.append(t)
    return max(times) if times else None


@dataclass(frozen=True)
class Stale:
    """Attempts to a dead address after a moment (the crash scenario)."""

    attempts: int  # how many started after the moment, over all peers
    last: float | None  # when the last of them started (None: there was none)
    per_peer: dict[str, int]


def stale_attempts(logs: Mapping[str, Sequence[Attempt]], ip: str, after: float) -> Stale:
    per: dict[str, int] = {}
    last: float | None = None
    for vm, attempts in logs.items():
        hits = [a for a in attempts if a.ev == "attempt" and a.ip == ip and a.t >= after]
        per[vm] = len(hits)
        for a in hits:
            last = a.t if last is None else max(last, a.t)
    return Stale(sum(per.values()), last, per)


def attempts_by_ip(attempts: Iterable[Attempt], after: float = 0.0) -> dict[str, int]:
    out: dict[str, int] = {}
    for a in attempts:
        if a.ev == "attempt" and a.ip is not None and a.t >= after:
            out[a.ip] = out.get(a.ip, 0) + 1
    return out


# ------------------------------------------------------------------ audit log


def rfc3339(text: str) -> float:
    """An RFC 3339 time as kube-apiserver writes it (``2026-12-01T11:22:33.123456Z``)."""
    try:
        return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()
    except ValueError as e:
        raise MeasureError(f"not an RFC 3339 time: {text!r}") from e


@dataclass(frozen=True, slots=True)
class AuditEvent:
    user_agent: str
    verb: str
    resource: str
    subresource: str
    name: str
    code: int
    received: float  # requestReceivedTimestamp: when the request reached the apiserver
    completed: float  # stageTimestamp of ResponseComplete


def parse_audit(lines: Iterable[str]) -> list[AuditEvent]:
    """ResponseComplete events of a JSON audit log; other stages and bad lines are skipped
    (the apiserver writes whole lines; a partial last line is still being written)."""
    out = []
    for line in lines:
        try:
            ev = json.loads(line)
        except ValueError:
            continue
        if not isinstance(ev, dict) or ev.get("stage") != "ResponseComplete":
            continue
        ref = ev.get("objectRef") or {}
        try:
            out.append(AuditEvent(
                str(ev.get("userAgent", "")), str(ev.get("verb", "")),
                str(ref.get("resource", "")), str(ref.get("subresource", "")),
                str(ref.get("name", "")), int((ev.get("responseStatus") or {}).get("code", 0)),
                rfc3339(ev["requestReceivedTimestamp"]), rfc3339(ev["stageTimestamp"])))
        except (KeyError, MeasureError):
            continue
    return out


def received_at(events: Iterable[AuditEvent], user_agent: str) -> float | None:
    """When the one successful request sent with ``user_agent`` reached the API."""
    hits = [e.received for e in events if e.user_agent == user_agent and 200 <= e.code < 300]
    if len(hits) > 1:
        raise MeasureError(f"{len(hits)} audit events carry user agent {user_agent!r}")
    return hits[0] if hits else None


# ------------------------------------------------------------------ prometheus text


def parse_prometheus(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Samples of a Prometheus text exposition: (name, labels) -> value."""
    out: dict[tuple[str, frozenset[tuple[str, str]]], float] = {}
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        if "{" in line:
            name, _, rest = line.partition("{")
            labels_text, _, value_text = rest.rpartition("}")
            labels = frozenset(_labels(labels_text))
        else:
            name, _, value_text = line.partition(" ")
            labels = frozenset()
        value = value_text.split()[0] if value_text.split() else ""
        try:
            out[(name.strip(), labels)] = float(value)
        except ValueError as e:
            raise MeasureError(f"bad sample line {raw!r}") from e
    return out


def _labels(text: str) -> list[tuple[str, str]]:
    out = []
    i = 0
    while i < len(text):
        eq = text.index("=", i)
        key = text[i:eq].strip().lstrip(",").strip()
        if text[eq + 1] != '"':
            raise MeasureError(f"label {key} without a quoted value in {{{text}}}")
        j = eq + 2
        value = []
        while text[j] != '"':
            if text[j] == "\\":
                j += 1
                value.append({"n": "\n"}.get(text[j], text[j]))
            else:
                value.append(text[j])
            j += 1
        out.append((key, "".join(value)))
        i = j + 1
        while i < len(text) and text[i] in ", ":
            i += 1
    return out


def metric_sum(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
               **match: str) -> float:
    """Sum of every sample of ``name`` whose labels include ``match``."""
    want = set(match.items())
    return sum(v for (n, labels), v in samples.items() if n == name and want <= labels)


def by_label(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str,
             label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for (n, labels), v in samples.items():
        if n != name:
            continue
        key = dict(labels).get(label, "")
        out[key] = out.get(key, 0.0) + v
    return out


# ------------------------------------------------------------------ statistics and ratios


def percentile(values: Sequence[float], q: float) -> float | None:
    """Nearest-rank percentile (q in 0..100); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def speedup(recipe: float | None, ours: float | None) -> float | None:
    """recipe / ours for times (how many times faster ours is); None when either is missing
    or ours is 0."""
    if recipe is None or ours is None or ours <= 0:
        return None
    return recipe / ours


def fewer(recipe: float | None, ours: float | None, window_s: float) -> float | None:
    """recipe / max(ours, 1 query per window) for rates: ours may be 0 in steady state, and
    a ratio against 0 says nothing, so ours counts as at least one query in the window."""
    if recipe is None or ours is None or window_s <= 0:
        return None
    return recipe / max(ours, 1.0 / window_s)


def qps(before: float, after: float, seconds: float) -> float:
    if seconds <= 0:
        raise MeasureError(f"a rate over {seconds} s")
    if after < before:
        raise MeasureError(f"counter went down ({before} -> {after}): the server restarted?")
    return (after - before) / seconds
