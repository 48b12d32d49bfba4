"""In-memory ensemble state: the one source of truth of the host agent.

The reconciler writes it (``State.set`` with the whole desired member list of
an ensemble, level-triggered); the EndpointSlice publisher and the registry
read the same immutable ``EnsembleSnapshot``. So the slice, the JSON and the
text views can never disagree about who is in an ensemble.

Generation rule (DESIGN.md "Registry HTTP API", widened in docs/design.md
"Changes"): one number per ensemble that grows by one on every change of
``GuestView``, everything any guest would write (today the published slot->IP
map), never otherwise;
the first value is the agent's start time in milliseconds (or the moment the
ensemble first appears, if later), so a restarted agent never reissues a
number a guest holds.

Across replicas (docs/design.md "Changes"): with leader election the
generation is not counted here but persisted in the API by the leader
(``host_agent/persist/pair.py``); ``set_observed`` serves exactly such an
observed (generation, GuestView) pair, decorated with this replica's own view
of each member's VMI (phase, ready, node). ``set`` keeps the local count for
the sidecar, which sees one VMI and persists nothing.

A long-poll with ``wait=G`` is answered once the generation is **greater**
than G, not merely different: a guest holding a number from a replica that
is ahead then waits on one that lags, instead of looping.

Waiting: a long-poller parks on a future shared by every waiter of its
ensemble whose deadline falls in the same 100 ms bucket; a generation change
(or ``drop``/``close``) resolves all of the ensemble's futures at once, and
one timer per bucket resolves the futures whose deadline has come. So
thousands of waiters cost one wake-up per ensemble, not a task or timer each,
and each waiter awaits exactly one future: nothing has to unhook thousands of
callbacks afterwards (``asyncio.wait`` on two shared futures would, which is
quadratic). Waiters await through ``asyncio.shield``, so a cancelled request
never cancels the future its neighbours share. A timeout fires up to one
bucket (100 ms) late, never early.
Everything here runs on the event loop thread; nothing blocks.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace

from host_agent.state.shared import clique_members, shared_of
from host_agent.state.snapshot import (
    Absent,
    CaPublished,
    EnsembleSnapshot,
    EnsembleSpec,
    GuestReport,
    GuestView,
    PublishedMember,
)
from imex_shared.model import EnsembleId, Member

_BUCKET_S = 0.1


class _Entry:
    __slots__ = ("observed", "snapshot", "waits")

    def __init__(self, snapshot: EnsembleSnapshot, observed: bool = False) -> None:
        self.snapshot = snapshot
        #: served from an observed (generation, GuestView) pair: the leader counts
        self.observed = observed
        #: deadline bucket -> the future its waiters share
        self.waits: dict[int, asyncio.Future[None]] = {}

    def wake(self) -> None:
        for fut in self.waits.values():
            if not fut.done():
                fut.set_result(None)
        self.waits.clear()


class State:
    """All ensembles the agent knows, keyed by EnsembleId."""

    def __init__(self, *, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._start_ms = int(clock() * 1000)
        self._entries: dict[EnsembleId, _Entry] = {}
        #: deadline bucket -> entries with waiters in that bucket (one timer each)
        self._deadlines: dict[int, list[_Entry]] = {}
        #: one timer per deadline bucket, cancelled by ``close``
        self._deadline_timers: dict[int, asyncio.TimerHandle] = {}
        #: the largest generation served per ensemble (kept after a drop): never go below
        self._floor: dict[EnsembleId, int] = {}
        self.synced = False
        self.closed = False
        #: called with an ensemble whose reports changed what guests would write while it
        #: is served from an observed pair (the reconciler queues a pass)
        self.on_view_news: Callable[[EnsembleId], None] | None = None
        self._listeners: list[Callable[[EnsembleId], None]] = []
        #: NVLink clique -> the ensembles whose published members report it, and each
        #: ensemble's cliques (state/shared.py): who shares a clique with whom
        self._by_clique: dict[str, set[EnsembleId]] = {}
        self._cliques_of: dict[EnsembleId, frozenset[str]] = {}

    # -- writing (reconciler) ------------------------------------------------

    def set(
        self,
        spec: EnsembleSpec,
        members: Iterable[Member],
        problems: Iterable[str],
        addresses: Mapping[int, frozenset[str]] | None = None,
        ca: CaPublished | None = None,
        absent: tuple[Absent, ...] = (),
    ) -> tuple[EnsembleSnapshot, bool]:
        """Replace an ensemble's whole state; returns (snapshot, map_changed).

        The generation grows by one only when ``GuestView`` changed (the
        slot->IP map, the CA bundle). ``addresses`` (index -> every address of
        the member's VMI) only feeds the registry's check of where a guest's
        report may come from.
        """
        now = self._clock()
        extra = addresses or {}
        ordered = sorted(members, key=lambda m: m.index)
        entry = self._entries.get(spec.ens)
        problems_t = tuple(problems)
        if entry is None:
            generation = max(self._start_ms, int(now * 1000))
            published = tuple(
                PublishedMember(m, now, extra.get(m.index, frozenset())) for m in ordered
            )
            snap = EnsembleSnapshot(spec, generation, published, problems_t, now, ca=ca,
                                    absent=absent)
            self._entries[spec.ens] = _Entry(snap)
            self._notify(spec.ens)
            return snap, True
        entry.observed = False
        old = entry.snapshot
        old_by_index = {p.member.index: p for p in old.members}
        published = tuple(
            PublishedMember(
                m,
                old_by_index[m.index].since
                if m.index in old_by_index and old_by_index[m.index].member.ip == m.ip
                else now,
                extra.get(m.index, frozenset()),
            )
            for m in ordered
        )
        indices = {m.index for m in ordered}
        reports = {i: r for i, r in old.reports.items() if i in indices}
        view = GuestView.of(published, ca, reports)
        changed = view != GuestView.of(old.members, old.ca, old.reports)
        snap = EnsembleSnapshot(
            spec,
            old.generation + 1 if changed else old.generation,
            published,
            problems_t,
            now if changed else old.changed_at,
            reports,
            ca,
            view.cliques,
            absent,
        )
        entry.snapshot = snap
        if changed:
            entry.wake()
        self._floor[spec.ens] = max(self._floor.get(spec.ens, 0), snap.generation)
        self._notify(spec.ens)
        return snap, changed

    def _published(
        self,
        spec: EnsembleSpec,
        pins: Iterable[tuple[int, str]],
        local: Mapping[int, Member],
        addresses: Mapping[int, frozenset[str]],
        since: Mapping[int, float],
        now: float,
    ) -> tuple[PublishedMember, ...]:
        entry = self._entries.get(spec.ens)
        old = {p.member.index: p for p in entry.snapshot.members} if entry else {}
        out = []
        for index, ip in sorted(pins):
            m = local.get(index)
            member = Member(index, ip) if m is None else (m if m.ip == ip else replace(m, ip=ip))
            before = old.get(index)
            at = since.get(index)
            if at is None:
                at = before.since if before is not None and before.member.ip == ip else now
            out.append(PublishedMember(member, at, addresses.get(index, frozenset())))
        return tuple(out)

    def desired_view(
        self,
        spec: EnsembleSpec,
        members: Iterable[Member],
        addresses: Mapping[int, frozenset[str]] | None = None,
        ca: CaPublished | None = None,
    ) -> tuple[GuestView, dict[int, float]]:
        """What ``set`` would publish for these members: the GuestView and, per slot,
        since when it has its IP (kept from the current snapshot where unchanged)."""
        local = {m.index: m for m in members}
        published = self._published(spec, ((i, m.ip) for i, m in local.items()), local,
                                    addresses or {}, {}, self._clock())
        current = self.get(spec.ens)
        reports = current.reports if current is not None else {}
        return GuestView.of(published, ca, reports), {p.index: p.since for p in published}

    def served_floor(self, ens: EnsembleId) -> int:
        """The largest generation this process ever served for ``ens`` (0: none)."""
        return self._floor.get(ens, 0)

    def set_observed(
        self,
        spec: EnsembleSpec,
        members: Iterable[Member],
        problems: Iterable[str],
        addresses: Mapping[int, frozenset[str]] | None,
        generation: int,
        view: GuestView,
        since: Mapping[int, float] | None = None,
        ca: CaPublished | None = None,
        absent: tuple[Absent, ...] = (),
    ) -> tuple[EnsembleSnapshot, bool]:
        """Serve an observed (generation, view) pair; returns (snapshot, generation_changed).

        The pins come from ``view``, never from ``members``: those only decorate
        each pinned slot (vmi, node, phase, ready) and give the addresses a
        guest's report may come from.
        """
        snap = self.preview_observed(spec, members, problems, addresses, generation, view,
                                     since, ca, absent)
        entry = self._entries.get(spec.ens)
        if entry is None:
            self._entries[spec.ens] = _Entry(snap, observed=True)
            changed = True
        else:
            entry.observed = True
            changed = generation != entry.snapshot.generation
            entry.snapshot = snap
            if changed:
                entry.wake()
        self._floor[spec.ens] = max(self._floor.get(spec.ens, 0), generation)
        self._notify(spec.ens)
        return snap, changed

    def preview_observed(
        self,
        spec: EnsembleSpec,
        members: Iterable[Member],
        problems: Iterable[str],
        addresses: Mapping[int, frozenset[str]] | None,
        generation: int,
        view: GuestView,
        since: Mapping[int, float] | None = None,
        ca: CaPublished | None = None,
        absent: tuple[Absent, ...] = (),
    ) -> EnsembleSnapshot:
        """The snapshot ``set_observed`` would serve, not served: what the leader's write
        of a new pair describes (an ImexEnsemble's status carries all of it)."""
        now = self._clock()
        local = {m.index: m for m in members}
        published = self._published(spec, view.pins, local, addresses or {}, since or {}, now)
        entry = self._entries.get(spec.ens)
        problems_t = tuple(problems)
        if entry is None:
            return EnsembleSnapshot(spec, generation, published, problems_t, now, ca=ca,
                                    cliques=view.cliques, absent=absent)
        old = entry.snapshot
        pinned = {p.index for p in published}
        reports = {i: r for i, r in old.reports.items() if i in pinned}
        return EnsembleSnapshot(spec, generation, published, problems_t,
                                now if generation != old.generation else old.changed_at,
                                reports, ca, view.cliques, absent)

    def drop(self, ens: EnsembleId) -> bool:
        """Forget an ensemble (its Service is gone); waiters are answered."""
        entry = self._entries.pop(ens, None)
        if entry is None:
            return False
        entry.wake()
        self._notify(ens)
        return True

    def report(self, ens: EnsembleId, index: int, report: GuestReport) -> EnsembleSnapshot | None:
        """Store a guest's report.

        A report that changes ``GuestView`` (its clique splits the ensemble, or moves a
        member between cliques) moves the generation here when this process counts; when
        it serves observed pairs it calls ``on_view_news`` instead, so the leader's next
        pass persists the new view (and every replica serves it).
        """
        entry = self._entries.get(ens)
        if entry is None:
            return None
        old = entry.snapshot
        reports = dict(old.reports)
        reports[index] = report
        cliques = GuestView.of(old.members, old.ca, reports).cliques
        if cliques == old.cliques:
            entry.snapshot = replace(old, reports=reports)
        elif entry.observed:
            entry.snapshot = replace(old, reports=reports)
            if self.on_view_news is not None:
                self.on_view_news(ens)
        else:
            entry.snapshot = replace(old, reports=reports, generation=old.generation + 1,
                                     changed_at=self._clock(), cliques=cliques)
            self._floor[ens] = max(self._floor.get(ens, 0), entry.snapshot.generation)
            entry.wake()
        self._notify(ens)
        return entry.snapshot

    def subscribe(self, listener: Callable[[EnsembleId], None]) -> None:
        """Call ``listener(ens)`` after every ``set``, ``report`` and ``drop`` of ``ens``.

        For what follows the snapshot without being asked (the ImexEnsemble status
        writer): a listener must not block (it schedules, it does not write).
        """
        self._listeners.append(listener)

    def _notify(self, ens: EnsembleId) -> None:
        for other in self._reindex(ens):
            for listener in self._listeners:
                listener(other)

    def _reindex(self, ens: EnsembleId) -> list[EnsembleId]:
        """Keep the clique index true after ``ens`` changed; the ensembles whose
        listeners must hear of it: ``ens``, and every other whose ``shared`` moved."""
        entry = self._entries.get(ens)
        new = frozenset(clique_members(entry.snapshot)) if entry is not None else frozenset()
        old = self._cliques_of.get(ens, frozenset())
        touched = {ens}
        if new != old:
            for key in old - new:
                holders = self._by_clique.get(key, set())
                holders.discard(ens)
                touched |= holders
                if not holders:
                    self._by_clique.pop(key, None)
            for key in new - old:
                holders = self._by_clique.setdefault(key, set())
                touched |= holders
                holders.add(ens)
            if new:
                self._cliques_of[ens] = new
            else:
                self._cliques_of.pop(ens, None)
        out = [ens]
        for e in sorted(touched, key=lambda x: x.key):
            item = self._entries.get(e)
            if item is None:
                continue
            shared = shared_of(e, self._cliques_of.get(e, ()), self._by_clique)
            if shared != item.snapshot.shared:
                item.snapshot = replace(item.snapshot, shared=shared)
                if e != ens:
                    out.append(e)
        return out

    def mark_synced(self) -> None:
        self.synced = True

    def close(self) -> None:
        """Answer every pending long-poll (graceful shutdown)."""
        self.closed = True
        for entry in self._entries.values():
            entry.wake()
        self._deadlines.clear()
        for handle in self._deadline_timers.values():
            handle.cancel()
        self._deadline_timers.clear()

    # -- reading (publisher, registry) ---------------------------------------

    def get(self, ens: EnsembleId) -> EnsembleSnapshot | None:
        entry = self._entries.get(ens)
        return entry.snapshot if entry is not None else None

    def all(self) -> list[EnsembleSnapshot]:
        return [self._entries[k].snapshot for k in sorted(self._entries, key=lambda e: e.key)]

    def waiters(self) -> int:
        """Ensembles with at least one pending long-poll (for metrics)."""
        return sum(1 for e in self._entries.values() if e.waits)

    async def wait_for_change(
        self, ens: EnsembleId, generation: int, timeout: float
    ) -> EnsembleSnapshot | None:
        """The snapshot once its generation is greater than ``generation``, or at ``timeout``.

        Greater, not different: a replica that lags behind the number a guest
        holds keeps the guest parked until it has caught up and moved past it.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while True:
            entry = self._entries.get(ens)
            if entry is None or entry.snapshot.generation > generation or self.closed:
                return entry.snapshot if entry is not None else None
            left = deadline - loop.time()
            if left <= 0:
                return entry.snapshot
            bucket = math.ceil((loop.time() + left) / _BUCKET_S)
            fut = entry.waits.get(bucket)
            if fut is None:
                fut = loop.create_future()
                entry.waits[bucket] = fut
                due = self._deadlines.get(bucket)
                if due is None:
                    self._deadlines[bucket] = due = []
                    self._deadline_timers[bucket] = loop.call_at(
                        bucket * _BUCKET_S, self._expire, bucket)
                due.append(entry)
            await asyncio.shield(fut)
            if loop.time() >= bucket * _BUCKET_S - 1e-3:
                return self.get(ens)  # the deadline's own wake-up

    def _expire(self, bucket: int) -> None:
        self._deadline_timers.pop(bucket, None)
        for entry in self._deadlines.pop(bucket, ()):
            fut = entry.waits.pop(bucket, None)
            if fut is not None and not fut.done():
                fut.set_result(None)
