"""Invariant 6, continuously: no replica serves a generation older than one it observed.

TEST CODE. What a replica has observed comes from the API double's delivery log
(tests/sandbox/kube_api/audit.py): every version of a Service or an ImexEnsemble the
double sent that replica (list items, watch events, gets, the answers to its own
writes), with the membership generation it carries (host_agent/persist/pair.py: the
Service's annotation, the CR's status). Each delivery becomes an *obligation*: from
:attr:`Observed.bound` seconds after it, that replica must serve at least that
generation. The bound is the time a replica may take to act on what it was sent (its
next reconcile pass); it counts from the later of the delivery and the end of the
replica's last pause, because a SIGSTOPped replica reads its socket only after SIGCONT.
A replica that was restarted owes nothing for what its previous process was sent.

Pure bookkeeping, no I/O: invariants.Continuous feeds it the deliveries, the replicas'
pauses and restarts, and the generations the replicas serve.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

#: seconds a replica may take to serve a generation it was sent
BOUND_S = 10.0


def generation_of(resource: str, obj: Mapping[str, Any]) -> int | None:
    """The membership generation ``obj`` carries: a Service's annotation pair or an
    ImexEnsemble's status pair; None when it carries none (or one that does not
    parse: the agent ignores it as well)."""
    from host_agent.persist.pair import from_service, pair_from_status

    try:
        if resource.split("/")[0] == "services":
            pair, _ = from_service(dict(obj))
        else:
            pair, _ = pair_from_status(obj.get("status"))
    except Exception:
        return None
    return pair.generation if pair is not None else None


@dataclass
class Observed:
    """Obligations per (replica, ensemble key): (delivered at, generation)."""

    bound: float = BOUND_S
    due: dict[tuple[str, str], list[tuple[float, int]]] = field(default_factory=dict)
    #: replica -> when its last pause or restart ended (wall clock)
    resumed: dict[str, float] = field(default_factory=dict)
    delivered: int = 0
    checked: int = 0

    def deliver(self, replica: str, key: str, t: float, generation: int) -> None:
        self.delivered += 1
        self.due.setdefault((replica, key), []).append((t, generation))

    def paused(self, replica: str, now: float) -> None:
        """The replica is stopped or down at ``now``: what it owes waits for it."""
        self.resumed[replica] = max(now, self.resumed.get(replica, now))

    def restarted(self, replica: str, now: float) -> None:
        """A new process at ``now``: the old one's deliveries are owed by nobody."""
        for (r, key), obligations in self.due.items():
            if r == replica:
                self.due[(r, key)] = [o for o in obligations if o[0] >= now]
        self.paused(replica, now)

    def check(self, replica: str, key: str, served: int | None, now: float) -> str | None:
        """Compare what ``replica`` serves for ``key`` (read at ``now``) with what it
        owes; returns the violation, if any. Obligations met are dropped; None served
        (not serving the ensemble yet) owes nothing yet."""
        obligations = self.due.get((replica, key))
        if served is None or not obligations:
            return None
        self.checked += 1
        start = self.resumed.get(replica, 0.0)
        keep, late = [], []
        for t, g in obligations:
            if g <= served:
                continue
            if now - max(t, start) >= self.bound:
                late.append(g)
            else:
                keep.append((t, g))
        self.due[(replica, key)] = keep  # a late one is reported once
        if late:
            return (f"{key}: replica {replica} serves generation {served}, more than "
                    f"{self.bound:.0f} s after it was sent {max(late)}")
        return None
