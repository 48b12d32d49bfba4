"""The API double's store: resourceVersions, watch semantics, history, deletion rules."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.sandbox.kube_api import resources as rt
from tests.sandbox.kube_api.errors import ApiError
from tests.sandbox.kube_api.store import WATCH_ABORT, WATCH_CLOSE, Store, Watcher


def svc(name: str, **labels: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": labels}, "spec": {"clusterIP": "None"}}


def drain(w: Watcher) -> list[tuple[str, str]]:
    out = []
    while not w.queue.empty():
        kind, obj = w.queue.get_nowait()
        out.append((kind, obj.get("metadata", {}).get("name", "")))
    return out


def test_every_write_gets_the_next_global_version() -> None:
    s = Store()
    a = s.create(rt.SERVICE, "default", svc("a"), "t")
    b = s.create(rt.NAMESPACE, None, {"metadata": {"name": "rack1"}}, "t")
    c = s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"labels": {"x": "1"}}}, "t")
    assert [int(o["metadata"]["resourceVersion"]) for o in (a, b, c)] == \
        [s.rv - 2, s.rv - 1, s.rv]
    assert c["metadata"]["generation"] == 1  # metadata-only change: same generation
    d = s.patch(rt.SERVICE, "default", "a", "merge", {"spec": {"sessionAffinity": "ClientIP"}},
                "t")
    assert d["metadata"]["generation"] == 2


def test_noop_writes_keep_the_version_and_emit_nothing() -> None:
    s = Store()
    s.create(rt.SERVICE, "default", svc("a", x="1"), "t")
    w = s.watch(rt.SERVICE, "default", None, None, str(s.rv))
    rv = s.rv
    same = s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"labels": {"x": "1"}}}, "t")
    assert same["metadata"]["resourceVersion"] == str(rv) and s.rv == rv
    cur = s.get(rt.SERVICE, "default", "a")
    s.update(rt.SERVICE, "default", "a", cur, "t")
    assert s.rv == rv and drain(w) == []


def test_watch_translates_selector_moves() -> None:
    s = Store()
    s.create(rt.SERVICE, "default", svc("a", ens="x"), "t")
    w = s.watch(rt.SERVICE, "default", "ens=x", None, str(s.rv))
    s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"labels": {"ens": "y"}}}, "t")
    s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"labels": {"ens": "x"}}}, "t")
    s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"labels": {"z": "1"}}}, "t")
    s.create(rt.SERVICE, "default", svc("other", ens="y"), "t")
    s.delete(rt.SERVICE, "default", "a")
    assert drain(w) == [("DELETED", "a"), ("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]


def test_watch_without_version_lists_first_and_resume_replays_history() -> None:
    s = Store()
    s.create(rt.SERVICE, "default", svc("a"), "t")
    mid = s.rv
    s.create(rt.SERVICE, "default", svc("b"), "t")
    assert drain(s.watch(rt.SERVICE, "default", None, None, None)) == \
        [("ADDED", "a"), ("ADDED", "b")]
    assert drain(s.watch(rt.SERVICE, "default", None, None, "0")) == \
        [("ADDED", "a"), ("ADDED", "b")]
    assert drain(s.watch(rt.SERVICE, "default", None, None, str(mid))) == [("ADDED", "b")]
    assert drain(s.watch(rt.SERVICE, None, None, "metadata.name=a", "1")) == [("ADDED", "a")]


def test_compaction_and_history_limit_give_410() -> None:
    s = Store(history_limit=3)
    s.create(rt.SERVICE, "default", svc("a"), "t")
    old = s.rv
    for i in range(4):
        s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"labels": {"i": str(i)}}}, "t")
    with pytest.raises(ApiError) as err:
        s.watch(rt.SERVICE, "default", None, None, str(old))
    assert err.value.code == 410 and err.value.reason == "Expired"
    assert "too old resource version" in err.value.message
    recent = s.rv - 2
    assert len(drain(s.watch(rt.SERVICE, "default", None, None, str(recent)))) == 2
    s.compact()
    with pytest.raises(ApiError):
        s.watch(rt.SERVICE, "default", None, None, str(recent))
    assert drain(s.watch(rt.SERVICE, "default", None, None, str(s.rv))) == []


async def test_close_watches_sends_close_or_abort() -> None:
    s = Store()
    w1 = s.watch(rt.SERVICE, "default", None, None, None)
    assert s.close_watches() == 1
    assert (await asyncio.wait_for(w1.queue.get(), 1))[0] == WATCH_CLOSE
    w2 = s.watch(rt.SERVICE, "default", None, None, None)
    s.close_watches(abort=True)
    assert (await asyncio.wait_for(w2.queue.get(), 1))[0] == WATCH_ABORT
    assert not s.watchers


def test_finalizers_delay_deletion() -> None:
    s = Store()
    obj = svc("a")
    obj["metadata"]["finalizers"] = ["imex-ensemble.io/x"]
    s.create(rt.SERVICE, "default", obj, "t")
    w = s.watch(rt.SERVICE, "default", None, None, str(s.rv))
    marked = s.delete(rt.SERVICE, "default", "a")
    assert marked["metadata"]["deletionTimestamp"]
    assert s.get(rt.SERVICE, "default", "a")
    s.patch(rt.SERVICE, "default", "a", "merge", {"metadata": {"finalizers": None}}, "t")
    with pytest.raises(ApiError):
        s.get(rt.SERVICE, "default", "a")
    # as upstream: removing the last finalizer is the deletion itself (no MODIFIED first)
    assert drain(w) == [("MODIFIED", "a"), ("DELETED", "a")]


def owned_slice(owner: dict[str, Any], name: str, *more: dict[str, Any]) -> dict[str, Any]:
    refs = [{"apiVersion": "v1", "kind": "Service", "name": o["metadata"]["name"],
             "uid": o["metadata"]["uid"]} for o in (owner, *more)]
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "ownerReferences": refs,
                         "labels": {"kubernetes.io/service-name": owner["metadata"]["name"]}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.1.0.1"]}]}


def names(s: Store, t: rt.ResourceType) -> list[str]:
    return [o["metadata"]["name"] for o in s.list(t, "default")[0]]


def test_garbage_collection_follows_owner_references() -> None:
    s = Store()
    a = s.create(rt.SERVICE, "default", svc("a"), "t")
    b = s.create(rt.SERVICE, "default", svc("b"), "t")
    s.create(rt.ENDPOINTSLICE, "default", owned_slice(a, "a-imex"), "t")
    s.create(rt.ENDPOINTSLICE, "default", owned_slice(a, "a-and-b", b), "t")
    s.create(rt.ENDPOINTSLICE, "default", owned_slice(b, "b-imex"), "t")
    s.delete(rt.SERVICE, "default", "a")
    assert names(s, rt.ENDPOINTSLICE) == ["a-and-b", "b-imex"]  # b still owns a-and-b
    s.delete(rt.SERVICE, "default", "b", propagation="Orphan")
    # b-imex is orphaned; a-and-b keeps only its reference to the gone "a", so it is collected
    assert names(s, rt.ENDPOINTSLICE) == ["b-imex"]
    orphan = s.get(rt.ENDPOINTSLICE, "default", "b-imex")
    assert "ownerReferences" not in orphan["metadata"]


def test_deleting_a_namespace_deletes_its_objects() -> None:
    s = Store()
    s.create(rt.NAMESPACE, None, {"metadata": {"name": "rack1"}}, "t")
    s.create(rt.SERVICE, "rack1", svc("a"), "t")
    w = s.watch(rt.SERVICE, None, None, None, str(s.rv))
    s.delete(rt.NAMESPACE, None, "rack1")
    assert drain(w) == [("DELETED", "a")]
    with pytest.raises(ApiError) as err:
        s.create(rt.SERVICE, "rack1", svc("a"), "t")
    assert err.value.code == 404


def test_service_defaults_and_kept_cluster_ip() -> None:
    s = Store()
    created = s.create(rt.SERVICE, "default", {
        "metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}}, "t")
    ip = created["spec"]["clusterIP"]
    assert ip.startswith("10.96.") and created["spec"]["ports"][0]["protocol"] == "TCP"
    body = {"metadata": {"name": "web"}, "spec": {"ports": [{"port": 80}]}}
    replaced = s.update(rt.SERVICE, "default", "web", body, "t")
    assert replaced["spec"]["clusterIP"] == ip


def test_put_keeps_status_and_rejects_invalid() -> None:
    s = Store()
    vmi = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
           "metadata": {"name": "gb200-0", "namespace": "default"},
           "spec": {"domain": {"devices": {}}}, "status": {"phase": "Running"}}
    assert s.put(vmi)["status"]["phase"] == "Running"
    vmi["status"]["phase"] = "Failed"
    assert s.put(vmi)["status"]["phase"] == "Failed"
    vmi["spec"] = {"domain": 1}
    with pytest.raises(ApiError) as err:
        s.put(vmi)
    assert err.value.code == 422 and err.value.details is not None
    assert err.value.details["causes"][0]["field"] == "spec.domain"


def test_pages_are_a_consistent_snapshot() -> None:
    s = Store()
    for name in "abcde":
        s.create(rt.SERVICE, "default", svc(name, ens="x"), "t")
    first = s.list_page(rt.SERVICE, "default", "ens=x", limit=2)
    assert [o["metadata"]["name"] for o in first.items] == ["a", "b"]
    # the apiserver counts the rest only for a list without selectors (etcd's count)
    assert first.remaining is None and first.continue_token
    assert s.list_page(rt.SERVICE, "default", limit=2).remaining == 3
    # changes after the first page do not leak into the rest of this list
    s.delete(rt.SERVICE, "default", "c")
    s.create(rt.SERVICE, "default", svc("bb", ens="x"), "t")
    s.patch(rt.SERVICE, "default", "d", "merge", {"metadata": {"labels": {"new": "1"}}}, "t")
    rest = s.list_page(rt.SERVICE, "default", "ens=x", limit=10,
                       continue_token=first.continue_token)
    assert [o["metadata"]["name"] for o in rest.items] == ["c", "d", "e"]
    assert "new" not in rest.items[1]["metadata"]["labels"]
    assert rest.resource_version == first.resource_version and rest.continue_token is None
    exact = s.list_page(rt.SERVICE, "default", resource_version=first.resource_version,
                        match="Exact")
    assert [o["metadata"]["name"] for o in exact.items] == ["a", "b", "c", "d", "e"]
    s.compact()
    with pytest.raises(ApiError) as err:
        s.list_page(rt.SERVICE, "default", continue_token=first.continue_token)
    assert err.value.code == 410
    with pytest.raises(ApiError):
        s.list_page(rt.SERVICE, "default", continue_token="garbage!")


def test_objects_written_for_a_gone_owner_are_collected() -> None:
    s = Store()
    a = s.create(rt.SERVICE, "default", svc("a"), "t")
    s.delete(rt.SERVICE, "default", "a")
    w = s.watch(rt.ENDPOINTSLICE, "default", None, None, str(s.rv))
    late = owned_slice(a, "a-imex")  # e.g. an agent applying after the Service went
    s.patch(rt.ENDPOINTSLICE, "default", "a-imex", "apply", late, "agent")
    assert drain(w) == [("ADDED", "a-imex"), ("DELETED", "a-imex")]
    assert names(s, rt.ENDPOINTSLICE) == []
    s.gc_dangling = False
    s.create(rt.ENDPOINTSLICE, "default", late, "t")
    assert names(s, rt.ENDPOINTSLICE) == ["a-imex"]


def test_headless_selectorless_service_defaults_dual_stack_and_delete_field_selectors() -> None:
    s = Store()
    got = s.create(rt.SERVICE, "default", svc("ens"), "t")["spec"]
    assert (got["ipFamilyPolicy"], got["ipFamilies"]) == ("RequireDualStack", ["IPv4", "IPv6"])
    plain = s.create(rt.SERVICE, "default", {"metadata": {"name": "web"},
                                             "spec": {"ports": [{"port": 80}]}}, "t")["spec"]
    assert (plain["ipFamilyPolicy"], plain["ipFamilies"]) == ("SingleStack", ["IPv4"])
    headless = s.list(rt.SERVICE, "default", None, "spec.clusterIP=None,spec.type=ClusterIP")
    assert [o["metadata"]["name"] for o in headless[0]] == ["ens"]


def test_a_page_that_ends_at_the_last_match_has_no_continue() -> None:
    """The page is cut where the matches end, not where the kind's keys end: a rest
    that holds no match is not a rest (etcd reads past it and finds nothing more)."""
    s = Store()
    for name, ens in (("a", "x"), ("b", "x"), ("c", "y"), ("d", "y")):
        s.create(rt.SERVICE, "default", svc(name, ens=ens), "t")
    page = s.list_page(rt.SERVICE, "default", "ens=x", limit=2)
    assert [o["metadata"]["name"] for o in page.items] == ["a", "b"]
    assert page.continue_token is None and page.remaining is None
    first = s.list_page(rt.SERVICE, "default", "ens=y", limit=1)
    assert [o["metadata"]["name"] for o in first.items] == ["c"] and first.continue_token
    rest = s.list_page(rt.SERVICE, "default", "ens=y", limit=1,
                       continue_token=first.continue_token)
    assert [o["metadata"]["name"] for o in rest.items] == ["d"]
    assert rest.continue_token is None
