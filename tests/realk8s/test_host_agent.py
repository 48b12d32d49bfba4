"""The host agent against the real apiserver, with exactly the base ClusterRole's rights.

One agent process (``imex-host-agent --kubeconfig``, session fixture) watches every
namespace. The tests run in file order and tell one story: publish, follow an IP
change, survive an apiserver crash whose restart answers the agent's resumed watches
with 410, withdraw a memberless ensemble, lose the Service to garbage collection,
and finally compare what the agent did (the apiserver's audit log) with what the
ClusterRole grants.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import dns.rcode
import httpx
import pytest

from host_agent.ensembles.slices import MANAGED_BY
from imex_shared.model import EnsembleId
from tests.realk8s.agentproc import (
    AGENT_USER,
    HostAgentProc,
    agent_grants,
    covers,
    may,
    rights_used,
)
from tests.realk8s.fixtures import contract_slice, ensemble_service, vmi
from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import (
    SERVICES,
    SLICES,
    create_vmi,
    dns_answer,
    set_vmi_ip,
    wait_dns,
)

pytestmark = pytest.mark.realk8s

IPS = {0: "10.20.0.10", 1: "10.20.0.11", 2: "10.20.0.12"}
NODES = {0: "node-a", 1: "node-b", 2: "node-c"}


@pytest.fixture(scope="module")
def rack(control_plane: ControlPlane, host_agent: HostAgentProc) -> Iterator[EnsembleId]:
    """Namespace with ensemble Service ``rack`` (max 4) and three running VMIs."""
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-agent-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    ens = EnsembleId(ns, "rack")
    admin.create(SERVICES.format(ns=ns), ensemble_service(ns, ens.name))
    for i, ip in IPS.items():
        create_vmi(admin, vmi(ns, f"rack-{i}", ens.name, ip=ip, node=NODES[i]))
    try:
        yield ens
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")


def get_slice(admin: Api, ens: EnsembleId) -> dict[str, Any] | None:
    r = admin.request("GET", f"{SLICES.format(ns=ens.namespace)}/{ens.name}-imex")
    return r.json() if r.status_code == 200 else None


def wait_slice_ips(admin: Api, ens: EnsembleId, want: dict[int, str],
                   timeout: float = 30) -> dict[str, Any]:
    got: dict[str, Any] = {}

    def check() -> bool:
        nonlocal got
        got = get_slice(admin, ens) or {}
        eps = {e["hostname"]: e["addresses"][0] for e in got.get("endpoints") or []}
        return eps == {ens.slot(i): ip for i, ip in want.items()}

    wait_until(check, f"slice {ens.name}-imex with {want}", timeout,
               lambda: f"; last: {got.get('endpoints')}")
    return got


def test_agent_publishes_the_contract_slice(control_plane: ControlPlane,
                                            rack: EnsembleId) -> None:
    admin = control_plane.admin
    assert admin is not None
    svc = admin.get(f"{SERVICES.format(ns=rack.namespace)}/{rack.name}")
    got = wait_slice_ips(admin, rack, IPS)

    members = [{"index": i, "ip": ip, "vmi": f"rack-{i}", "node": NODES[i], "ready": True}
               for i, ip in IPS.items()]
    want = contract_slice(rack, svc["metadata"]["uid"], members)
    assert got["metadata"]["labels"] == {
        "kubernetes.io/service-name": rack.name,
        "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
    }
    owner = got["metadata"]["ownerReferences"]
    assert [(o["kind"], o["name"], o["uid"]) for o in owner] == [
        ("Service", rack.name, svc["metadata"]["uid"])]
    assert got["addressType"] == "IPv4"
    assert got["ports"] == want["ports"]

    def endpoint(e: dict[str, Any]) -> tuple[Any, ...]:
        ref = e["targetRef"]
        return (e["hostname"], e["addresses"], e["conditions"].get("ready"),
                e.get("nodeName"), ref["kind"], ref["name"], ref.get("namespace"))

    assert sorted(map(endpoint, got["endpoints"])) == sorted(map(endpoint, want["endpoints"]))


def test_coredns_answers_what_the_agent_published(control_plane: ControlPlane,
                                                  rack: EnsembleId) -> None:
    port = control_plane.dns_port
    for i, ip in IPS.items():
        wait_dns(port, rack.slot_fqdn(i) + ".", "A", {ip})
    wait_dns(port, rack.srv_name() + ".", "SRV",
             {f"0 33 50000 {rack.slot_fqdn(i)}." for i in IPS})
    assert dns_answer(port, rack.slot_fqdn(3) + ".", "A")[0] == dns.rcode.NXDOMAIN


def test_registry_agrees_with_the_slice(host_agent: HostAgentProc, rack: EnsembleId) -> None:
    url = f"{host_agent.registry}/v1/ensembles/{rack.namespace}/{rack.name}"
    body = httpx.get(url, timeout=5).json()
    assert body["domain_id"] == rack.domain_id
    assert {m["index"]: m["ip"] for m in body["members"]} == IPS
    assert {m["slot"] for m in body["members"]} == {rack.slot(i) for i in IPS}


def test_ip_change_reaches_slice_and_dns(control_plane: ControlPlane,
                                         rack: EnsembleId) -> None:
    admin = control_plane.admin
    assert admin is not None
    set_vmi_ip(admin, rack.namespace, "rack-1", "10.20.0.111")
    IPS[1] = "10.20.0.111"
    wait_slice_ips(admin, rack, IPS)
    wait_dns(control_plane.dns_port, rack.slot_fqdn(1) + ".", "A", {"10.20.0.111"})


def test_agent_relists_after_410_and_keeps_members_meanwhile(
        control_plane: ControlPlane, host_agent: HostAgentProc, rack: EnsembleId) -> None:
    admin = control_plane.admin
    assert admin is not None
    gone_before = host_agent.metric("imex_host_agent_watch_restarts_total",
                                    kind="vmi", reason="gone")
    lists_before = host_agent.metric("imex_host_agent_lists_total",
                                     kind="vmi")
    forbidden_before = host_agent.metric("imex_host_agent_watch_restarts_total",
                                         kind="vmi", reason="forbidden")
    # Writes the agent does not watch move etcd's revision past the agent's last
    # resourceVersion; compaction removes that history; a crash (SIGKILL: no final
    # bookmark) and restart leaves a watch cache that starts after it.
    churn = f"rk8s-churn-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": churn}})
    for i in range(5):
        admin.create(f"/api/v1/namespaces/{churn}/configmaps",
                     {"apiVersion": "v1", "kind": "ConfigMap",
                      "metadata": {"name": f"c{i}"}, "data": {"i": str(i)}})
    control_plane.compact_etcd()
    control_plane.restart_apiserver(kill=True)

    # Nothing was withdrawn while the API was away.
    assert get_slice(admin, rack) is not None
    wait_slice_ips(admin, rack, IPS, timeout=1)

    set_vmi_ip(admin, rack.namespace, "rack-2", "10.20.0.122")
    IPS[2] = "10.20.0.122"
    wait_slice_ips(admin, rack, IPS, timeout=90)
    wait_dns(control_plane.dns_port, rack.slot_fqdn(2) + ".", "A", {"10.20.0.122"}, timeout=60)
    gone_after = host_agent.metric("imex_host_agent_watch_restarts_total",
                                   kind="vmi", reason="gone")
    lists_after = host_agent.metric("imex_host_agent_lists_total",
                                    kind="vmi")
    assert gone_after > gone_before, host_agent.proc.tail(60)
    assert lists_after > lists_before
    # The restarted apiserver refuses watches with 403 until its RBAC informers sync:
    # that is retried, never taken for a Role without watch (a 30 s list-only mode).
    assert host_agent.metric("imex_host_agent_watch_restarts_total",
                             kind="vmi", reason="forbidden") == forbidden_before
    admin.delete(f"/api/v1/namespaces/{churn}")


def test_agent_deletes_the_slice_of_a_memberless_ensemble(control_plane: ControlPlane,
                                                          rack: EnsembleId) -> None:
    admin = control_plane.admin
    assert admin is not None
    ns = rack.namespace
    lone = EnsembleId(ns, "lone")
    admin.create(SERVICES.format(ns=ns), ensemble_service(ns, lone.name))
    create_vmi(admin, vmi(ns, "lone-0", lone.name, ip="10.21.0.1"))
    wait_slice_ips(admin, lone, {0: "10.21.0.1"})
    wait_dns(control_plane.dns_port, lone.slot_fqdn(0) + ".", "A", {"10.21.0.1"})

    assert admin.delete(f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances/"
                        "lone-0").status_code == 200
    wait_until(lambda: get_slice(admin, lone) is None, "agent deletes lone-imex", 30)
    wait_dns(control_plane.dns_port, lone.slot_fqdn(0) + ".", "A", set())


def test_deleting_the_service_takes_slice_and_names_away(
        control_plane: ControlPlane, host_agent: HostAgentProc, rack: EnsembleId) -> None:
    admin = control_plane.admin
    assert admin is not None
    assert admin.delete(
        f"{SERVICES.format(ns=rack.namespace)}/{rack.name}").status_code == 200
    wait_until(lambda: get_slice(admin, rack) is None, "GC of rack-imex", 60)
    # The agent forgets the ensemble and does not recreate the slice for its VMIs.
    url = f"{host_agent.registry}/v1/ensembles/{rack.namespace}/{rack.name}"
    wait_until(lambda: httpx.get(url, timeout=5).status_code == 404,
               "registry drops the ensemble", 30)
    assert get_slice(admin, rack) is None
    wait_dns(control_plane.dns_port, rack.slot_fqdn(0) + ".", "A", set())


#: Grants this module's story (Service-only ensembles, one replica, no
#: authEncryption) never needs, and why; the tests of those features judge them with
#: the same helpers (agentproc.rights_used, agent_grants), and test_crd_api.py checks
#: by SubjectAccessReview that the ClusterRole grants its list and nothing beyond.
NOT_IN_THIS_STORY: dict[tuple[str, str, str, str], str] = {
    **{("", "services", v, ""): "owned Services are ImexEnsembles' (issue 15)"
       for v in ("create", "patch", "delete")},
    **{("imex-ensemble.io", "imexensembles", v, ""): "no ImexEnsemble here (issue 15)"
       for v in ("get", "list", "watch")},
    **{("imex-ensemble.io", "imexensembles/status", v, ""): "no ImexEnsemble here"
       for v in ("patch", "update")},
    ("imex-ensemble.io", "imexensembles/finalizers", "update", ""): "no ImexEnsemble here",
    **{("events.k8s.io", "events", v, ""): "Events are ImexEnsembles' (issue 15)"
       for v in ("create", "patch")},
    **{("coordination.k8s.io", "leases", v, "imex-system"): "leader election is off with "
       "one replica (issue 16)" for v in ("get", "create", "update", "list", "watch")},
    **{("", "secrets", v, "imex-system"): "no authEncryption ensemble here (issue 19)"
       for v in ("get", "create", "update")},
    **{("", "configmaps", v, "imex-system"): "no guest reports in this story (issue 16)"
       for v in ("create", "patch")},
}


def test_agent_used_exactly_the_rights_the_clusterrole_grants(
        control_plane: ControlPlane, host_agent: HostAgentProc,
        request: pytest.FixtureRequest) -> None:
    """Last in the file: by now the agent has listed, watched, applied and deleted.

    What it used comes from the apiserver's audit log (a server-side apply that
    created its object counts as create as well); whether that is allowed, from
    the authorizer itself (a transient 403 while a restarted apiserver's RBAC cache
    fills is real but says nothing about the role, so 403s are not counted here).
    """
    scenario = {name for name in globals() if name.startswith("test_")} - {
        request.node.name}
    selected = {item.name for item in request.session.items
                if item.path == request.node.path}
    if not scenario <= selected:
        pytest.skip("judges what the agent did in this module's other tests; "
                    f"not selected: {sorted(scenario - selected)}")
    admin = control_plane.admin
    assert admin is not None
    # the start-up checks' SelfSubjectAccessReviews: every authenticated user may ask
    # them (the built-in system:basic-user), so no role of ours grants them
    review = ("authorization.k8s.io", "selfsubjectaccessreviews", "create", "")
    used = rights_used(control_plane, AGENT_USER) - {review}
    assert used, "no audit events for the agent"
    missing = sorted(u for u in used if not may(admin, AGENT_USER, *u))
    assert not missing, f"the base roles lack rights the agent used: {missing}"
    granted = agent_grants(control_plane)
    other = sorted(u for u in used if not any(covers(g, u) for g in granted))
    assert not other, f"used, allowed by something else than the base roles: {other}"
    unused = {g for g in granted if not any(covers(g, u) for u in used)} - \
        set(NOT_IN_THIS_STORY)
    assert not unused, (
        f"the base roles grant rights the agent never used in this run: "
        f"{sorted(unused)}; used: {sorted(used)}")
