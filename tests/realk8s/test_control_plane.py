"""The real control plane behaves as the project assumes, before any agent runs.

Each test states one assumption from DESIGN.md/FACTS.md and checks it against
the real apiserver, controller manager and CoreDNS: the VMI schema, the
status subresource, CoreDNS's per-endpoint names and SRV, garbage collection
of an owned EndpointSlice, and 410 for a watch resumed from compacted history.
"""

from __future__ import annotations

import uuid
from typing import Any

import dns.message
import dns.query
import dns.rcode
import pytest

from imex_shared.model import EnsembleId
from tests.realk8s.fixtures import contract_slice, ensemble_service, vmi
from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import VMIS, dns_answer, wait_dns

pytestmark = pytest.mark.realk8s


# ---- the VMI CRD ------------------------------------------------------------

def test_crd_accepts_valid_vmi_and_keeps_status_behind_subresource(
        admin: Api, namespace: str) -> None:
    body = vmi(namespace, "gpu-0", "ens", ip="10.1.0.5")
    created = admin.create(VMIS.format(ns=namespace), body)
    # Status sent with a create is dropped: KubeVirt's CRD has a status subresource.
    assert "status" not in created or not created["status"].get("interfaces")
    assert created["spec"]["domain"]["devices"]["interfaces"][0]["masquerade"] == {}
    assert created["spec"]["domain"]["resources"]["requests"]["cpu"] == "500m"

    created["status"] = body["status"]
    updated = admin.ok("PUT", f"{VMIS.format(ns=namespace)}/gpu-0/status", created)
    assert updated["status"]["interfaces"][0]["ipAddress"] == "10.1.0.5/24"
    assert updated["status"]["phase"] == "Running"


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda o: o["spec"].pop("domain"), "spec.domain"),
        (lambda o: o["spec"]["domain"]["cpu"].update(cores="four"), "spec.domain.cpu.cores"),
        (lambda o: o["spec"]["domain"]["devices"]["interfaces"][0].pop("name"),
         "spec.domain.devices.interfaces[0].name"),
    ],
    ids=["missing-domain", "cores-not-integer", "interface-without-name"],
)
def test_crd_rejects_invalid_vmi_naming_the_field(
        admin: Api, namespace: str, mutate: Any, field: str) -> None:
    body = vmi(namespace, "bad-0", "ens")
    mutate(body)
    resp = admin.request("POST", VMIS.format(ns=namespace), body)
    assert resp.status_code == 422, resp.text
    assert field in resp.json()["message"]


# ---- CoreDNS on the contract EndpointSlice ---------------------------------

def test_coredns_serves_slot_names_and_srv_from_contract_slice(
        control_plane: ControlPlane, admin: Api, namespace: str) -> None:
    ens = EnsembleId(namespace, "ens")
    svc = admin.create(f"/api/v1/namespaces/{namespace}/services",
                       ensemble_service(namespace, ens.name))
    members = [
        {"index": 0, "ip": "10.1.0.10", "vmi": "ens-0", "node": "n1", "ready": True},
        {"index": 1, "ip": "10.1.0.11", "vmi": "ens-1", "node": "n2", "ready": True},
        {"index": 2, "ip": "10.1.0.12", "vmi": "ens-2", "node": "n3", "ready": False},
    ]
    admin.create(f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices",
                 contract_slice(ens, svc["metadata"]["uid"], members))
    port = control_plane.dns_port

    wait_dns(port, ens.slot_fqdn(0) + ".", "A", {"10.1.0.10"})
    wait_dns(port, ens.slot_fqdn(1) + ".", "A", {"10.1.0.11"})
    # Not ready: CoreDNS publishes no name for it.
    rcode, answer = dns_answer(port, ens.slot_fqdn(2) + ".", "A")
    assert (rcode, answer) == (dns.rcode.NXDOMAIN, [])
    # The headless Service name answers with every ready member.
    wait_dns(port, ens.service_fqdn() + ".", "A", {"10.1.0.10", "10.1.0.11"})
    # SRV for the named port points at the slot names, port 50000, TTL 5 (Corefile).
    srv_name = ens.srv_name() + "."
    wait_dns(port, srv_name, "SRV", {f"0 50 50000 {ens.slot_fqdn(i)}." for i in (0, 1)})
    resp = dns.query.udp(dns.message.make_query(srv_name, "SRV"), "127.0.0.1", port=port,
                         timeout=2)
    assert {rrset.ttl for rrset in resp.answer} == {5}
    assert srv_name == f"_imex._tcp.{ens.name}.{namespace}.svc.cluster.local."


def test_coredns_follows_slice_changes(
        control_plane: ControlPlane, admin: Api, namespace: str) -> None:
    ens = EnsembleId(namespace, "moving")
    svc = admin.create(f"/api/v1/namespaces/{namespace}/services",
                       ensemble_service(namespace, ens.name))
    base = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
    one = [{"index": 0, "ip": "10.2.0.1", "vmi": "moving-0", "node": "n1", "ready": True}]
    admin.create(base, contract_slice(ens, svc["metadata"]["uid"], one))
    wait_dns(control_plane.dns_port, ens.slot_fqdn(0) + ".", "A", {"10.2.0.1"})
    # A migration gives the VM a new IP: the same slot name follows it.
    moved = [{**one[0], "ip": "10.2.0.99"}]
    admin.apply(f"{base}/{ens.name}-imex", contract_slice(ens, svc["metadata"]["uid"], moved))
    wait_dns(control_plane.dns_port, ens.slot_fqdn(0) + ".", "A", {"10.2.0.99"})


# ---- garbage collection -------------------------------------------------------

def test_deleting_service_garbage_collects_owned_slice(admin: Api, namespace: str) -> None:
    ens = EnsembleId(namespace, "gone")
    svc = admin.create(f"/api/v1/namespaces/{namespace}/services",
                       ensemble_service(namespace, ens.name))
    members = [{"index": 0, "ip": "10.3.0.1", "vmi": "gone-0", "node": "n1", "ready": True}]
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/{ens.name}-imex"
    admin.create(path.rsplit("/", 1)[0], contract_slice(ens, svc["metadata"]["uid"], members))
    # A slice owned by another Service (wrong uid) must survive: GC follows uids, not names.
    stray = contract_slice(EnsembleId(namespace, "other"), str(uuid.uuid4()), members)
    stray_path = path.rsplit("/", 1)[0] + "/other-imex"
    admin.create(path.rsplit("/", 1)[0], stray)

    resp = admin.delete(f"/api/v1/namespaces/{namespace}/services/{ens.name}")
    assert resp.status_code == 200, resp.text
    wait_until(lambda: admin.request("GET", path).status_code == 404,
               f"garbage collection of {path}", 60)
    # The stray slice names a nonexistent owner uid: GC deletes it too (its owner is
    # absent). That is the real semantics a host agent must respect: owner uid wrong
    # -> the slice vanishes.
    wait_until(lambda: admin.request("GET", stray_path).status_code == 404,
               "GC of a slice whose owner uid does not exist", 60)


# ---- 410 Gone ------------------------------------------------------------------

def test_watch_from_compacted_resource_version_gets_410(
        control_plane: ControlPlane, admin: Api, namespace: str) -> None:
    services = f"/api/v1/namespaces/{namespace}/services"
    listed = admin.get(services)
    old_rv = listed["metadata"]["resourceVersion"]
    for i in range(3):
        admin.create(services, ensemble_service(namespace, f"churn-{i}"))
    compacted_at = control_plane.compact_etcd()
    assert compacted_at > int(old_rv)
    # A restarted apiserver's watch cache starts at etcd's current revision, and etcd's
    # history below it is compacted away: a watch resumed from before cannot be served.
    control_plane.restart_apiserver(kill=True)  # the same admin client reconnects

    with admin.watch(services, old_rv, timeout=10) as (status, events):
        if status == 410:
            return
        assert status == 200
        first = next(events)
    assert first["type"] == "ERROR", first
    assert first["object"]["code"] == 410, first
    assert first["object"]["reason"] in {"Expired", "Gone"}, first


def test_watch_from_current_resource_version_streams_changes(
        admin: Api, namespace: str) -> None:
    services = f"/api/v1/namespaces/{namespace}/services"
    rv = admin.get(services)["metadata"]["resourceVersion"]
    admin.create(services, ensemble_service(namespace, "fresh"))
    with admin.watch(services, rv, timeout=10) as (status, events):
        assert status == 200
        first = next(events)
    assert first["type"] == "ADDED"
    assert first["object"]["metadata"]["name"] == "fresh"


# ---- RBAC of server-side apply ------------------------------------------------------

def test_server_side_apply_that_creates_needs_the_create_right(
        control_plane: ControlPlane, admin: Api, namespace: str) -> None:
    """The audit log shows such an apply as "patch", yet the authorizer also asks for
    "create": a role with patch alone can update a slice but not make one. (So the
    agent's ClusterRole needs create although no request of it says create.)"""
    token = control_plane.service_account_token(namespace, "patch-only", [
        {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
         "verbs": ["patch"]}])
    patcher = Api(control_plane.server, control_plane.ca, token)
    ens = EnsembleId(namespace, "ssa")
    svc = admin.create(f"/api/v1/namespaces/{namespace}/services",
                       ensemble_service(namespace, ens.name))
    body = contract_slice(ens, svc["metadata"]["uid"], [
        {"index": 0, "ip": "10.4.0.1", "vmi": "ssa-0", "node": "n1", "ready": True}])
    path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices/ssa-imex"
    params = {"fieldManager": "imex-host-agent", "force": "true"}
    try:
        r = patcher.request("PATCH", path, body, content_type="application/apply-patch+yaml",
                            params=params)
        assert r.status_code == 403, r.text
        assert 'cannot create resource "endpointslices"' in r.json()["message"]

        admin.create(path.rsplit("/", 1)[0], body)
        body["endpoints"][0]["addresses"] = ["10.4.0.2"]
        r = patcher.request("PATCH", path, body, content_type="application/apply-patch+yaml",
                            params=params)
        assert r.status_code == 200, r.text
        assert r.json()["endpoints"][0]["addresses"] == ["10.4.0.2"]
    finally:
        patcher.close()
