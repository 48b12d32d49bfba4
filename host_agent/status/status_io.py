"""Writes each ImexEnsemble's status: the difference only, at most once a second.

What to write is pure (``status.desired_status``); this module decides *when*
and does the write (server-side apply on ``/status`` through the write gate).

Intake, on the event loop thread and never blocking: ``declare`` (after every
reconcile pass: what the pass concluded about the ensemble, or None when it is
not published), ``on_state`` (State calls it after every membership change and
every guest report). Each only *requests* an evaluation of that ensemble.
Service-only ensembles are evaluated the same way, but have no status to write.

Events have this writer as their one source (``events``, events_io.py's
recorder): every declaration and every evaluation is handed over as it happens.

Coalescing, per ensemble: a request is served after ``settle`` seconds (so a
burst arriving together is one evaluation), and never sooner than
``min_interval`` after the last actual write; requests in between join the
one already scheduled. A request that comes within ``min_interval`` of a
write is part of a burst under way, and the burst is served once it has been
quiet for ``quiet`` seconds (but no later than ``max_wait`` after that
write). ``quiet`` is longer than the reports store's batches (0.5 s apart,
persist/reports.py), so a boot storm's answers, which reach this writer in
batches over a little more than a second, count as one burst. So 18 guests
reporting within a second cost at most two writes: the first report's, and
one with everything else when the storm is over (issue 27: with the interval
alone, the last batch came just after the second write about a quarter of the
time, and cost a third). The budget is checked again when a worker takes the
key: a timer set before the last write (the key waited in the queue while that
write went out) puts it back under the budget instead of writing at once. An
evaluation that finds the status already right writes nothing.
While an ensemble is being evaluated, new requests mark it dirty and it is
evaluated again afterwards: one ensemble is never written twice at once (the
work queue's rules, host_agent/workqueue.py).

Level-triggered: an evaluation computes the whole desired status from the
current snapshot and compares it with what the API holds (the CR as the
informer last saw it, or our own last write while the informer has not
caught up). Staleness is the one change time makes: the evaluation asks
``next_change`` when a report will go stale and requests itself for then.

Failures: ``NotLeader`` (another replica writes) and 404 (the CR is gone)
end the evaluation quietly; any other error is logged and the ensemble is
evaluated again after a jittered backoff. Nothing here raises out of
``run`` except cancellation.

Leadership and persistence (issue 16): the gate is checked by the client
immediately before each write, and every write carries the CR's
resourceVersion as it was observed (a deposed leader's late write is refused
with 409). The persisted membership (persist/pair_io.py) is part of the
status: the reconciler hands a new pair over as the snapshot it makes
(``write_pair``) and waits; the write is queued and done by a worker like every
other status write, so it carries the pair with everything else, under the
same budget (it waits for the one-second interval like any write) and never
beside an evaluation of the same ensemble. This writer is the only one of the
ImexEnsemble status. An evaluation whose snapshot is
behind the generation the CR already holds (this replica has not served the
newer pair yet) writes nothing: the pass that observes it comes next.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from host_agent.backoff import backoff_delay
from host_agent.ensembles.cr_spec import Declaration
from host_agent.kube.cache import Store
from host_agent.kube.client import KubeError
from host_agent.kube.leadership import NotLeader
from host_agent.kube.objects import Key, Obj, resource_version
from host_agent.metrics import HostMetrics
from host_agent.state.snapshot import EnsembleSnapshot
from host_agent.state.store import State
from host_agent.status.status import Evaluation, desired_status, next_change, status_in_sync
from host_agent.workqueue import WorkQueue
from imex_shared.model import EnsembleId, ModelError

log = logging.getLogger("imex.host.status")



class StatusClient(Protocol):
    async def apply_status(self, namespace: str, name: str, status: Obj,
                           resource_version: str | None = None) -> Obj:
        """Server-side apply of ``status`` on the CR's /status (``resource_version``: the
        precondition); returns the object."""


@dataclass(frozen=True, slots=True)
class _Written:
    #: resourceVersions the informer may still show that are older than our write: the
    #: one it showed when we first wrote, and those of our writes since
    rvs_before: tuple[str | None, ...]
    status: Obj
    rv_after: str | None


class EventFeed(Protocol):
    """Where the Events start (events_io.py's ``EventRecorder``): this writer is its one
    source, of declarations and of evaluations alike."""

    def declared(self, decl: Declaration, when: float) -> None: ...

    def observe(self, evaluation: Evaluation) -> None: ...

    def forget(self, key: Key) -> None: ...


class StatusWriter:
    def __init__(
        self,
        client: StatusClient,
        crs: Store,
        state: State,
        metrics: HostMetrics,
        *,
        stale_after: float,
        min_interval: float = 1.0,
        settle: float = 0.05,
        quiet: float = 0.6,
        max_wait: float = 2.0,
        workers: int = 2,
        backoff: tuple[float, float] = (0.5, 30.0),
        wall: Callable[[], float] = time.time,
        events: EventFeed | None = None,
    ) -> None:
        self._client = client
        self._crs = crs
        self._state = state
        self._metrics = metrics
        self._stale_after = stale_after
        self._min_interval = min_interval
        self._settle = settle
        self._quiet = quiet
        self._max_wait = max(max_wait, min_interval)
        self._workers = workers
        self._backoff = backoff
        self._wall = wall
        self._events = events
        self._decls: dict[Key, Declaration] = {}
        self._written: dict[Key, _Written] = {}
        #: Service-only ensembles: the last evaluated status (none is written)
        self._shadow: dict[Key, Obj] = {}
        #: Service-only ensembles: what the last evaluation saw (declaration, snapshot,
        #: when time alone would change it); the same again is not evaluated
        self._seen: dict[Key, tuple[Declaration, EnsembleSnapshot, float]] = {}
        self._last_write: dict[Key, float] = {}
        self._failures: dict[Key, int] = {}
        self._queue: WorkQueue[Key] = WorkQueue()
        #: pair writes the reconciler waits for: the snapshot to write, and its waiters
        self._pairs: dict[Key, tuple[EnsembleSnapshot, list[asyncio.Future[Obj]]]] = {}
        self.writes = 0
        self.evaluations = 0
        #: the registry CA's fingerprint while HTTPS is served (status.registryCASHA256)
        self.registry_ca_sha256: Callable[[], str | None] = lambda: None

    # -- intake ----------------------------------------------------------------

    def declare(self, key: Key, decl: Declaration | None) -> None:
        """The reconciler's conclusion about ``key`` (None: no ensemble of that name)."""
        if decl is None:
            if self._decls.pop(key, None) is not None:
                self._written.pop(key, None)
                self._shadow.pop(key, None)
                self._seen.pop(key, None)
                self._last_write.pop(key, None)
                self._failures.pop(key, None)
                self._queue.cancel_timer(key)
            if self._events is not None:
                self._events.forget(key)
            return
        self._decls[key] = decl
        self.request(key)
        if self._events is not None:
            self._events.declared(decl, self._wall())

    def on_state(self, ens: EnsembleId) -> None:
        key = (ens.namespace, ens.name)
        if key in self._decls:
            self.request(key)

    def request(self, key: Key, at: float | None = None) -> None:
        """Evaluate ``key`` soon (or at loop time ``at``), within the write rate limit."""
        loop = asyncio.get_running_loop()
        if at is None and self._queue.is_active(key):
            self._queue.mark_dirty(key)
            return
        now = loop.time()
        last = self._last_write.get(key, float("-inf"))
        earliest = last + self._min_interval
        if at is None and key not in self._pairs and earliest > now + self._settle:
            # a burst under way: served when it has been quiet, within max_wait; this
            # timer replaces any other (a staleness check or a backoff is served with it)
            due = min(max(earliest, now + self._quiet), last + self._max_wait)
            self._queue.cancel_timer(key)
            self._queue.add_at(key, due)
            return
        due = max(now + self._settle if at is None else at, earliest)
        self._queue.add_at(key, due, earliest=True)

    async def write_pair(self, key: Key, snap: EnsembleSnapshot) -> Mapping[str, Any]:
        """Have the status ``snap`` makes (a new persisted pair with everything else)
        written, as soon as the budget allows; returns the status the API then holds.

        The write itself is this writer's, like every status write: it is queued for the
        ensemble (after an evaluation in progress, never beside one) and a worker does
        it. Raises what the write raises (``NotLeader``, ``KubeError``: the reconciler's
        pass fails and is retried), and ``KubeError`` when the CR is not (yet) declared
        here.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[Obj] = loop.create_future()
        waiting = self._pairs.get(key)
        self._pairs[key] = (snap, [*(waiting[1] if waiting else ()), done])
        self.request(key, loop.time())
        return await done

    # -- running ---------------------------------------------------------------

    async def run(self) -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for _ in range(max(1, self._workers)):
                    tg.create_task(self._worker())
        finally:
            self._queue.close()
            for _, waiters in self._pairs.values():
                for done in waiters:
                    done.cancel()

    async def _worker(self) -> None:
        while True:
            key = await self._queue.get()
            if key not in self._pairs and self._too_soon(key):
                # its timer was set before the last write (it waited in the queue while
                # that write went out): the budget holds when a key is served, too
                self._queue.done(key)
                self.request(key)
                continue
            try:
                pair = self._pairs.pop(key, None)
                if pair is not None:
                    await self._write_pair(key, *pair)
                else:
                    await self.sync(key)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                failures = self._failures.get(key, 0) + 1
                self._failures[key] = failures
                delay = backoff_delay(failures, *self._backoff)
                self._metrics.status_writes.labels("error").inc()
                log.warning("status of ImexEnsemble %s/%s: %s; retrying in %.2f s", key[0],
                            key[1], exc, delay, extra={"ensemble": f"{key[0]}/{key[1]}"})
                self._queue.done(key)
                self.request(key, asyncio.get_running_loop().time() + delay)
            else:
                self._failures.pop(key, None)
            finally:
                if self._queue.done(key):
                    self.request(key)

    def _too_soon(self, key: Key) -> bool:
        last = self._last_write.get(key)
        return last is not None and \
            asyncio.get_running_loop().time() < last + self._min_interval - self._settle

    def _observed(self, key: Key, cr: Mapping[str, Any]) -> Mapping[str, Any] | None:
        """The CR's status as the API holds it: the informer's, or our newer write."""
        status = cr.get("status")
        written = self._written.get(key)
        if written is None:
            return status if isinstance(status, Mapping) else None
        rv = resource_version(cr)
        if rv in written.rvs_before:
            return written.status  # the informer has not seen our write yet
        if rv != written.rv_after:
            del self._written[key]  # someone else's write came after ours
        return status if isinstance(status, Mapping) else None

    def _precondition(self, key: Key, cr: Mapping[str, Any]) -> tuple[
            str | None, tuple[str | None, ...]]:
        """(the resourceVersion the API holds as far as we know, the older ones the
        informer may still show)."""
        rv = resource_version(cr)
        written = self._written.get(key)
        if written is not None and rv in written.rvs_before and written.rv_after is not None:
            return written.rv_after, (*written.rvs_before, written.rv_after)
        return rv, (rv,)

    def observed_status(self, key: Key) -> Mapping[str, Any] | None:
        """The CR's status as the API holds it, as far as this replica knows."""
        cr = self._crs.get(*key)
        return self._observed(key, cr) if cr is not None else None

    def is_echo(self, key: Key, cr: Mapping[str, Any] | None) -> bool:
        """``cr`` is our own last status write coming back through the informer."""
        written = self._written.get(key)
        return written is not None and written.rv_after is not None and \
            resource_version(cr) == written.rv_after

    async def _write_pair(self, key: Key, snap: EnsembleSnapshot,
                          waiters: list[asyncio.Future[Obj]]) -> None:
        """A worker's pair write (``write_pair``): the outcome goes to its waiters."""
        try:
            result = await self._pair_status(key, snap)
        except asyncio.CancelledError:
            for done in waiters:
                done.cancel()
            raise
        except Exception as exc:
            for done in waiters:
                if not done.done():
                    done.set_exception(exc)
        else:
            for done in waiters:
                if not done.done():
                    done.set_result(result)

    async def _pair_status(self, key: Key, snap: EnsembleSnapshot) -> Obj:
        decl = self._decls.get(key)
        cr = self._crs.get(*key)
        if decl is None or decl.kind != "ImexEnsemble" or cr is None or \
                (cr.get("metadata") or {}).get("uid") != decl.uid:
            raise KubeError(f"ImexEnsemble {key[0]}/{key[1]} is not declared in this "
                            "replica yet; its membership is written by a later pass")
        desired, observed = self._desired(key, decl, cr, snap)
        # an evaluation like any other: the Events follow what it finds
        self._evaluated(Evaluation(decl, snap, desired, self._wall(), observed))
        if status_in_sync(desired, observed):
            self._metrics.status_writes.labels("unchanged").inc()
            assert observed is not None
            return dict(observed)
        await self._apply(key, cr, desired)
        return desired

    def _evaluated(self, evaluation: Evaluation) -> None:
        self.evaluations += 1
        if self._events is not None:
            self._events.observe(evaluation)

    def _desired(self, key: Key, decl: Declaration, cr: Mapping[str, Any],
                 snap: EnsembleSnapshot | None) -> tuple[Obj, Mapping[str, Any] | None]:
        observed = self._observed(key, cr)
        max_members = (cr.get("spec") or {}).get("maxMembers")
        desired = desired_status(decl, snap, self._wall(), self._stale_after, observed,
                                 max_members if isinstance(max_members, int) else None)
        registry_ca = self.registry_ca_sha256()
        if registry_ca is not None:
            desired["registryCASHA256"] = registry_ca
        return desired, observed

    async def _apply(self, key: Key, cr: Mapping[str, Any], desired: Obj) -> None:
        rv, older = self._precondition(key, cr)
        result = await self._client.apply_status(key[0], key[1], desired, rv)
        self._last_write[key] = asyncio.get_running_loop().time()
        self._written[key] = _Written(older, desired, resource_version(result))
        self.writes += 1
        self._metrics.status_writes.labels("written").inc()

    async def sync(self, key: Key) -> bool:
        """Evaluate one ensemble now; True when it wrote."""
        decl = self._decls.get(key)
        if decl is None:
            return False
        if decl.kind == "Service":
            return self._evaluate_only(key, decl)
        cr = self._crs.get(*key)
        if cr is None:
            return False
        meta = cr.get("metadata") or {}
        if meta.get("uid") != decl.uid:
            return False  # a new CR of that name: its own pass comes first
        snap = None
        if decl.spec is not None:
            try:
                snap = self._state.get(EnsembleId(*key))
            except ModelError:
                snap = None
        now = self._wall()
        desired, observed = self._desired(key, decl, cr, snap)
        self._evaluated(Evaluation(decl, snap, desired, now, observed))
        due = next_change(snap, now, self._stale_after)
        if due is not None:
            loop = asyncio.get_running_loop()
            self.request(key, loop.time() + (due - now) + 0.05)
        if status_in_sync(desired, observed):
            self._metrics.status_writes.labels("unchanged").inc()
            return False
        if _behind(desired, observed):
            self._metrics.status_writes.labels("behind").inc()
            return False
        try:
            await self._apply(key, cr, desired)
        except NotLeader:
            return False
        except KubeError as exc:
            if exc.status == 404:
                return False
            raise
        return True

    def _evaluate_only(self, key: Key, decl: Declaration) -> bool:
        """A Service-only ensemble: the same evaluation, for its Events; no status exists.

        Nothing is evaluated before the ensemble is published (an empty first evaluation
        would make every member of a fleet the agent starts over a "MemberJoined" Event),
        nor when the declaration and the snapshot are what the last evaluation saw and
        time has changed nothing since (``next_change``): a pass that changes nothing,
        the echo of the agent's own writes, costs no evaluation.

        The rate limit applies as if a changed evaluation were a write, so Events of both
        kinds of ensemble come from evaluations at most a second apart.
        """
        try:
            snap = self._state.get(EnsembleId(*key))
        except ModelError:
            return False
        if snap is None:
            return False  # not published yet: its first pass requests the evaluation
        now = self._wall()
        seen = self._seen.get(key)
        if seen is not None and seen[0] == decl and seen[1] == snap and now < seen[2]:
            return False  # what the last evaluation saw: the same facts, the same Events
        previous = self._shadow.get(key)
        desired = desired_status(decl, snap, now, self._stale_after, previous,
                                 events_only=True)
        self._evaluated(Evaluation(decl, snap, desired, now))
        due = next_change(snap, now, self._stale_after)
        self._seen[key] = (decl, snap, float("inf") if due is None else due)
        loop = asyncio.get_running_loop()
        if due is not None:
            self.request(key, loop.time() + (due - now) + 0.05)
        if previous is None or not status_in_sync(desired, previous):
            self._shadow[key] = desired
            self._last_write[key] = loop.time()
        return False

    def pending(self) -> int:
        return self._queue.pending() + len(self._pairs)


def _behind(desired: Mapping[str, Any], observed: Mapping[str, Any] | None) -> bool:
    """The CR holds a newer membership generation than the snapshot this status is of:
    writing it would take the persisted pair backwards."""
    have = (observed or {}).get("membershipGeneration")
    want = desired.get("membershipGeneration")
    return isinstance(have, int) and isinstance(want, int) and want < have
