"""Per-ensemble reconcile: cache -> members -> state -> EndpointSlices.

Concurrency (the work queue's rules): an ensemble is queued at most
once; while it is being reconciled, new events only mark it dirty and it is
queued again when the pass ends. So passes for one ensemble are serialized,
different ensembles run in parallel on ``settings.workers`` workers, and a
burst of events for one ensemble (18 VMIs booting, a relist) collapses into
at most two passes and two writes per slice: pacing.py decides how long each event
waits (nothing for a quiet ensemble's first, ``settings.settle_seconds`` inside a
burst, longer behind a backlog).

Level-triggered: a pass reads only the caches, computes the whole member list
(``state.set`` replaces it) and the whole desired slices, and the applier
writes what differs. A pass that fails (API error) is retried with backoff;
the state it already published stays.

Nothing is reconciled before every informer has listed once: publishing from
half a picture could drop members. ``state.mark_synced()`` follows the first
pass over every ensemble known at that point.

Two sources, one path: which spec is in force (an ImexEnsemble's, or a labelled
Service's) is spec_io.py's; from the spec on, everything is one code path. Each
pass hands its ``Declaration`` (None: nothing declared) to ``on_declared``, which
is where the status and the Events start (the status writer).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from host_agent.backoff import backoff_delay
from host_agent.ca.secret_io import CaManager
from host_agent.ensembles.cr_spec import (
    Declaration,
    spec_changed,
)
from host_agent.ensembles.members import ExamineMemo, derive
from host_agent.ensembles.owned_service_io import ServiceApplier
from host_agent.ensembles.service_spec import ENSEMBLE_LABEL
from host_agent.ensembles.slices import (
    desired_slices,
)
from host_agent.ensembles.slices_io import SliceApplier
from host_agent.kube.cache import Store
from host_agent.kube.leadership import ALWAYS, NotLeader, WriteGate
from host_agent.kube.objects import Key, Obj, object_key
from host_agent.metrics import HostMetrics
from host_agent.persist.pair_io import Pairs
from host_agent.persist.reports import report_applies
from host_agent.reconcile.pacing import Pacing
from host_agent.reconcile.reconcile import member_changes, slice_ensemble, vmi_ensemble
from host_agent.reconcile.spec_io import Specs
from host_agent.settings import HostSettings
from host_agent.state.snapshot import CaPublished, EnsembleSnapshot, EnsembleSpec, GuestReport
from host_agent.state.store import State
from host_agent.workqueue import WorkQueue
from imex_shared.model import EnsembleId, ModelError

log = logging.getLogger("imex.host.reconcile")


Declared = Callable[[Key, Declaration | None], None]


def _ignore(key: Key, declaration: Declaration | None) -> None:
    return None


class Reconciler:
    def __init__(
        self,
        settings: HostSettings,
        state: State,
        vmis: Store,
        services: Store,
        slices: Store,
        applier: SliceApplier,
        metrics: HostMetrics,
        cas: CaManager | None = None,
        *,
        crs: Store | None = None,
        owned: ServiceApplier | None = None,
        on_declared: Declared = _ignore,
        gate: WriteGate = ALWAYS,
        pairs: Pairs | None = None,
        persisted_reports: Callable[[EnsembleId], Mapping[int, GuestReport]] | None = None,
    ) -> None:
        #: reports other replicas (or this one, before a restart) stored in the API
        self._persisted_reports = persisted_reports
        #: the per-ensemble CAs (authEncryption); None: no Secrets are touched at all.
        self._cas = cas
        self._settings = settings
        self._crs = crs if crs is not None else Store("imexensemble")
        self._owned = owned
        self._on_declared = on_declared
        #: keys to look at again, this many seconds after their pass: a CR whose name a
        #: Service we cannot see holds (nothing we watch tells us when it goes)
        self._recheck: dict[Key, float] = {}
        #: the CAs' own re-checks (authEncryption), one timer per key, cancelled at stop
        self._ca_rechecks: dict[Key, asyncio.TimerHandle] = {}
        #: every API write waits for this gate (only the leader writes)
        self._gate = gate
        #: where the (generation, view) pair is persisted; None: counted locally (sidecar)
        self._pairs = pairs
        self._state = state
        # a report that changes what guests write (a clique split) needs a pass, so the
        # leader persists the new GuestView (issue 17)
        state.on_view_news = lambda ens: self.enqueue((ens.namespace, ens.name))
        self._vmis = vmis
        self._services = services
        self._slices = slices
        self._applier = applier
        self._metrics = metrics
        self._queue: WorkQueue[Key] = WorkQueue()
        #: keys that arrived before every informer had listed (queued at start)
        self._held: set[Key] = set()
        self._failures: dict[Key, int] = {}
        self._specs = Specs(owned, metrics, settings.conflict_recheck)
        self._last_problems: dict[Key, tuple[str, ...]] = {}
        self._orphans: set[Key] = set()
        self._examine = ExamineMemo()
        #: slice and Service events that came during a pass of their ensemble (``_defer``)
        self._deferred: dict[Key, list[tuple[str, Any]]] = {}
        self._pacing = Pacing(settings.settle_seconds, settings.quiet_seconds,
                              settings.workers)
        self._started = False
        self._initial: set[Key] | None = None
        self.passes = 0
        self.idle = asyncio.Event()

    # -- event intake (called by informers, on the loop thread) --------------

    def on_vmi(self, old: Obj | None, new: Obj | None) -> None:
        if new is None and old is not None:
            self._examine.forget(*object_key(old))
        self._enqueue_keys(vmi_ensemble(o) for o in (old, new) if o is not None)

    def on_service(self, old: Obj | None, new: Obj | None) -> None:
        if new is None and old is not None and self._owned is not None:
            self._owned.forget(*object_key(old))
        if new is not None and old is not None and self._pairs is not None and \
                self._pairs.service_echo(object_key(new), new):
            return  # our own membership annotation coming back: nothing to do
        if new is not None and old is not None and self._pairs is not None and \
                self._defer(object_key(new), ("service", new)):
            return
        self._enqueue_keys(object_key(o) for o in (old, new) if o is not None)

    def on_cr(self, old: Obj | None, new: Obj | None) -> None:
        # Our own status writes come back as CR events; they change nothing a pass reads.
        # Another replica's change of the persisted pair does: this replica serves it.
        if spec_changed(old, new) or (self._pairs is not None
                                      and self._pairs.cr_pair_changed(old, new)):
            self._enqueue_keys(object_key(o) for o in (old, new) if o is not None)

    def resync_all(self) -> None:
        """Queue every ensemble (this replica just became the leader: it wrote nothing
        while it followed, so everything is compared and repaired once)."""
        if not self._started:
            return
        for key in set(self._services.all_keys()) | set(self._crs.all_keys()):
            self.enqueue(key, 0)

    def on_slice(self, old: Obj | None, new: Obj | None) -> None:
        # Our own write coming back would cost a whole pass that finds nothing to
        # do: at steady update rates that was half of all passes.
        obj = new if new is not None else old
        if obj is not None:
            namespace, name = object_key(obj)
            if self._applier.is_echo(namespace, name, new):
                self._metrics.echoes.inc()
                return
            keys = {slice_ensemble(o) for o in (old, new) if o is not None}
            if len(keys) == 1 and (key := keys.pop()) is not None and \
                    self._defer(key, ("slice", (namespace, name, new))):
                return
        self._enqueue_keys(slice_ensemble(o) for o in (old, new) if o is not None)

    def _defer(self, key: Key, event: tuple[str, Any]) -> bool:
        """An event that arrives while ``key``'s pass runs may be that pass's own write
        coming back before the write's answer (the watch is faster than the response):
        is_echo cannot know yet. Look again when the pass ends (``_deferred_news``)
        instead of marking the key dirty for a second pass that would find nothing."""
        if not self._queue.is_active(key):
            return False
        self._deferred.setdefault(key, []).append(event)
        return True

    def _deferred_news(self, key: Key) -> bool:
        """Some event deferred during ``key``'s pass was not the pass's own write."""
        news = False
        for kind, event in self._deferred.pop(key, ()):
            if kind == "service":
                echo = self._pairs is not None and self._pairs.service_echo(key, event)
            else:
                namespace, name, obj = event
                echo = self._applier.is_echo(namespace, name, obj)
                if echo:
                    self._metrics.echoes.inc()
            news = news or not echo
        return news

    def _enqueue_keys(self, keys: Iterable[Key | None]) -> None:
        for key in set(keys):
            if key is not None:
                self.enqueue(key)

    def enqueue(self, key: Key, delay: float | None = None) -> None:
        """Queue ``key`` (once) after ``delay`` (default: the settle time, longer when
        behind, none when the key was quiet). A key that already waits (queued, or on a
        timer: a backoff after an error) keeps its place; one being reconciled is marked
        dirty and passed again."""
        self.idle.clear()
        q = self._queue
        # Every event is recorded (pacing remembers when the key was last touched),
        # even one that finds the key already waiting.
        wait = delay if delay is not None else self._pacing.wait(
            key, asyncio.get_running_loop().time(), q.backlog())
        if q.is_active(key):
            q.mark_dirty(key)
            return
        if q.is_queued(key) or q.has_timer(key) or key in self._held:
            return
        if not self._started:
            self._held.add(key)  # held until the informers have synced
            return
        if wait <= 0:
            q.add(key)
        else:
            q.add_after(key, wait)

    # -- running -------------------------------------------------------------

    async def run(self, synced: Iterable[asyncio.Event]) -> None:
        """Wait for every informer's first list, then reconcile forever."""
        for event in synced:
            await event.wait()
        held = self._held | set(self._services.all_keys()) | set(self._crs.all_keys())
        self._held = set()
        self._initial = set(held)
        self._started = True
        log.info("caches synced: %d ImexEnsembles, %d Services, %d VMIs; reconciling %d "
                 "ensembles", len(self._crs), len(self._services), len(self._vmis), len(held))
        for key in sorted(held):
            self._queue.add(key)
        if not held:
            self._mark_synced()
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(max(1, self._settings.workers)):
                    tg.create_task(self._worker())
        finally:
            self._queue.close()
            for handle in self._ca_rechecks.values():
                handle.cancel()
            self._ca_rechecks.clear()

    def _mark_synced(self) -> None:
        if not self._state.synced:
            self._state.mark_synced()
            log.info("initial reconcile done: %d ensembles published", len(self._state.all()))

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            started = time.perf_counter()
            try:
                await self.reconcile(key)
            except asyncio.CancelledError:
                raise
            except NotLeader:
                # lost leadership between deciding and writing: not an error; whoever
                # leads now reconciles everything when it takes over
                self._metrics.reconciles.labels("not_leader").inc()
                self._queue.done(key)
            except Exception as exc:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = backoff_delay(
                    failures, self._settings.backoff_initial, self._settings.backoff_max
                )
                self._metrics.reconciles.labels("error").inc()
                log.warning(
                    "reconcile of %s/%s failed (%s); retrying in %.2f s",
                    key[0], key[1], exc, delay, extra={"ensemble": f"{key[0]}/{key[1]}"},
                )
                self._queue.done(key)
                self.enqueue(key, delay)
            else:
                self._failures.pop(key, None)
                self._metrics.reconciles.labels("ok").inc()
                if self._deferred_news(key):
                    self._queue.mark_dirty(key)
                if self._queue.done(key):
                    self.enqueue(key)
                elif key in self._recheck:
                    self.enqueue(key, self._recheck.pop(key))
            finally:
                self.passes += 1
                self._metrics.reconcile_seconds.observe(time.perf_counter() - started)
                self._queue.done(key)
                if self._deferred.pop(key, None):  # the pass failed: look again
                    self.enqueue(key)
                if self._initial is not None:
                    self._initial.discard(key)
                    if not self._initial:
                        self._initial = None
                        self._mark_synced()
                if self._queue.pending() == 0:
                    self.idle.set()

    # -- one pass --------------------------------------------------------------

    async def reconcile(self, key: Key) -> None:
        namespace, name = key
        cr = self._crs.get(namespace, name)
        service = self._services.get(namespace, name)
        self._recheck.pop(key, None)
        if cr is None and service is None:
            self._on_declared(key, None)
            self._forget(key)
            self._note_orphans(key)
            return
        self._orphans.discard(key)
        found = await self._specs.resolve(key, cr, service)
        self._on_declared(key, found.declaration)
        if found.recheck is not None:
            self._recheck_after(key, found.recheck)
        spec, problems = found.spec, found.problems
        if spec is None:
            self._report_problems(key, problems)
            self._metrics.problems.labels(namespace, name).set(len(problems))
            return
        await self._publish(key, spec, problems)

    def _schedule_ca_recheck(self, key: Key, delay: float) -> None:
        """Pass ``key`` again after ``delay`` (its CA's overlap ends, or its Secret is due a
        look). A timer of its own, not the queue's: events meanwhile are passed as usual."""
        old = self._ca_rechecks.pop(key, None)
        if old is not None:
            old.cancel()
        self._ca_rechecks[key] = asyncio.get_running_loop().call_later(
            delay, self._ca_recheck_due, key)

    def _ca_recheck_due(self, key: Key) -> None:
        self._ca_rechecks.pop(key, None)
        self.enqueue(key)

    def _recheck_after(self, key: Key, delay: float) -> None:
        """Pass ``key`` again ``delay`` seconds after this pass (the sooner of two asks)."""
        self._recheck[key] = min(delay, self._recheck.get(key, delay))

    async def _publish(self, key: Key, spec: EnsembleSpec, problems: list[str]) -> None:
        """One code path from the spec on: members, state, registry, slices."""
        namespace, name = key
        ident = f"{namespace}/{name}"
        ca_problems, ca = await self._reconcile_ca(key, spec)
        vmis = list(self._vmis.by_index(key))
        derived = derive(spec, vmis, self._examine)
        members = derived.members
        all_problems = [*problems, *ca_problems, *derived.problems]
        addresses = derived.addresses
        before = self._state.get(spec.ens)
        if self._pairs is not None:
            pair = await self._pairs.settle(key, spec, members, addresses, ca, all_problems,
                                            derived.absent)
            if pair is None:  # a follower before the leader persisted anything: not served
                self._report_problems(key, all_problems)
                return
            snap, changed = self._state.set_observed(
                spec, members, all_problems, addresses, pair.generation, pair.view,
                pair.since_map(), ca=ca, absent=derived.absent)
        else:
            snap, changed = self._state.set(spec, members, all_problems, addresses, ca=ca,
                                            absent=derived.absent)
        if self._persisted_reports is not None:
            snap = self._adopt_reports(snap)
        if changed:
            self._log_changes(ident, before, snap)
        self._report_problems(key, all_problems)
        self._metrics.set_ensemble(namespace, name, len(snap.members), len(all_problems))
        if not self._gate.may_write():
            return  # followers serve, the leader writes
        writes = await self._sync_slices(namespace, desired_slices(snap, vmi=self._settings.vmi))
        for write in writes:
            op, slice_name = write.split(":", 1)
            self._metrics.applies.labels(op).inc()
            log.info("%s: %s EndpointSlice %s", ident, "applied" if op == "apply" else "deleted",
                     slice_name, extra={"ensemble": ident})

    def _log_changes(self, ident: str, before: EnsembleSnapshot | None,
                     snap: EnsembleSnapshot) -> None:
        """One INFO line per slot that joined, left or moved. An ensemble this process
        first learns while its caches are still being reconciled (a start or a
        restart) is one DEBUG line: the INFO line is the whole "initial reconcile"."""
        log.debug("%s: %d members published, generation %d", ident, len(snap.members),
                  snap.generation, extra={"ensemble": ident, "members": len(snap.members),
                                          "generation": snap.generation})
        if before is None and not self._state.synced:
            return
        old = {p.index: (p.member.vmi, p.member.ip) for p in before.members} \
            if before is not None else {}
        new = {p.index: (p.member.vmi, p.member.ip) for p in snap.members}
        for change in member_changes(old, new):
            log.info("%s: %s, generation %d", ident, change.text(), snap.generation,
                     extra={"ensemble": ident, "slot": change.slot, "old_ip": change.old_ip,
                            "new_ip": change.new_ip, "generation": snap.generation})

    async def _reconcile_ca(self, key: Key, spec: EnsembleSpec
                            ) -> tuple[list[str], CaPublished | None]:
        """authEncryption: the CA's Secret made right (leader) and its fingerprints. A
        pass comes back by itself when the rotation overlap ends, and every
        ``RECHECK_SECONDS`` (the Secret is not watched: RBAC grants no list/watch)."""
        if not spec.auth_encryption:
            return [], None
        if self._cas is None:
            return [f"{spec.ens.key}: authEncryption is on, but this agent issues no "
                    "certificates (started without CA support)"], None
        outcome = await self._cas.reconcile(spec)
        if outcome.recheck_after is not None:
            self._schedule_ca_recheck(key, outcome.recheck_after)
        if outcome.published is not None:  # an ImexEnsemble has it in status.caSHA256
            await self._cas.publish_on_service(spec, self._services.get(*key),
                                               outcome.published.sha256)
        return list(outcome.problems), outcome.published

    def _adopt_reports(self, snap: EnsembleSnapshot) -> EnsembleSnapshot:
        """Reports stored in the API for members this snapshot shows without one."""
        assert self._persisted_reports is not None
        for index, report in self._persisted_reports(snap.ens).items():
            pub = snap.member(index)
            if index in snap.reports or pub is None:
                continue
            if report_applies(report, pub.member.ip, pub.addresses):
                snap = self._state.report(snap.ens, index, report) or snap
        return snap

    async def _sync_slices(self, namespace: str, desired: Mapping[str, Any]) -> list[str]:
        try:
            return await self._applier.sync(namespace, desired)
        except Exception:
            self._metrics.apply_errors.inc()
            raise

    def _report_problems(self, key: Key, problems: list[str]) -> None:
        """Log each problem once when it appears, and once when it is gone."""
        now = tuple(problems)
        before = self._last_problems.get(key, ())
        if now == before:
            return
        ident = f"{key[0]}/{key[1]}"
        for problem in now:
            if problem not in before:
                log.warning("%s", problem, extra={"ensemble": ident})
        for problem in before:
            if problem not in now:
                log.info("resolved: %s", problem, extra={"ensemble": ident})
        self._last_problems[key] = now

    def _note_orphans(self, key: Key) -> None:
        """Say once that VMIs name an ensemble whose Service does not exist."""
        vmis = self._vmis.by_index(key)
        if not vmis:
            self._orphans.discard(key)
            return
        if key in self._orphans:
            return
        self._orphans.add(key)
        log.warning(
            "%d VMI(s) are labelled %s=%s in namespace %s, but there is no such ensemble "
            "Service (headless, labelled with its own name); not published",
            len(vmis), ENSEMBLE_LABEL, key[1], key[0], extra={"ensemble": f"{key[0]}/{key[1]}"},
        )

    def _forget(self, key: Key) -> None:
        namespace, name = key
        if self._pairs is not None:
            self._pairs.forget(key)
        self._specs.forget(key)
        self._last_problems.pop(key, None)
        self._metrics.drop_ensemble(namespace, name)
        try:
            ens = EnsembleId(namespace, name)
        except ModelError:
            return
        if self._state.drop(ens):
            log.info("%s/%s: Service gone; ensemble no longer published", namespace, name,
                     extra={"ensemble": f"{namespace}/{name}"})
        self._applier.forget(namespace, [n for (ns, n) in self._slices.all_keys()
                                         if ns == namespace and n.startswith(f"{name}-imex")])

    # -- for tests and diagnostics -------------------------------------------

    def pending(self) -> int:
        return self._queue.pending() + len(self._held)
