"""Fault injection of the API double, seen through lightkube and raw HTTP.

What a client of a failing apiserver meets: 500 storms, 429 with Retry-After,
slow answers, watches ended cleanly or reset, 410 after compaction, refused
or silent connections, a restart that keeps the state.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import httpx2
import pytest
from lightkube import ApiError, AsyncClient, KubeConfig
from lightkube.codecs import from_dict
from lightkube.resources.core_v1 import Service
from lightkube.types import OnErrorAction, OnErrorResult

from tests.sandbox.kube_api.fixtures import (  # noqa: F401
    KubeApiFactory,
    KubeApiHandle,
    kube_api_factory_fixture,
    kube_api_fixture,
)
from tests.timing import measured

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
async def client(kube_api: KubeApiHandle) -> AsyncIterator[AsyncClient]:
    c = AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path), timeout=10.0)
    try:
        yield c
    finally:
        await c.close()


def service(name: str) -> Any:
    return from_dict({"apiVersion": "v1", "kind": "Service",
                      "metadata": {"name": name, "namespace": "default"},
                      "spec": {"clusterIP": "None"}})


async def test_500_storm_for_n_requests(kube_api: KubeApiHandle, client: AsyncClient) -> None:
    kube_api.fail(500, count=3)
    for _ in range(3):
        with pytest.raises(ApiError) as err:
            await client.create(service("ens"))
        assert err.value.status.code == 500 and err.value.status.reason == "InternalError"
    await client.create(service("ens"))
    assert kube_api.writes("services", "create") == 4  # attempts, as the audit log counts
    assert kube_api.writes("services", served_only=True) == 1
    assert kube_api.faulted == {("create", "services"): 3}
    assert kube_api.changes[("services", "ADDED")] == 1


async def test_429_carries_retry_after(kube_api: KubeApiHandle, client: AsyncClient) -> None:
    kube_api.fail(429, count=1, retry_after=2)
    with pytest.raises(ApiError) as err:
        await client.get(Service, "x", namespace="default")
    assert err.value.status.code == 429 and err.value.status.reason == "TooManyRequests"
    assert err.value.response.headers["Retry-After"] == "2"
    assert err.value.status.details.retryAfterSeconds == 2


async def test_faults_narrowed_by_verb_and_duration(kube_api: KubeApiHandle,
                                                    client: AsyncClient) -> None:
    await client.create(service("ens"))
    kube_api.fail(503, duration=0.5, verbs=["apply"], resources=["services"])
    await client.get(Service, "ens", namespace="default")  # not an apply: served
    with pytest.raises(ApiError) as err:
        await client.apply(service("ens"), field_manager="m")
    assert err.value.status.code == 503
    deadline = time.monotonic() + 5
    while True:  # the window closes by itself
        try:
            await client.apply(service("ens"), field_manager="m")
            break
        except ApiError:
            assert time.monotonic() < deadline, "fault window never closed"
            await asyncio.sleep(0.1)


async def test_delay(kube_api: KubeApiHandle, client: AsyncClient) -> None:
    kube_api.delay(0.4, count=1)
    start = time.monotonic()
    [s async for s in client.list(Service, namespace="default")]
    assert time.monotonic() - start >= 0.4
    assert kube_api.call(lambda srv: srv.faults.rules) == []  # spent after one request


async def watch_events(client: AsyncClient, rv: str, out: list[tuple[str, str]],
                       **kw: Any) -> None:
    async for kind, obj in client.watch(Service, namespace="default", resource_version=rv, **kw):
        out.append((kind, obj.metadata.name))


async def wait_for(pred: Any, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_clean_watch_drop_resumes_without_loss(kube_api: KubeApiHandle,
                                                     client: AsyncClient) -> None:
    listed = client.list(Service, namespace="default")
    [s async for s in listed]
    seen: list[tuple[str, str]] = []
    task = asyncio.create_task(watch_events(client, listed.resourceVersion, seen))
    try:
        await client.create(service("a"))
        await wait_for(lambda: len(seen) == 1)
        assert kube_api.drop_watches() == 1
        await client.create(service("b"))
        await wait_for(lambda: len(seen) == 2)
        await wait_for(lambda: kube_api.requests[("watch", "services")] == 2)
        assert seen == [("ADDED", "a"), ("ADDED", "b")]  # lightkube resumed from "a"'s version
    finally:
        task.cancel()


async def test_reset_watch_is_an_error_for_the_client(kube_api: KubeApiHandle,
                                                      client: AsyncClient) -> None:
    seen: list[tuple[str, str]] = []
    task = asyncio.create_task(watch_events(client, str(kube_api.resource_version), seen))
    await wait_for(lambda: kube_api.requests[("watch", "services")] == 1)
    kube_api.drop_watches(abort=True)
    with pytest.raises(httpx2.TransportError):
        await asyncio.wait_for(task, 5)


async def test_compaction_gives_410_on_resume(kube_api: KubeApiHandle,
                                              client: AsyncClient) -> None:
    listed = client.list(Service, namespace="default")
    [s async for s in listed]
    await client.create(service("a"))
    kube_api.compact()
    with pytest.raises(ApiError) as err:
        await watch_events(client, listed.resourceVersion, [])
    assert err.value.status.code == 410 and err.value.status.reason == "Expired"
    # relisting gives a fresh version that can be watched
    fresh = client.list(Service, namespace="default")
    assert [s.metadata.name async for s in fresh] == ["a"]
    seen: list[tuple[str, str]] = []
    task = asyncio.create_task(watch_events(client, fresh.resourceVersion, seen))
    await client.create(service("b"))
    await wait_for(lambda: seen == [("ADDED", "b")])
    task.cancel()


async def test_refused_outage_then_recovery(kube_api: KubeApiHandle,
                                            client: AsyncClient) -> None:
    await client.create(service("a"))
    kube_api.outage("refuse")
    with pytest.raises(httpx2.ConnectError):
        await client.get(Service, "a", namespace="default")
    kube_api.recover()
    got = await client.get(Service, "a", namespace="default")
    assert got.metadata.name == "a"


async def test_held_outage_times_out_then_recovers(kube_api: KubeApiHandle) -> None:
    c = AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path), timeout=0.5)
    try:
        kube_api.outage("hold")
        with pytest.raises(httpx2.TimeoutException):
            await c.get(Service, "a", namespace="default")
        kube_api.recover()
    finally:
        await c.close()
    patient = AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path), timeout=10)
    try:
        with pytest.raises(ApiError) as err:
            await patient.get(Service, "a", namespace="default")
        assert err.value.status.code == 404
    finally:
        await patient.close()


async def test_restart_keeps_state_and_watch_retries_resume(kube_api: KubeApiHandle,
                                                            client: AsyncClient) -> None:
    created = await client.create(service("a"))
    errors: list[str] = []

    def retry(e: Exception, count: int) -> OnErrorResult:
        errors.append(type(e).__name__)
        return OnErrorResult(OnErrorAction.RETRY, sleep=0.1)

    seen: list[tuple[str, str]] = []
    task = asyncio.create_task(
        watch_events(client, created.metadata.resourceVersion, seen, on_error=retry))
    await wait_for(lambda: kube_api.requests[("watch", "services")] == 1)
    # down=0: listening again at once. (lightkube 1.0's watch hands errors of the
    # *reconnect* itself, e.g. ConnectError while the server is down, straight to the
    # caller, whatever on_error says; a client must wrap the watch in its own retry.)
    await asyncio.to_thread(kube_api.restart, 0.0)
    got = await client.get(Service, "a", namespace="default")
    assert got.metadata.uid == created.metadata.uid
    await client.create(service("b"))
    await wait_for(lambda: seen == [("ADDED", "b")])
    assert errors  # the client saw the connection go
    task.cancel()


def test_admin_http_endpoint(kube_api: KubeApiHandle) -> None:
    headers = {"Authorization": f"Bearer {kube_api.token}"}
    with httpx.Client(base_url=kube_api.url, headers=headers, timeout=5) as http:
        r = http.post("/_sandbox/faults", json={"action": "fail", "status": 500, "count": 1})
        assert r.status_code == 200
        assert http.get("/api/v1/namespaces/default/services").status_code == 500
        assert http.get("/api/v1/namespaces/default/services").status_code == 200
        r = http.post("/_sandbox/objects", json={
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": "seeded",
                                                                "namespace": "default"},
            "spec": {"clusterIP": "None"}})
        assert r.json()["metadata"]["name"] == "seeded"
        counters = http.get("/_sandbox/counters").json()
        assert counters["requests"]["services"]["list"] == 2
        assert counters["changes"]["services/ADDED"] == 1
        assert http.post("/_sandbox/objects", json=[]).status_code == 400
        assert http.post("/_sandbox/faults", json={"action": "fail", "status": 404}
                         ).status_code == 400
        bad = http.post("/_sandbox/faults", json={"action": "explode"})
        assert bad.status_code == 400 and "explode" in bad.json()["message"]
        assert http.post("/_sandbox/faults", json={"action": "outage"}).status_code == 400
        wrong = http.get("/api/v1/namespaces", headers={"Authorization": "Bearer nope"})
        assert wrong.status_code == 401 and wrong.json()["reason"] == "Unauthorized"


def test_bookmarks_and_server_timeout(kube_api_factory: KubeApiFactory) -> None:
    api = kube_api_factory(bookmark_interval=0.2, history_limit=10)
    api.put({"apiVersion": "v1", "kind": "Service",
             "metadata": {"name": "a", "namespace": "default"}, "spec": {"clusterIP": "None"}})
    rv = api.resource_version
    events: list[dict[str, Any]] = []
    start = time.monotonic()
    with httpx.Client(base_url=api.url, timeout=5) as http, http.stream(
            "GET", "/api/v1/namespaces/default/services",
            params={"watch": "true", "allowWatchBookmarks": "true",
                    "resourceVersion": str(rv), "timeoutSeconds": "1"}) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            events.append(json.loads(line))
    took = measured("kube_api.watch_timeout_seconds", time.monotonic() - start)
    # ended by timeoutSeconds (1), not by the client; measured max 1.8 s, 1.7 s beside
    # stress-ng (15 runs each, 2026-12-02): bound 10 s
    assert 0.9 < took < 10, took
    kinds = {e["type"] for e in events}
    assert kinds == {"BOOKMARK"}
    assert all(e["object"]["metadata"]["resourceVersion"] == str(rv) for e in events)
    assert events[0]["object"]["kind"] == "Service"


def test_too_old_version_is_one_error_event_on_the_wire(
        kube_api_factory: KubeApiFactory) -> None:
    api = kube_api_factory(history_limit=3)
    first = api.put({"apiVersion": "v1", "kind": "Service",
                     "metadata": {"name": "a", "namespace": "default"},
                     "spec": {"clusterIP": "None"}})
    for i in range(5):  # pushes "a"'s creation out of the kept history
        api.put({"apiVersion": "v1", "kind": "Service",
                 "metadata": {"name": "a", "namespace": "default", "labels": {"i": str(i)}},
                 "spec": {"clusterIP": "None"}})
    with httpx.Client(base_url=api.url, timeout=5) as http:
        r = http.get("/api/v1/namespaces/default/services",
                     params={"watch": "1", "resourceVersion": first["metadata"]["resourceVersion"]})
    assert r.status_code == 200  # as upstream: the failure is inside the stream
    (line,) = r.text.splitlines()
    event = json.loads(line)
    assert event["type"] == "ERROR"
    assert event["object"]["kind"] == "Status" and event["object"]["code"] == 410
    assert event["object"]["reason"] == "Expired"
