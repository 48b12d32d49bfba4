"""Invariant 4 on the real apiserver: no 2xx write from a replica that did not hold the Lease.

TEST CODE for ``make soak-realk8s`` (tests/soak/realk8s.py). The API double records the
holder at each write's commit itself; kube-apiserver cannot, so this reads its audit log
instead (tests/realk8s/harness.py: JSON lines, ResponseComplete stage, Lease requests at
RequestResponse level so that each answer names its holder). One apiserver at a time
writes the log, so its timestamps are one clock, across restarts too.

The rule, per write of a guarded kind answered 2xx by a host agent (its User-Agent
``imex-host-agent/V (IDENT)``): the holder is the ``holderIdentity`` of the last Lease
write that *completed before the write was received*. A write received while a
takeover was in flight is not judged (the apiserver may have committed it first); a
write received after the takeover completed is stale. Stale attempts the API refused
(409 on a precondition, 403, ...) and stale Events are counted, not violations.

Pure: :class:`Ledger` is fed parsed lines and holds back the newest ones for a moment,
since the log is written at completion and a Lease write that completed first can land
on a later line.
"""

from __future__ import annotations

import bisect
import datetime as dt
import json
from dataclasses import dataclass, field
from typing import Any

#: the kinds whose 2xx writes only the Lease holder may make
GUARDED = frozenset({"endpointslices", "services", "imexensembles", "secrets"})
WRITE_VERBS = frozenset({"create", "update", "patch", "delete", "deletecollection"})
AGENT_UA = "imex-host-agent/"
#: seconds a write waits before it is judged, for Lease lines written after it
HOLD_BACK_S = 2.0


@dataclass(frozen=True)
class Event:
    received: float
    completed: float
    verb: str
    resource: str
    subresource: str
    namespace: str
    name: str
    code: int
    user_agent: str
    #: a Lease answer's holderIdentity ("" when released); None for other requests
    holder: str | None = None

    @property
    def ident(self) -> str:
        return ident_of(self.user_agent)


def ident_of(user_agent: str) -> str:
    """The replica a host agent's User-Agent names (``imex-host-agent/V (IDENT)``)."""
    return user_agent.rsplit("(", 1)[-1].rstrip(")")


def _ts(value: Any) -> float:
    return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


def parse(line: str) -> Event | None:
    """One audit log line; None for a line that is not a complete request's event."""
    try:
        ev = json.loads(line)
        if ev.get("stage") != "ResponseComplete":
            return None
        ref = ev.get("objectRef") or {}
        holder = None
        if ref.get("resource") == "leases":
            body = ev.get("responseObject") or {}
            if body.get("kind") == "Lease":
                holder = str((body.get("spec") or {}).get("holderIdentity") or "")
        return Event(received=_ts(ev["requestReceivedTimestamp"]),
                     completed=_ts(ev["stageTimestamp"]), verb=str(ev.get("verb", "")),
                     resource=str(ref.get("resource", "")),
                     subresource=str(ref.get("subresource", "")),
                     namespace=str(ref.get("namespace", "")), name=str(ref.get("name", "")),
                     code=int((ev.get("responseStatus") or {}).get("code", 0)),
                     user_agent=str(ev.get("userAgent", "")), holder=holder)
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


@dataclass
class Ledger:
    """The Lease's holders over time and the judged writes."""

    lease_namespace: str
    lease_name: str
    #: (completed, holder) of every 2xx Lease write, in completion order
    holders: list[tuple[float, str]] = field(default_factory=list)
    pending: list[Event] = field(default_factory=list)
    newest: float = 0.0
    writes_seen: int = 0
    guarded_writes: int = 0
    stale_refused: int = 0
    stale_events: int = 0

    def feed(self, events: list[Event], *, final: bool = False) -> list[str]:
        """Take new events; returns the stale 2xx writes found (one line each)."""
        for ev in events:
            self.newest = max(self.newest, ev.completed)
            if ev.resource == "leases" and ev.namespace == self.lease_namespace \
                    and ev.name == self.lease_name and ev.verb in WRITE_VERBS \
                    and 200 <= ev.code < 300:
                holder = "" if ev.verb == "delete" else (ev.holder or "")
                bisect.insort(self.holders, (ev.completed, holder))
            elif ev.verb in WRITE_VERBS and ev.user_agent.startswith(AGENT_UA):
                self.pending.append(ev)
        cut = float("inf") if final else self.newest - HOLD_BACK_S
        ready = [ev for ev in self.pending if ev.completed <= cut]
        self.pending = [ev for ev in self.pending if ev.completed > cut]
        return [why for ev in ready if (why := self._judge(ev)) is not None]

    def holder_at(self, t: float) -> str:
        """The holder named by the last Lease write completed before ``t`` ("" if none)."""
        i = bisect.bisect_left(self.holders, (t, ""))
        return self.holders[i - 1][1] if i else ""

    def _judge(self, ev: Event) -> str | None:
        self.writes_seen += 1
        holder = self.holder_at(ev.received)
        stale = ev.ident != holder
        if ev.resource == "events":
            self.stale_events += stale and 200 <= ev.code < 300
            return None
        if ev.resource not in GUARDED:
            return None
        self.guarded_writes += 1
        if not stale:
            return None
        if not 200 <= ev.code < 300:
            self.stale_refused += 1
            return None
        sub = f"/{ev.subresource}" if ev.subresource else ""
        return (f"{ev.ident} wrote {ev.verb} {ev.resource}{sub} {ev.namespace}/{ev.name} "
                f"({ev.code}) at {_clock(ev.received)} while the Lease holder was "
                f"{holder or 'nobody'}")


def _clock(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).strftime("%H:%M:%S.%f")[:-3]
