"""Informer rules with a scripted list/watch source (no HTTP)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from host_agent.backoff import backoff_delay
from host_agent.kube.cache import Store
from host_agent.kube.client import Gone, KubeError
from host_agent.kube.informer import Informer
from host_agent.metrics import HostMetrics
from host_agent.settings import HostSettings

SETTINGS = HostSettings(backoff_initial=0.001, backoff_max=0.01)


def obj(name: str, rv: str, ns: str = "ns", **extra: Any) -> dict[str, Any]:
    return {"metadata": {"name": name, "namespace": ns, "resourceVersion": rv}, **extra}


class Script:
    """Each list()/watch() call takes the next step: a value, or an exception to raise."""

    kind = "Thing"
    scope = "all namespaces"

    def __init__(self, lists: list[Any], watches: list[Any]) -> None:
        self.lists = lists
        self.watches = watches
        self.watched_from: list[str] = []
        self.done = asyncio.Event()

    async def list(
        self, view: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> tuple[list[dict[str, Any]], str]:
        step = self.lists.pop(0)
        if isinstance(step, BaseException):
            raise step
        items, rv = step
        return [view(o) for o in items], rv

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, dict[str, Any]]]:
        self.watched_from.append(resource_version)
        if not self.watches:
            self.done.set()
            await asyncio.Event().wait()
        step = self.watches.pop(0)
        for item in step:
            if isinstance(item, BaseException):
                raise item
            yield item


async def drive(script: Script, store: Store | None = None, *, name: str = "thing",
                settings: HostSettings = SETTINGS,
                optional: bool = False) -> tuple[Store, list[Any], HostMetrics]:
    store = store or Store("thing")
    seen: list[Any] = []
    metrics = HostMetrics(CollectorRegistry())
    inf = Informer(name, script, store, lambda o, n: seen.append((o, n)), metrics, settings,
                   optional=optional)
    task = asyncio.create_task(inf.run())
    try:
        await asyncio.wait_for(script.done.wait(), 5)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    return store, seen, metrics


def names(store: Store) -> set[str]:
    return {k[1] for k in store.all_keys()}


def restarts(metrics: HostMetrics, reason: str, kind: str = "thing") -> float | None:
    """``imex_host_agent_watch_restarts_total`` for one kind and reason (0 from the
    informer's start for the known reasons; None: an unknown kind or reason)."""
    return metrics.registry.get_sample_value(
        "imex_host_agent_watch_restarts_total", {"kind": kind, "reason": reason})


async def test_list_then_watch_from_the_lists_version_and_resume_after_errors() -> None:
    script = Script(
        lists=[([obj("a", "5")], "10")],
        watches=[
            [("ADDED", obj("b", "11")), ("BOOKMARK", obj("", "15")),
             KubeError("connection reset")],
            [("MODIFIED", obj("a", "16")), ("DELETED", obj("b", "17"))],
        ],
    )
    store, seen, metrics = await drive(script)
    assert script.watched_from == ["10", "15", "17"]
    assert names(store) == {"a"}
    assert [(o is None, n is None) for o, n in seen] == [
        (True, False), (True, False), (False, False), (False, True)]
    assert metrics.registry.get_sample_value(
        "imex_host_agent_watch_restarts_total", {"kind": "thing", "reason": "error"}) == 1


async def test_410_relists_and_reports_every_object() -> None:
    script = Script(
        lists=[([obj("a", "5"), obj("b", "6")], "10"), ([obj("a", "20"), obj("c", "21")], "30")],
        watches=[[Gone("too old", 410)]],
    )
    store, seen, metrics = await drive(script)
    assert names(store) == {"a", "c"}
    assert script.watched_from == ["10", "30"]
    relist = seen[2:]
    assert {(o["metadata"]["name"] if o else None, n["metadata"]["name"] if n else None)
            for o, n in relist} == {("b", None), ("a", "a"), (None, "c")}
    assert metrics.registry.get_sample_value(
        "imex_host_agent_lists_total", {"kind": "thing"}) == 2


async def test_failed_lists_keep_the_cache() -> None:
    store = Store("thing")
    store.put(obj("keep", "1"))
    script = Script(
        lists=[KubeError("500"), KubeError("refused"), ([obj("keep", "1"), obj("new", "2")], "9")],
        watches=[],
    )
    store, _seen, _ = await drive(script, store)
    assert names(store) == {"keep", "new"}


async def test_unexpected_exceptions_do_not_stop_the_informer() -> None:
    script = Script(lists=[([], "1")], watches=[[ValueError("bug")], [("ADDED", obj("x", "2"))]])
    store, _, _ = await drive(script)
    assert names(store) == {"x"}


async def test_namespace_scoped_informer_replaces_only_its_namespace() -> None:
    store = Store("thing")
    store.put(obj("other", "1", ns="b"))
    script = Script(lists=[([obj("mine", "2", ns="a")], "3")], watches=[])
    seen: list[Any] = []
    inf = Informer("thing@a", script, store, lambda o, n: seen.append((o, n)),
                   HostMetrics(CollectorRegistry()), SETTINGS, "a")
    task = asyncio.create_task(inf.run())
    await asyncio.wait_for(script.done.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert set(store.all_keys()) == {("b", "other"), ("a", "mine")}


def test_backoff_is_jittered_and_capped() -> None:
    delays = [backoff_delay(n, 0.5, 4.0) for n in range(1, 12) for _ in range(20)]
    assert all(0 <= d <= 4.0 for d in delays)
    assert len(set(delays)) > 100


def test_store_index() -> None:
    store = Store("vmi", lambda o: ("ns", o["e"]) if "e" in o else None)
    store.put(obj("a", "1", e="x"))
    store.put(obj("b", "1", e="x"))
    store.put(obj("a", "2", e="y"))  # moved to another ensemble
    assert [o["metadata"]["name"] for o in store.by_index(("ns", "x"))] == ["b"]
    assert [o["metadata"]["name"] for o in store.by_index(("ns", "y"))] == ["a"]
    store.pop(("ns", "b"))
    assert store.by_index(("ns", "x")) == []


async def test_an_optional_kind_the_cluster_does_not_serve_is_synced_empty_and_retried(
) -> None:
    """The ImexEnsemble CRD may be absent (or forbidden): Service-only ensembles go on."""
    script = Script(
        lists=[KubeError("list ImexEnsemble: 404: not found", 404),
               KubeError("list ImexEnsemble: 403: forbidden", 403),
               ([obj("a", "5")], "10")],
        watches=[],
    )
    store = Store("thing")
    seen: list[Any] = []
    metrics = HostMetrics(CollectorRegistry())
    settings = HostSettings(backoff_initial=0.001, backoff_max=0.01, optional_kind_retry=0.02)
    inf = Informer("imexensemble", script, store, lambda o, n: seen.append((o, n)), metrics,
                   settings, optional=True)
    task = asyncio.create_task(inf.run())
    try:
        await asyncio.wait_for(inf.synced.wait(), 5)
        assert names(store) == set()  # synced at once, although the list failed
        await asyncio.wait_for(script.done.wait(), 5)  # installed later: listed and watched
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert names(store) == {"a"} and script.watched_from == ["10"]
    assert metrics.registry.get_sample_value(
        "imex_host_agent_watch_restarts_total", {"kind": "imexensemble", "reason": "error"}
    ) == 0


async def test_a_required_kind_answering_404_is_an_error_not_an_empty_list() -> None:
    script = Script(lists=[KubeError("404", 404), ([obj("a", "5")], "10")], watches=[])
    inf_store = Store("thing")
    metrics = HostMetrics(CollectorRegistry())
    inf = Informer("thing", script, inf_store, lambda o, n: None, metrics, SETTINGS)
    task = asyncio.create_task(inf.run())
    try:
        await asyncio.wait_for(script.done.wait(), 5)
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
    assert metrics.registry.get_sample_value(
        "imex_host_agent_watch_restarts_total", {"kind": "thing", "reason": "error"}) == 1


async def test_list_without_watch_rights_lists_again_and_warns_once(caplog: Any) -> None:
    """RBAC with list but no watch (seen on leases): the cache follows each list, one warning."""
    forbidden = KubeError("watch Lease in ns: 403: forbidden", 403)
    script = Script(
        lists=[([obj("a", "5")], "10"), ([obj("a", "6")], "11"), ([obj("b", "7")], "12")],
        watches=[[forbidden], [forbidden], [("ADDED", obj("c", "13"))]],
    )
    settings = HostSettings(backoff_initial=0.001, backoff_max=0.01, optional_kind_retry=0.01)
    caplog.set_level("INFO", logger="imex.host.watch")
    store, seen, metrics = await drive(script, name="lease", settings=settings, optional=True)
    # each denied watch led to a fresh list, applied as a diff; the third watch worked
    assert script.watched_from == ["10", "11", "12", "13"]
    assert names(store) == {"b", "c"}
    assert [(o and o["metadata"]["name"], n and n["metadata"]["name"]) for o, n in seen] == [
        (None, "a"), ("a", "a"), ("a", None), (None, "b"), (None, "c")]
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "watching is not" in warnings[0].getMessage()
    assert any("watching is permitted now" in r.getMessage() for r in caplog.records)
    assert metrics.registry.get_sample_value(
        "imex_host_agent_watch_restarts_total", {"kind": "lease", "reason": "forbidden"}) == 2
    assert metrics.registry.get_sample_value(
        "imex_host_agent_watch_restarts_total", {"kind": "lease", "reason": "error"}) == 0


def resumed_then_refused(after: dict[str, Any]) -> list[Any]:
    """A watch that sees b at "11" and is reset, four resumes refused with 403, then one
    that delivers ``after``: what a kube-apiserver restart looks like to an informer."""
    forbidden = KubeError("watch Thing: 403: forbidden", 403)
    return [[("ADDED", obj("b", "11")), KubeError("connection reset")],
            [forbidden], [forbidden], [forbidden], [forbidden], [("ADDED", after)]]


async def test_a_resumed_watch_refused_403_is_retried_from_its_version(caplog: Any) -> None:
    """A kube-apiserver that has just restarted answers 403 until its RBAC informers sync
    (seen in realk8s): the watch resumes from where it was, with no list-only fallback."""
    script = Script(lists=[([obj("a", "5")], "10")],
                    watches=resumed_then_refused(obj("c", "12")))
    settings = HostSettings(backoff_initial=0.001, backoff_max=0.01, optional_kind_retry=60)
    caplog.set_level("INFO", logger="imex.host.watch")
    store, _seen, metrics = await drive(script, settings=settings)
    # four refusals, more than RESUMED_403_LIMIT, but all inside RESUMED_403_GRACE_S
    assert script.watched_from == ["10", "11", "11", "11", "11", "11", "12"]
    assert names(store) == {"a", "b", "c"}
    assert metrics.registry.get_sample_value(
        "imex_host_agent_lists_total", {"kind": "thing"}) == 1
    assert restarts(metrics, "error") == 5
    assert restarts(metrics, "forbidden") == 0
    assert not any("watching is not" in r.getMessage() for r in caplog.records)


async def test_a_resumed_watch_refused_for_good_lists_afresh_then_lists_without_watching(
        caplog: Any, monkeypatch: Any) -> None:
    """If the 403 persists, a fresh list decides: allowed list + refused watch = list-only."""
    monkeypatch.setattr("host_agent.kube.informer.RESUMED_403_GRACE_S", 0.0)
    script = Script(
        lists=[([obj("a", "5")], "10"), ([obj("a", "5")], "20"), ([obj("d", "25")], "30")],
        watches=resumed_then_refused(obj("c", "31")),
    )
    settings = HostSettings(backoff_initial=0.001, backoff_max=0.01, optional_kind_retry=0.01)
    caplog.set_level("INFO", logger="imex.host.watch")
    store, _seen, metrics = await drive(script, settings=settings)
    assert script.watched_from == ["10", "11", "11", "11", "20", "30", "31"]
    # the cache kept b until the list that no longer had it, and followed each list
    assert names(store) == {"d", "c"}
    assert restarts(metrics, "forbidden") == 1
    assert restarts(metrics, "error") == 4
    assert sum("watching is not" in r.getMessage() for r in caplog.records) == 1


async def test_listed_objects_are_not_kept_once_the_watch_replaced_them() -> None:
    """The informer keeps no reference of its own to a list's objects: once the watch
    has replaced them they are garbage (they were held for the watch's life, so every
    replaced VMI was held twice; tests/bench ``host``)."""
    import gc
    import weakref

    class Listed(dict[str, Any]):
        """A dict that can be weakly referenced (what a list returned)."""

    listed = [Listed(obj(f"v{i}", str(i))) for i in range(3)]
    refs = [weakref.ref(o) for o in listed]
    script = Script(lists=[(listed, "10")],
                    watches=[[("MODIFIED", obj(f"v{i}", str(20 + i))) for i in range(3)]])
    del listed
    store = Store("thing")
    inf = Informer("thing", script, store, lambda o, n: None,
                   HostMetrics(CollectorRegistry()), SETTINGS)
    task = asyncio.create_task(inf.run())
    try:
        await asyncio.wait_for(script.done.wait(), 5)
        gc.collect()
        # the informer is still running (waiting on its next watch)
        assert not task.done()
        assert [r() is None for r in refs] == [True, True, True]
        assert {o["metadata"]["resourceVersion"] for o in map(store.get, ["ns"] * 3,
                                                               ["v0", "v1", "v2"])
                if o} == {"20", "21", "22"}
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
