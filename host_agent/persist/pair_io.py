"""Which source holds an ensemble's (generation, GuestView) pair, and the step each pass takes.

Service-only ensembles keep the pair in the Service annotation (``membership.py``),
ImexEnsembles in their status (``membership_cr.py``); ``spec.source`` decides, so a CR
that cannot take over (its labelled Service keeps working as a Service-only
ensemble) uses the annotation.

Each reconcile pass calls ``settle``: a follower serves the pair it observed; the
leader compares it with the view its own caches give and writes a new pair first
when they differ (``next_pair``), then serves what the API answered.

Never backwards, also when an ensemble switches between the two kinds of source:

- Service-only -> ImexEnsemble (adoption): the CR source observes the larger of its
  status pair and the annotation, and while the annotation exists the leader writes
  the pair into the status under the same generation (no guest wakes up) and then
  removes the annotation.
- ImexEnsemble -> Service-only (the CR refused in favour of its Service, or deleted
  with ``--cascade=orphan``): the annotation is gone by then, so the leader starts a
  new pair at max(wall clock in ms, the largest number this process served + 1).
- A replica never serves a pair below one it already served (a hand edit, a source
  that lags): it keeps its current snapshot until the leader has repaired the pair.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from host_agent.kube.client import KubeError
from host_agent.kube.leadership import WriteGate
from host_agent.kube.objects import Key
from host_agent.metrics import HostMetrics
from host_agent.persist.pair import (
    PairSource,
    PersistedView,
    ServiceAnnotationSource,
    next_pair,
    wall_ms,
)
from host_agent.persist.pair_status import StatusPairSource, pair_from_status
from host_agent.state.store import Absent, CaPublished, EnsembleSpec, State
from imex_shared.model import Member


class Pairs:
    def __init__(self, annotations: ServiceAnnotationSource, state: State, gate: WriteGate,
                 metrics: HostMetrics, crs: StatusPairSource | None = None) -> None:
        self._annotations = annotations
        self._crs = crs
        self._state = state
        self._gate = gate
        self._metrics = metrics

    def source(self, spec: EnsembleSpec) -> PairSource:
        if spec.source == "cr" and self._crs is not None:
            return self._crs
        return self._annotations

    def service_echo(self, key: Key, service: Mapping[str, Any] | None) -> bool:
        """Our own membership annotation write coming back: nothing to do."""
        return self._annotations.is_echo(key, service)

    def cr_pair_changed(self, old: Mapping[str, Any] | None,
                        new: Mapping[str, Any] | None) -> bool:
        """A CR event that changes the pair its status holds (a follower must serve it;
        the leader's own write coming back does not count)."""
        if self._crs is None or old is None or new is None:
            return False
        meta = new.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if self._crs.is_echo(key, new):
            return False
        return pair_from_status(old.get("status"))[0] != pair_from_status(new.get("status"))[0]

    def forget(self, key: Key) -> None:
        self._annotations.forget(key)

    async def settle(
        self, key: Key, spec: EnsembleSpec, members: list[Member],
        addresses: Mapping[int, frozenset[str]], ca: CaPublished | None,
        problems: list[str], absent: tuple[Absent, ...],
    ) -> PersistedView | None:
        """The pair to serve now (None: nothing servable yet, keep what is served)."""
        source = self.source(spec)
        observed = source.observed(key)
        floor = self._state.served_floor(spec.ens)
        if not self._gate.may_write():
            if observed is not None and observed.generation < floor:
                return None  # below what we served: wait for the leader's repair
            return observed
        view, since = self._state.desired_view(spec, members, addresses, ca)
        want = next_pair(observed, view, since, floor=floor, now_ms=wall_ms(),
                         relocate=source.misplaced(key))
        if want is None:
            return observed
        preview = self._state.preview_observed(
            spec, members, problems, addresses, want.generation, want.view, want.since_map(),
            ca=ca, absent=absent)
        try:
            written = await source.write(key, want, preview)
        except KubeError as exc:
            self._metrics.membership_writes.labels(
                "conflict" if exc.status == 409 else "error").inc()
            raise
        self._metrics.membership_writes.labels("ok").inc()
        return written
