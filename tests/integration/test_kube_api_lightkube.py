"""The Kubernetes API double driven by the real lightkube async client over HTTP.

Each test talks to the double exactly as the host agent will: kubeconfig from
a file, typed resources for Service/EndpointSlice, generic resources for
KubeVirt kinds.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from lightkube import ApiError, AsyncClient
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Namespace, Service
from lightkube.resources.discovery_v1 import EndpointSlice
from lightkube.types import PatchType

from tests.sandbox.kube_api.fixtures import (  # noqa: F401
    KubeApiHandle,
    kube_api_fixture,
    lightkube_client_fixture,
)

VMI = create_namespaced_resource(
    "kubevirt.io", "v1", "VirtualMachineInstance", "virtualmachineinstances")

pytestmark = pytest.mark.timeout(30)

# A label value may not contain "/": DESIGN.md's "imex-ensemble.io/host-agent" is refused by a
# real apiserver (and by the double, see test_kube_api_validation.py); this form is valid.
MANAGED_BY = "host-agent.imex-ensemble.io"


# Typed classes are named explicitly: lightkube's codecs.from_dict looks the
# class up in a process-wide registry, where the host agent (imported by other
# tests in the same run) files a generic EndpointSlice and the sandbox a
# generic Service.
def service(name: str, ns: str = "default", **labels: str) -> Any:
    return Service.from_dict({
        "apiVersion": "v1", "kind": "Service",
        "metadata": {"name": name, "namespace": ns,
                     "labels": {"imex-ensemble.io/ensemble": name, **labels}},
        "spec": {"clusterIP": "None", "ports": [{"name": "imex", "port": 50000}]},
    })


def vmi(name: str, ns: str = "default", **labels: str) -> Any:
    return VMI.from_dict({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "1Gi"}}}},
    })


def slice_for(svc: Any, *endpoints: dict[str, Any], name: str | None = None) -> Any:
    return EndpointSlice.from_dict({
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{svc.metadata.name}-imex", "namespace": svc.metadata.namespace,
            "labels": {"kubernetes.io/service-name": svc.metadata.name,
                       "endpointslice.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service",
                                 "name": svc.metadata.name, "uid": svc.metadata.uid}],
        },
        "addressType": "IPv4",
        "endpoints": list(endpoints),
        "ports": [{"name": "imex", "port": 50000, "protocol": "TCP"}],
    })


async def next_events(stream: AsyncIterator[tuple[str, Any]], n: int,
                      timeout: float = 10.0) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    async with asyncio.timeout(timeout):
        while len(out) < n:
            out.append(await anext(stream))
    return out


async def test_create_get_list_with_selectors(client: AsyncClient) -> None:
    await client.create(service("ens-a", tier="x"))
    await client.create(service("ens-b", tier="y"))
    await client.create(service("other"))
    got = await client.get(Service, "ens-a", namespace="default")
    assert got.metadata.labels["tier"] == "x"
    assert got.metadata.uid and int(got.metadata.resourceVersion) > 0

    async def names(**kw: Any) -> list[str]:
        return sorted([s.metadata.name async for s in client.list(Service, **kw)])

    assert await names(namespace="default", labels={"tier": "x"}) == ["ens-a"]
    assert await names(namespace="default", labels={"tier": ("x", "y")}) == ["ens-a", "ens-b"]
    from lightkube import operators as op
    assert await names(namespace="default", labels={"tier": op.not_in(["x"])}) == \
        ["ens-b", "other"]
    assert await names(namespace="default", labels={"tier": op.exists()}) == ["ens-a", "ens-b"]
    assert await names(namespace="default", labels={"tier": op.not_exists()}) == ["other"]
    assert await names(namespace="*", fields={"metadata.name": "ens-b"}) == ["ens-b"]
    assert await names(namespace="*", fields={"metadata.namespace": "kube-system"}) == []
    with pytest.raises(ApiError) as err:
        await client.create(service("ens-a"))
    assert err.value.status.code == 409 and err.value.status.reason == "AlreadyExists"
    with pytest.raises(ApiError) as err:
        await client.get(Service, "nope", namespace="default")
    assert err.value.status.code == 404


async def test_resource_version_is_global_and_monotonic(client: AsyncClient) -> None:
    a = await client.create(service("ens-a"))
    b = await client.create(vmi("gb200-0"))
    c = await client.create(service("ens-b"))
    rvs = [int(x.metadata.resourceVersion) for x in (a, b, c)]
    assert rvs == sorted(rvs) and len(set(rvs)) == 3
    listed = client.list(Service, namespace="default")
    _ = [s async for s in listed]
    assert int(listed.resourceVersion) >= rvs[-1]


async def test_watch_from_list_version_sees_changes_in_order(client: AsyncClient) -> None:
    await client.create(service("ens"))
    listed = client.list(VMI, namespace="default")
    assert [v async for v in listed] == []
    stream = aiter(client.watch(VMI, namespace="default",
                                labels={"imex-ensemble.io/ensemble": "ens"},
                                resource_version=listed.resourceVersion))
    await client.create(vmi("gb200-0", **{"imex-ensemble.io/ensemble": "ens"}))
    await client.create(vmi("unrelated"))
    await client.patch(VMI.Status, "gb200-0", {"status": {"phase": "Running"}},
                       namespace="default", patch_type=PatchType.MERGE)
    await client.delete(VMI, "gb200-0", namespace="default")
    events = await next_events(stream, 3)
    assert [(t, o.metadata.name) for t, o in events] == \
        [("ADDED", "gb200-0"), ("MODIFIED", "gb200-0"), ("DELETED", "gb200-0")]
    assert events[1][1]["status"]["phase"] == "Running"


async def test_status_subresource_splits_spec_and_status(client: AsyncClient) -> None:
    created = await client.create(vmi("gb200-0"))
    assert created.get("status") is None  # create drops status, as for any status subresource
    st = await client.patch(VMI.Status, "gb200-0",
                            {"status": {"phase": "Running", "interfaces": [
                                {"name": "default", "ipAddress": "10.244.0.5"}]}},
                            namespace="default", patch_type=PatchType.MERGE)
    assert st["status"]["interfaces"][0]["ipAddress"] == "10.244.0.5"
    # a main-resource patch cannot touch status
    main = await client.patch(VMI, "gb200-0", {"status": {"phase": "Failed"},
                                               "metadata": {"labels": {"a": "b"}}},
                              namespace="default", patch_type=PatchType.MERGE)
    assert main["status"]["phase"] == "Running"
    assert main.metadata.labels == {"a": "b"}


async def test_apply_is_idempotent_and_owned(kube_api: KubeApiHandle,
                                             client: AsyncClient) -> None:
    svc = await client.create(service("ens"))
    es = slice_for(svc, {"addresses": ["10.244.0.5"], "hostname": "imex-0a1b2c3d-0",
                         "conditions": {"ready": True}})
    first = await client.apply(es, field_manager="imex-host-agent")
    kube_api.reset_counters()
    second = await client.apply(es, field_manager="imex-host-agent")
    assert second.metadata.resourceVersion == first.metadata.resourceVersion
    assert kube_api.changes == {}  # no stored change, hence no watch event
    assert kube_api.writes("endpointslices", "apply") == 1  # but the request was counted
    managers = {m.manager: m for m in second.metadata.managedFields}
    assert managers["imex-host-agent"].operation == "Apply"
    assert "f:endpoints" in managers["imex-host-agent"].fieldsV1
    # another manager changing an owned field conflicts unless forced
    other = slice_for(svc, {"addresses": ["10.244.0.9"], "hostname": "imex-0a1b2c3d-0"})
    with pytest.raises(ApiError) as err:
        await client.apply(other, field_manager="someone-else")
    assert err.value.status.code == 409
    assert ".endpoints" in err.value.status.message
    forced = await client.apply(other, field_manager="someone-else", force=True)
    assert forced.endpoints[0].addresses == ["10.244.0.9"]


async def test_apply_drops_fields_the_manager_stops_applying(client: AsyncClient) -> None:
    svc = await client.create(service("ens"))
    es = slice_for(svc, {"addresses": ["10.244.0.5"], "hostname": "imex-0a1b2c3d-0"})
    es.metadata.annotations = {"imex-ensemble.io/generation": "1"}
    await client.apply(es, field_manager="imex-host-agent")
    es.metadata.annotations = None
    got = await client.apply(es, field_manager="imex-host-agent")
    assert not got.metadata.annotations


async def test_update_conflict_on_stale_resource_version(client: AsyncClient) -> None:
    created = await client.create(service("ens"))
    fresh = await client.patch(Service, "ens", {"metadata": {"labels": {"x": "1"}}},
                               namespace="default", patch_type=PatchType.MERGE)
    assert fresh.metadata.resourceVersion != created.metadata.resourceVersion
    created.metadata.labels = {"y": "2"}
    with pytest.raises(ApiError) as err:
        await client.replace(created)
    assert err.value.status.code == 409 and err.value.status.reason == "Conflict"
    fresh.metadata.labels["y"] = "2"
    replaced = await client.replace(fresh)
    assert replaced.metadata.labels == {"imex-ensemble.io/ensemble": "ens", "x": "1", "y": "2"}


async def test_json_and_strategic_patch(client: AsyncClient) -> None:
    await client.create(service("ens"))
    got = await client.patch(Service, "ens", [
        {"op": "add", "path": "/metadata/annotations", "value": {"a": "1"}},
        {"op": "test", "path": "/spec/clusterIP", "value": "None"},
    ], namespace="default", patch_type=PatchType.JSON)
    assert got.metadata.annotations == {"a": "1"}
    with pytest.raises(ApiError) as err:
        await client.patch(Service, "ens", [{"op": "test", "path": "/spec/clusterIP",
                                             "value": "10.0.0.1"}],
                           namespace="default", patch_type=PatchType.JSON)
    assert err.value.status.code == 422
    got = await client.patch(Service, "ens", {"spec": {"ports": [
        {"name": "extra", "port": 50001}]}}, namespace="default", patch_type=PatchType.STRATEGIC)
    assert sorted(p.port for p in got.spec.ports) == [50000, 50001]  # merged by port
    await client.create(vmi("gb200-0"))
    with pytest.raises(ApiError) as err:  # CRDs refuse strategic merge, as upstream
        await client.patch(VMI, "gb200-0", {"metadata": {"labels": {"a": "b"}}},
                           namespace="default", patch_type=PatchType.STRATEGIC)
    assert err.value.status.code == 415


async def test_delete_service_collects_owned_slices(client: AsyncClient) -> None:
    svc = await client.create(service("ens"))
    keep = await client.create(service("keep"))
    await client.apply(slice_for(svc, {"addresses": ["10.244.0.5"], "hostname": "imex-x-0"}),
                       field_manager="imex-host-agent")
    await client.apply(slice_for(keep, {"addresses": ["10.244.0.6"], "hostname": "imex-y-0"}),
                       field_manager="imex-host-agent")
    stream = aiter(client.watch(EndpointSlice, namespace="default"))
    assert len(await next_events(stream, 2)) == 2  # the synthetic ADDED of both
    await client.delete(Service, "ens", namespace="default")
    (kind, obj), = await next_events(stream, 1)
    assert (kind, obj.metadata.name) == ("DELETED", "ens-imex")
    left = [s.metadata.name async for s in client.list(EndpointSlice, namespace="default")]
    assert left == ["keep-imex"]


async def test_namespaces_and_missing_namespace(client: AsyncClient) -> None:
    with pytest.raises(ApiError) as err:
        await client.create(service("ens", ns="team-a"))
    assert err.value.status.code == 404
    await client.create(Namespace.from_dict({"metadata": {"name": "team-a"}}))
    await client.create(service("ens", ns="team-a"))
    await client.delete(Namespace, "team-a")
    assert [s async for s in client.list(Service, namespace="team-a")] == []


async def test_dry_run_validates_but_stores_nothing(kube_api: KubeApiHandle,
                                                    client: AsyncClient) -> None:
    rv = kube_api.resource_version
    answered = await client.create(service("ens"), dry_run=True)
    assert answered.metadata.name == "ens" and answered.spec.clusterIP == "None"
    assert kube_api.resource_version == rv
    with pytest.raises(ApiError) as err:
        await client.get(Service, "ens", namespace="default")
    assert err.value.status.code == 404
    with pytest.raises(ApiError) as err:
        await client.create(service("Not-A-Label"), dry_run=True)
    assert err.value.status.code == 422


async def test_deletecollection_and_orphaning(client: AsyncClient) -> None:
    from lightkube.types import CascadeType

    svc = await client.create(service("ens"))
    await client.apply(slice_for(svc, {"addresses": ["10.244.0.5"], "hostname": "imex-x-0"}),
                       field_manager="imex-host-agent")
    await client.create(service("other"))
    await client.deletecollection(Service, namespace="default", cascade=CascadeType.ORPHAN)
    assert [s async for s in client.list(Service, namespace="default")] == []
    (left,) = [s async for s in client.list(EndpointSlice, namespace="default")]
    assert left.metadata.name == "ens-imex" and not left.metadata.ownerReferences


VM = create_namespaced_resource("kubevirt.io", "v1", "VirtualMachine", "virtualmachines")
POOL = create_namespaced_resource("pool.kubevirt.io", "v1beta1", "VirtualMachinePool",
                                  "virtualmachinepools")


async def test_virtual_machines_and_pools_are_served_and_validated(client: AsyncClient) -> None:
    template = {"metadata": {"labels": {"imex-ensemble.io/ensemble": "gb200"}},
                "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "1Gi"}}}}}
    pool = await client.create(POOL.from_dict({
        "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
        "metadata": {"name": "gb200", "namespace": "default"},
        "spec": {"replicas": 2, "selector": {"matchLabels": {"imex-ensemble.io/ensemble": "gb200"}},
                 "virtualMachineTemplate": {"metadata": template["metadata"],
                                            "spec": {"runStrategy": "Always",
                                                     "template": template}}}}))
    assert pool["spec"]["replicas"] == 2
    vm = await client.create(VM.from_dict({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachine",
        "metadata": {"name": "gb200-0", "namespace": "default"},
        "spec": {"runStrategy": "Always", "template": template}}))
    await client.patch(VM.Status, "gb200-0", {"status": {"printableStatus": "Running"}},
                       namespace="default", patch_type=PatchType.MERGE)
    assert vm.metadata.name == "gb200-0"
    with pytest.raises(ApiError) as err:  # spec.selector is required by KubeVirt's schema
        await client.create(POOL.from_dict({
            "apiVersion": "pool.kubevirt.io/v1beta1", "kind": "VirtualMachinePool",
            "metadata": {"name": "bad", "namespace": "default"},
            "spec": {"virtualMachineTemplate": {"spec": {"template": template}}}}))
    assert err.value.status.code == 422
    assert [c.field for c in err.value.status.details.causes] == ["spec.selector"]


def test_unknown_fields_are_pruned_with_a_warning_or_refused(
        kube_api: KubeApiHandle) -> None:
    import httpx

    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "s"}},
            "addressType": "IPv4",
            "endpoints": [{"addresses": ["10.244.0.5"], "hostName": "imex-x-0"}]}
    url = "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices"
    with httpx.Client(base_url=kube_api.url, timeout=5) as http:
        strict = http.post(url, json=body, params={"fieldValidation": "Strict"})
        assert strict.status_code == 400
        assert 'unknown field "endpoints[0].hostName"' in strict.json()["message"]
        warned = http.post(url, json=body)  # the server default: Warn
        assert warned.status_code == 201
        assert warned.headers["Warning"] == '299 - "unknown field \\"endpoints[0].hostName\\""'
        # pruned; and `conditions` defaulted to {} as upstream always serializes it
        assert warned.json()["endpoints"] == [{"addresses": ["10.244.0.5"], "conditions": {}}]
        vmi_body = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                    "metadata": {"name": "v"}, "spec": {"domain": {"devices": {}},
                                                        "domian": {}}}
        r = http.post("/apis/kubevirt.io/v1/namespaces/default/virtualmachineinstances",
                      json=vmi_body, params={"fieldValidation": "Ignore"})
        assert r.status_code == 201 and "Warning" not in r.headers
        assert "domian" not in r.json()["spec"]


async def test_chunked_list_through_lightkube(client: AsyncClient) -> None:
    for i in range(5):
        await client.create(service(f"ens-{i}"))
    listed = client.list(Service, namespace="default", chunk_size=2)
    names = []
    async for s in listed:
        names.append(s.metadata.name)
        if len(names) == 1:  # a change while the client pages through the list
            await client.create(service("ens-9"))
    assert names == [f"ens-{i}" for i in range(5)]
