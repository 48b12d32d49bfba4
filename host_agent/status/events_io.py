"""Records the Events ``events.decide`` names: new ones created, repeats as a series.

The status writer (status_io.py) is the one source of what this records: it
calls ``declared`` with every reconcile pass's conclusion (a created or adopted
Service), ``forget`` when an ensemble is gone, and ``observe`` with every status
evaluation (at most once a second per ensemble), which is reduced to ``Facts``
and decided against the previous evaluation's. None of them blocks. ``run``
writes, one Event at a time, through the write gate (a follower records nothing;
NotLeader drops the Event quietly).

Repeats (events.k8s.io/v1): an Event with the same regarding object, type,
reason, action and note as one recorded within ``series_window`` is not a
new object; its ``series`` is patched instead (``count``, ``lastObservedTime``;
the deprecated count fields are never used). Patches of one series are
spaced at least ``series_flush`` apart, with the count accumulated in
between and flushed when the spacing allows, so a flapping condition costs
one write per ``series_flush`` however fast it flaps.

Spam bound, two token buckets: each regarding object may have ``burst`` new
Events, one more every ``refill`` seconds (client-go's event spam filter:
25, then one per five minutes), and the whole agent ``global_burst``, then
``global_rate`` a second, so a cluster-wide storm (every VMI of 1,000
ensembles changing its IP) never turns into a flood of API writes. A new
Event over either budget is dropped and counted
(``imex_host_agent_events_total{result="dropped"}``; logged once per object);
a repeat of a recorded one still counts into its series. Failed writes are
logged and counted, not retried: an Event is a record, and the next
transition records itself.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from host_agent.ensembles.cr_spec import Declaration
from host_agent.kube.client import KubeError
from host_agent.kube.leadership import NotLeader
from host_agent.kube.objects import Key, Obj
from host_agent.metrics import HostMetrics
from host_agent.status.events import (
    Facts,
    Intent,
    Regarding,
    cr_regarding,
    decide,
    event_body,
    facts_of,
    first_facts,
    series_patch,
    service_intent,
)
from host_agent.status.status import Evaluation

log = logging.getLogger("imex.host.events")

SeriesKey = tuple[str, str, str, str, str]


class EventClient(Protocol):
    async def create_event(self, body: Obj) -> Obj:
        """POST an events.k8s.io/v1 Event."""

    async def patch_event(self, namespace: str, name: str, patch: Obj) -> Obj:
        """Merge-patch one (its series)."""


@dataclass(frozen=True, slots=True)
class _Record:
    regarding: Regarding
    intent: Intent
    when: float


@dataclass(frozen=True, slots=True)
class _Flush:
    key: SeriesKey


@dataclass
class _Series:
    namespace: str
    name: str
    count: int
    last_observed: float
    written_count: int
    last_write: float  # loop time
    flush_due: bool = False


class EventRecorder:
    def __init__(
        self,
        client: EventClient,
        instance: str,
        metrics: HostMetrics,
        *,
        burst: int = 25,
        refill: float = 300.0,
        global_burst: int = 100,
        global_rate: float = 10.0,
        series_window: float = 1800.0,
        series_flush: float = 10.0,
        loop_time: Callable[[], float] | None = None,
    ) -> None:
        self._client = client
        self._instance = instance
        self._metrics = metrics
        self._burst = burst
        self._refill = refill
        self._global_burst = global_burst
        self._global_rate = global_rate
        self._global: tuple[float, float] | None = None
        self._dropped_logged: set[str] = set()
        self._window = series_window
        self._flush = series_flush
        self._loop_time = loop_time
        self._facts: dict[Key, Facts] = {}
        self._series: dict[SeriesKey, _Series] = {}
        self._buckets: dict[str, tuple[float, float]] = {}
        self._queue: asyncio.Queue[_Record | _Flush] = asyncio.Queue()
        #: the series flushes waiting for their spacing (cancelled when ``run`` ends)
        self._flushes: dict[SeriesKey, asyncio.TimerHandle] = {}
        self._names = itertools.count()
        self.created = 0
        self.patched = 0

    def _now(self) -> float:
        return self._loop_time() if self._loop_time else asyncio.get_running_loop().time()

    # -- intake ----------------------------------------------------------------

    def observe(self, evaluation: Evaluation) -> None:
        key = (evaluation.decl.namespace, evaluation.decl.name)
        before = self._facts.get(key)
        if before is None or before.regarding.uid != evaluation.decl.uid:
            before = first_facts(evaluation)
        after = facts_of(evaluation, before)
        self._facts[key] = after
        for intent in decide(before, after):
            self.record(after.regarding, intent, evaluation.now)

    def record(self, regarding: Regarding, intent: Intent, when: float) -> None:
        """Queue one Event (``when``: the wall time it was observed)."""
        self._queue.put_nowait(_Record(regarding, intent, when))

    def declared(self, decl: Declaration, when: float) -> None:
        """A reconcile pass's conclusion: the Event of a Service it created or adopted."""
        intent = service_intent(decl)
        if intent is not None:
            self.record(cr_regarding(decl), intent, when)

    def forget(self, key: Key) -> None:
        """The ensemble is gone: its next appearance starts a new story."""
        self._facts.pop(key, None)

    # -- writing ---------------------------------------------------------------

    async def run(self) -> None:
        try:
            await self._run()
        finally:
            for handle in self._flushes.values():
                handle.cancel()
            self._flushes.clear()

    async def _run(self) -> None:
        while True:
            item = await self._queue.get()
            try:
                if isinstance(item, _Record):
                    await self._record(item.regarding, item.intent, item.when)
                else:
                    await self._write_series(item.key)
            except asyncio.CancelledError:
                raise
            except NotLeader:
                continue
            except KubeError as exc:
                self._metrics.events.labels("error").inc()
                log.warning("Event not recorded: %s", exc)
            except Exception:  # never let one Event stop the recorder
                self._metrics.events.labels("error").inc()
                log.exception("Event not recorded")

    def _take_token(self, uid: str) -> bool:
        """One token from the object's bucket and one from the agent's, or neither."""
        now = self._now()
        tokens, since = self._buckets.get(uid, (float(self._burst), now))
        tokens = min(float(self._burst), tokens + (now - since) / self._refill)
        g_tokens, g_since = self._global or (float(self._global_burst), now)
        g_tokens = min(float(self._global_burst), g_tokens + (now - g_since) * self._global_rate)
        if tokens < 1.0 or g_tokens < 1.0:
            self._buckets[uid] = (tokens, now)
            self._global = (g_tokens, now)
            return False
        self._buckets[uid] = (tokens - 1.0, now)
        self._global = (g_tokens - 1.0, now)
        return True

    async def _record(self, regarding: Regarding, intent: Intent, when: float) -> None:
        skey: SeriesKey = (regarding.uid, intent.type, intent.reason, intent.action,
                           intent.note)
        series = self._series.get(skey)
        if series is not None and when - series.last_observed <= self._window:
            series.count += 1
            series.last_observed = when
            self._metrics.events.labels("repeat").inc()
            wait = series.last_write + self._flush - self._now()
            if wait <= 0:
                await self._write_series(skey)
            elif not series.flush_due:
                series.flush_due = True
                self._flushes[skey] = asyncio.get_running_loop().call_later(
                    wait, self._flush_due, skey)
            return
        if not self._take_token(regarding.uid):
            self._metrics.events.labels("dropped").inc()
            if regarding.uid not in self._dropped_logged:
                self._dropped_logged.add(regarding.uid)
                log.warning("Events about %s %s/%s are over their budget and dropped "
                            "(counted in imex_host_agent_events_total{result=\"dropped\"}); "
                            "first: %s %s", regarding.kind, regarding.namespace,
                            regarding.name, intent.reason, intent.note)
            return
        # client-go names Events <object>.<unix nanoseconds in hex>; a counter keeps two
        # of one nanosecond apart
        name = f"{regarding.name}.{time.time_ns():x}{next(self._names) % 4096:03x}"
        await self._client.create_event(
            event_body(regarding, intent, name, self._instance, when))
        self.created += 1
        self._metrics.events.labels("created").inc()
        self._series[skey] = _Series(regarding.namespace, name, 1, when, 1, self._now())
        self._prune(when)

    def _flush_due(self, skey: SeriesKey) -> None:
        self._flushes.pop(skey, None)
        self._queue.put_nowait(_Flush(skey))

    async def _write_series(self, skey: SeriesKey) -> None:
        series = self._series.get(skey)
        if series is None:
            return
        series.flush_due = False
        if series.count == series.written_count:
            return
        await self._client.patch_event(series.namespace, series.name,
                                       series_patch(series.count, series.last_observed))
        series.written_count = series.count
        series.last_write = self._now()
        self.patched += 1
        self._metrics.events.labels("series").inc()

    def _prune(self, now: float) -> None:
        if len(self._series) < 4096:
            return
        for key in [k for k, s in self._series.items() if now - s.last_observed > self._window]:
            del self._series[key]

    def pending(self) -> int:
        return self._queue.qsize()
