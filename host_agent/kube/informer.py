"""Informers: a local cache of VMIs, ensemble Services and our EndpointSlices.

One ``Informer`` per (kind, namespace) keeps its part of a shared ``Store``
equal to the API: list, then watch from the list's resourceVersion (with
bookmarks, so a resume rarely needs a relist); every change is handed to
``on_change(old, new)`` (the reconciler's enqueue), in the order the API sent
it.

Failure rules:
- 410 Gone (history compacted): relist at once and hand every object of the
  scope, old and new, to ``on_change``, so everything is reconciled.
- Any other error (connection refused, 500, 429, a dead stream): back off
  with full jitter (tenacity's random exponential wait), then resume the
  watch from the last resourceVersion seen. The cache is left as it was:
  the agent never forgets a member because the API was unreachable. Only a
  successful list replaces the cache.
- Nothing raises out of ``Informer.run`` except cancellation.

What is cached is cache.py's to say (``cache_view``).

All of this runs on the event loop thread; ``on_change`` must not block.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from typing import Protocol

from host_agent.backoff import backoff_delay
from host_agent.kube.cache import Store, cache_view
from host_agent.kube.client import Gone, KubeError
from host_agent.kube.objects import Key, Obj, object_key, resource_version
from host_agent.metrics import HostMetrics
from host_agent.settings import HostSettings

log = logging.getLogger("imex.host.watch")

#: 403s in a row on a resumed watch, and seconds since the first of them, before the
#: informer lists afresh to tell a transient refusal (a kube-apiserver whose RBAC has
#: not synced: about 1.5 s after a restart in realk8s) from a lost verb. Both must be
#: reached: with full-jitter backoff three retries can all land inside that window.
RESUMED_403_LIMIT = 3
RESUMED_403_GRACE_S = 5.0

ChangeHandler = Callable[[Obj | None, Obj | None], None]



class ListWatch(Protocol):
    kind: str
    scope: str

    async def list(self, view: Callable[[Obj], Obj]) -> tuple[list[Obj], str]:
        """Every object reduced by ``view`` (as it arrives), and the list's version."""
        ...

    def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Obj]]: ...


class Informer:
    """Keeps ``store``'s part for ``source`` equal to the API (see module docstring)."""

    def __init__(
        self,
        name: str,
        source: ListWatch,
        store: Store,
        on_change: ChangeHandler,
        metrics: HostMetrics,
        settings: HostSettings,
        namespace: str | None = None,
        *,
        optional: bool = False,
        absent_note: str = "",
    ) -> None:
        self.name = name
        #: A kind the cluster may not serve (the ImexEnsemble CRD is optional): a list
        #: answered 404 (not installed) or 403 (no RBAC for it) counts as an empty,
        #: synced list, and the list is retried every ``settings.optional_kind_retry``.
        self._optional = optional
        self._absent_logged = False
        self._watch_denied_logged = False
        #: what an optional kind's absence costs and what to grant (added to its warning)
        self._absent_note = absent_note
        self._source = source
        self._store = store
        self._on_change = on_change
        self._metrics = metrics
        for reason in ("closed", "gone", "error", "forbidden"):  # series from 0, so that
            metrics.watch_restarts.labels(name, reason)  # increase() sees the first one
        self._settings = settings
        self._namespace = namespace  # None: all namespaces
        self._view = cache_view(getattr(source, "kind", ""))
        self.synced = asyncio.Event()
        self.resource_version: str | None = None

    def _in_scope(self, key: Key) -> bool:
        return self._namespace is None or key[0] == self._namespace

    async def run(self) -> None:
        failures = 0
        rv: str | None = None
        #: 403s in a row on a watch that resumed an earlier stream, and when the first
        #: of them came (see below)
        resumed_forbidden = 0
        forbidden_since = 0.0
        while True:
            #: this attempt's watch starts from a list made just now
            fresh = rv is None
            try:
                if rv is None:
                    rv = await self._relist()
                async for event, obj in self._source.watch(rv):
                    failures = 0
                    resumed_forbidden = 0
                    if self._watch_denied_logged:
                        self._watch_denied_logged = False
                        log.info("%s: watching is permitted now; watching again", self.name)
                    new_rv = resource_version(obj)
                    if new_rv:
                        rv = new_rv
                        self.resource_version = rv
                    self._handle(event, obj)
                self._metrics.watch_restarts.labels(self.name, "closed").inc()
            except Gone as exc:
                failures += 1
                self._metrics.watch_restarts.labels(self.name, "gone").inc()
                log.info("%s: %s; relisting", self.name, exc)
                rv = None
                if failures > 1:  # the fresh list's version was gone too: do not spin
                    await asyncio.sleep(self._delay(failures - 1))
            except KubeError as exc:
                if self._optional and rv is None and exc.status in (403, 404):
                    self._absent(exc)
                    await asyncio.sleep(self._settings.optional_kind_retry)
                    continue
                if exc.status == 403 and rv is not None and fresh:
                    # A list just now was allowed and the watch from it was not: RBAC
                    # grants list but not watch. Keep the listed cache and list again
                    # every optional_kind_retry (each list is applied as a diff), said
                    # once instead of a warning per retry.
                    self._watch_denied(exc)
                    rv = None
                    await asyncio.sleep(self._settings.optional_kind_retry)
                    continue
                if exc.status == 403 and rv is not None:
                    # A resumed watch refused: a kube-apiserver that has just started
                    # answers 403 until its RBAC informers sync, so this is retried with
                    # the usual backoff from the same version. Only if it persists (see
                    # RESUMED_403_*) is the next attempt a fresh list, which tells a real
                    # loss of the watch verb (above) from a transient refusal.
                    now = asyncio.get_running_loop().time()
                    if resumed_forbidden == 0:
                        forbidden_since = now
                    resumed_forbidden += 1
                    if resumed_forbidden >= RESUMED_403_LIMIT and \
                            now - forbidden_since >= RESUMED_403_GRACE_S:
                        resumed_forbidden = 0
                        rv = None
                failures += 1
                delay = self._delay(failures)
                self._metrics.watch_restarts.labels(self.name, "error").inc()
                log.warning(
                    "%s: %s; retrying in %.2f s (resuming from %s)",
                    self.name, exc, delay, rv or "a new list",
                )
                await asyncio.sleep(delay)
            except Exception as exc:  # never let a bug in one event stop the informer
                failures += 1
                delay = self._delay(failures)
                self._metrics.watch_restarts.labels(self.name, "error").inc()
                log.exception("%s: unexpected %r; retrying in %.2f s", self.name, exc, delay)
                await asyncio.sleep(delay)

    async def _relist(self) -> str:
        """List, make the store equal to the list, and return the list's version.

        A method of its own so that the listed objects are referenced from this
        frame only: as a local of ``run`` they stayed alive for as long as the
        watch that followed, so every object the watch replaced was held twice
        (10,000 VMI views, ~13 MB, until the next relist; tests/bench ``host``).
        """
        items, rv = await self._source.list(self._view)
        self._metrics.lists.labels(self.name).inc()
        for old, new in self._store.replace(items, self._in_scope):
            self._on_change(old, new)
        self.resource_version = rv
        if self._absent_logged:
            self._absent_logged = False
            log.info("%s: the kind is served now; watching it", self.name)
        if not self.synced.is_set():
            self._metrics.synced.labels(self.name).set(1)
            log.info("%s listed: %d objects in %s", self.name, len(items), self._source.scope)
        self.synced.set()
        return rv

    def _absent(self, exc: KubeError) -> None:
        """An optional kind is not served: an empty cache, synced (see ``optional``)."""
        for old, new in self._store.replace([], self._in_scope):
            self._on_change(old, new)
        if not self._absent_logged:
            self._absent_logged = True
            why = "not installed" if exc.status == 404 else "not permitted by RBAC"
            log.warning("%s: the kind is %s (%s); carrying on without it%s, checking again "
                        "every %g s", self.name, why, exc,
                        f" ({self._absent_note})" if self._absent_note else "",
                        self._settings.optional_kind_retry)
        if not self.synced.is_set():
            self._metrics.synced.labels(self.name).set(1)
        self.synced.set()

    def _watch_denied(self, exc: KubeError) -> None:
        self._metrics.watch_restarts.labels(self.name, "forbidden").inc()
        if not self._watch_denied_logged:
            self._watch_denied_logged = True
            log.warning("%s: listing is permitted but watching is not (%s); listing again "
                        "every %g s instead%s; grant watch for changes within a second",
                        self.name, exc, self._settings.optional_kind_retry,
                        f" ({self._absent_note})" if self._absent_note else "")

    def _delay(self, failures: int) -> float:
        return backoff_delay(failures, self._settings.backoff_initial, self._settings.backoff_max)

    def _handle(self, event: str, obj: Obj) -> None:
        self._metrics.watch_events.labels(self.name, event).inc()
        if event == "BOOKMARK":
            return
        key = object_key(obj)
        if not self._in_scope(key):
            return
        if event in ("ADDED", "MODIFIED"):
            obj = self._view(obj)
            old = self._store.put(obj)
            self._on_change(old, obj)
        elif event == "DELETED":
            old = self._store.pop(key)
            self._on_change(old if old is not None else obj, None)
        else:
            log.warning("%s: ignoring watch event of type %r", self.name, event)
