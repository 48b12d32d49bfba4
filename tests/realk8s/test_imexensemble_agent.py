"""ImexEnsembles and the host agent against the real apiserver, controller manager and kubectl.

The committed CRD and the base RBAC (ClusterRole, admission policy) are installed as
they are; one agent process runs as the base ServiceAccount. The module tells one
story: a CR gets its own Service, slice and status (written through /status by the
agent, shown by the pinned kubectl's printer columns); `kubectl describe` shows the
Events of a crash and a rejoin, a repeat as a series; a hand-made Service is adopted
without a new uid, a rewritten slice or a new generation; deleting the CR lets the real
garbage collector take the Service and the slices; and the rights the agent used for
all of it are allowed by the authorizer and granted by the base ClusterRole.

Guest reports are real PUTs to the agent's registry on loopback, through
``--trusted-proxy 127.0.0.1/32`` with the VMI's address in X-Forwarded-For (the
caller's address must be the member's).
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from imex_shared.model import EnsembleId
from tests.host_support.ensembles import status_vs_registry
from tests.realk8s.agentproc import (
    AGENT_SA,
    AGENT_SA_NAMESPACE,
    AGENT_USER,
    HostAgentProc,
    apply_base_rbac,
    granted_rights,
    may,
    rights_used,
    start_host_agent,
)
from tests.realk8s.fixtures import ensemble_service, vmi
from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import SERVICES, SLICES, VMIS, create_vmi

pytestmark = pytest.mark.realk8s

ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"
TOKEN = "realk8s-guest-token"
TOKEN_SHA = hashlib.sha256(TOKEN.encode()).hexdigest()
IPS = {0: "10.30.0.10", 1: "10.30.0.11", 2: "10.30.0.12"}


@pytest.fixture(scope="module")
def agent(control_plane: ControlPlane, imex_crd: dict[str, Any]) -> Iterator[HostAgentProc]:
    """The agent as the base ServiceAccount, with the CRD installed before it starts."""
    apply_base_rbac(control_plane)
    token = control_plane.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
    kc = control_plane.write_kubeconfig(control_plane.workdir / "crd-agent.kubeconfig",
                                        token, AGENT_SA)
    try:
        yield start_host_agent(control_plane, "crd-host-agent", kc, "--trusted-proxy",
                               "127.0.0.1/32", "--identity", "realk8s-agent-0")
    finally:
        control_plane.stop_process("crd-host-agent")


@pytest.fixture(scope="module")
def ns(control_plane: ControlPlane, agent: HostAgentProc) -> Iterator[str]:
    admin = control_plane.admin
    assert admin is not None
    name = f"rk8s-cr-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:
        yield name
    finally:
        admin.delete(f"/api/v1/namespaces/{name}")


def cr(ns: str, name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"tokenSHA256": TOKEN_SHA, **spec}}


def get(admin: Api, path: str) -> dict[str, Any] | None:
    r = admin.request("GET", path)
    return r.json() if r.status_code == 200 else None


def status(admin: Api, ns: str, name: str) -> dict[str, Any]:
    return (get(admin, f"{ENS.format(ns=ns)}/{name}") or {}).get("status") or {}


def condition(st: dict[str, Any], ctype: str) -> tuple[str, str] | None:
    for c in st.get("conditions") or ():
        if c["type"] == ctype:
            return c["status"], c["reason"]
    return None


def registry(agent: HostAgentProc, ns: str, name: str) -> dict[str, Any]:
    r = httpx.get(f"{agent.registry}/v1/ensembles/{ns}/{name}", timeout=5)
    return r.json() if r.status_code == 200 else {}


def report(agent: HostAgentProc, ns: str, name: str, index: int, ip: str,
           **extra: Any) -> None:
    gen = registry(agent, ns, name)["generation"]
    r = httpx.put(f"{agent.registry}/v1/ensembles/{ns}/{name}/members/{index}/status",
                  headers={"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": ip},
                  json={"imex_state": "READY", "generation_applied": gen, **extra}, timeout=10)
    assert r.status_code == 200, r.text


def report_all(agent: HostAgentProc, ns: str, name: str, ips: dict[int, str]) -> None:
    for i, ip in ips.items():
        report(agent, ns, name, i, ip)


def wait_agreed(admin: Api, agent: HostAgentProc, ns: str, name: str,
                timeout: float = 60,
                until: Callable[[dict[str, Any]], bool] = lambda st: True) -> dict[str, Any]:
    """The CR status equals the registry's JSON (and satisfies ``until``); returns it.

    Agreement alone can be a moment on the way: VMIs created one after another
    are published one pass at a time, and each such state is agreed on in turn.
    """
    diff: list[list[str]] = [[]]
    seen: list[dict[str, Any]] = [{}]

    def check() -> bool:
        seen[0] = status(admin, ns, name)
        diff[0] = status_vs_registry(seen[0], registry(agent, ns, name))
        return not diff[0] and until(seen[0])

    wait_until(check, f"status of {ns}/{name} == registry JSON", timeout,
               lambda: f"; differences {diff[0]}; status {seen[0]}")
    return seen[0]


def wait_ready(admin: Api, ns: str, name: str, want: tuple[str, str],
               timeout: float = 60) -> None:
    wait_until(lambda: condition(status(admin, ns, name), "Ready") == want,
               f"{ns}/{name} Ready {want}", timeout,
               lambda: f"; conditions {status(admin, ns, name).get('conditions')}")


def describe(cp: ControlPlane, ns: str, name: str) -> str:
    return cp.kubectl("describe", "imexensemble", name, "-n", ns).stdout


def test_a_cr_gets_service_slice_and_status(control_plane: ControlPlane,
                                            agent: HostAgentProc, ns: str) -> None:
    admin = control_plane.admin
    assert admin is not None
    created = admin.create(ENS.format(ns=ns), cr(ns, "rack", maxMembers=4))
    for i, ip in IPS.items():
        create_vmi(admin, vmi(ns, f"rack-{i}", "rack", ip=ip, node=f"node-{i}"))
    wait_until(lambda: get(admin, f"{SERVICES.format(ns=ns)}/rack") is not None,
               "the owned Service", 60, lambda: agent.proc.tail(30))
    svc = get(admin, f"{SERVICES.format(ns=ns)}/rack")
    assert svc is not None
    assert svc["metadata"]["ownerReferences"] == [{
        "apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble", "name": "rack",
        "uid": created["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    assert svc["spec"]["clusterIP"] == "None" and "selector" not in svc["spec"]
    wait_until(lambda: get(admin, f"{SLICES.format(ns=ns)}/rack-imex") is not None,
               "the slice", 60)
    # the three VMIs' IPs may reach the agent in three passes: wait for the last one
    st = wait_agreed(admin, agent, ns, "rack",
                     until=lambda st: st.get("publishedSummary") == "3/4")
    assert st["publishedSummary"] == "3/4"
    assert st["observedGeneration"] == created["metadata"]["generation"]
    report_all(agent, ns, "rack", IPS)
    wait_ready(admin, ns, "rack", ("True", "AllMembersReady"))
    st = wait_agreed(admin, agent, ns, "rack")
    assert [m["imexState"] for m in st["members"]] == ["READY"] * 3
    # the status came through the subresource, under the agent's field manager
    managers = {(m["manager"], m.get("subresource")) for m in
                (get(admin, f"{ENS.format(ns=ns)}/rack") or {})["metadata"]["managedFields"]}
    assert ("imex-host-agent", "status") in managers
    # printer columns, through the kubectl built at the apiserver's version
    wide = control_plane.kubectl("get", "imexensembles", "-n", ns, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert header.split() == ["NAME", "MEMBERS", "IMEX-READY", "READY", "DOMAIN", "AGE",
                              "MODE", "DOMAIN-ID"]
    cells = row.split()
    assert cells[:4] == ["rack", "3/4", "3", "True"]
    assert cells[-2:] == ["names", EnsembleId(ns, "rack").domain_id]


def test_guest_checks_condition_metric_and_page(control_plane: ControlPlane,
                                                agent: HostAgentProc, ns: str) -> None:
    """The guests' preflight, as the real apiserver stores the condition (issue 28)."""
    admin = control_plane.admin
    assert admin is not None
    fail = [{"name": "dns", "result": "FAIL", "message": "no answer from 10.96.0.10:53"},
            {"name": "fabric", "result": "PASS", "message": "4 GPU(s)"}]
    ok = [{"name": "dns", "result": "PASS", "message": "ok"},
          {"name": "fabric", "result": "PASS", "message": "4 GPU(s)"}]
    for i, ip in IPS.items():
        report(agent, ns, "rack", i, ip, preflight=fail if i == 1 else ok,
               imex_channels=[0])
    wait_until(lambda: condition(status(admin, ns, "rack"), "GuestChecks")
               == ("False", "DnsFailed"), "GuestChecks False", 60,
               lambda: f"; conditions {status(admin, ns, 'rack').get('conditions')}")
    st = status(admin, ns, "rack")
    [c] = [c for c in st["conditions"] if c["type"] == "GuestChecks"]
    assert c["message"].startswith("dns FAIL on member 1: no answer")
    assert condition(st, "Ready") == ("True", "AllMembersReady")  # checks never gate Ready
    assert condition(st, "CliqueShared") == ("False", "NotShared")
    metrics = httpx.get(f"{agent.registry}/metrics", timeout=10).text
    assert (f'imex_ensemble_guest_checks{{check="dns",ensemble="rack",namespace="{ns}",'
            'result="FAIL"} 1.0') in metrics
    page = httpx.get(f"{agent.registry}/ui/ensembles/{ns}/rack", timeout=10).text
    assert "<th>checks</th>" in page and "FAIL: dns" in page
    for i, ip in IPS.items():
        report(agent, ns, "rack", i, ip, preflight=ok)
    wait_until(lambda: condition(status(admin, ns, "rack"), "GuestChecks")
               == ("True", "AllChecksPass"), "GuestChecks True", 60)


def test_describe_tells_the_crash_and_rejoin(control_plane: ControlPlane,
                                             agent: HostAgentProc, ns: str) -> None:
    admin = control_plane.admin
    assert admin is not None
    wait_ready(admin, ns, "rack", ("True", "AllMembersReady"))
    for _ in range(2):  # the same crash twice: the second Event is a repeat
        failed = vmi(ns, "rack-1", "rack", ip=IPS[1], node="node-1", phase="Failed",
                     ready=False)
        admin.ok("PATCH", f"{VMIS.format(ns=ns)}/rack-1/status",
                 {"status": failed["status"]}, content_type="application/merge-patch+json")
        wait_ready(admin, ns, "rack", ("False", "MemberNotRunning"))
        wait_agreed(admin, agent, ns, "rack")
        running = vmi(ns, "rack-1", "rack", ip=IPS[1], node="node-1")
        admin.ok("PATCH", f"{VMIS.format(ns=ns)}/rack-1/status",
                 {"status": running["status"]}, content_type="application/merge-patch+json")
        wait_until(lambda: len(registry(agent, ns, "rack").get("members", [])) == 3,
                   "rack-1 published again", 30)
        report_all(agent, ns, "rack", IPS)
        wait_ready(admin, ns, "rack", ("True", "AllMembersReady"))
        wait_agreed(admin, agent, ns, "rack")

    def story() -> str:
        return describe(control_plane, ns, "rack")

    wait_until(lambda: all(w in story() for w in ("ReadyLost", "ReadyRegained",
                                                  "MemberLeft", "MemberJoined")),
               "the story in kubectl describe", 60, lambda: f"\n{story()}")
    text = story()
    events = text[text.index("Events:"):]
    assert "imex-ensemble.io/host-agent" in events  # From: the reporting controller
    assert "member 1 (rack-1) left (was at 10.30.0.11; VMI Failed)" in events
    assert "ServiceCreated" in events
    # the second crash is a repeat of the first: one Event, a series of two
    ev = "/apis/events.k8s.io/v1/namespaces/{ns}/events"
    wait_until(lambda: any((e.get("series") or {}).get("count", 0) >= 2
                           for e in (get(admin, ev.format(ns=ns)) or {})["items"]
                           if e["reason"] == "ReadyLost"), "ReadyLost as a series", 60)
    lost = [e for e in (get(admin, ev.format(ns=ns)) or {})["items"]
            if e["reason"] == "ReadyLost" and e["regarding"]["name"] == "rack"]
    assert len(lost) == 1
    assert lost[0]["reportingController"] == "imex-ensemble.io/host-agent"
    assert lost[0]["reportingInstance"] == "realk8s-agent-0"
    assert not lost[0].get("deprecatedCount")


def test_adoption_keeps_uid_slice_and_generation(control_plane: ControlPlane,
                                                 agent: HostAgentProc, ns: str) -> None:
    admin = control_plane.admin
    assert admin is not None
    admin.create(SERVICES.format(ns=ns), ensemble_service(ns, "hand", max_members=4))
    create_vmi(admin, vmi(ns, "hand-0", "hand", ip="10.30.1.10"))
    wait_until(lambda: get(admin, f"{SLICES.format(ns=ns)}/hand-imex") is not None,
               "the Service-only ensemble's slice", 60)
    before_svc = get(admin, f"{SERVICES.format(ns=ns)}/hand")
    before_slice = get(admin, f"{SLICES.format(ns=ns)}/hand-imex")
    before = registry(agent, ns, "hand")
    assert before_svc is not None and before_slice is not None and before
    admin.create(ENS.format(ns=ns), cr(ns, "hand", maxMembers=4))
    wait_until(lambda: (get(admin, f"{SERVICES.format(ns=ns)}/hand") or {})["metadata"]
               .get("ownerReferences"), "adoption", 60, lambda: agent.proc.tail(30))
    after_svc = get(admin, f"{SERVICES.format(ns=ns)}/hand")
    assert after_svc is not None
    assert after_svc["metadata"]["uid"] == before_svc["metadata"]["uid"]
    wait_until(lambda: status(admin, ns, "hand").get("membersPublished") == 1, "status", 60)
    after_slice = get(admin, f"{SLICES.format(ns=ns)}/hand-imex")
    assert after_slice is not None
    assert after_slice["metadata"]["uid"] == before_slice["metadata"]["uid"]
    assert after_slice["metadata"]["resourceVersion"] == \
        before_slice["metadata"]["resourceVersion"]  # not rewritten
    after = registry(agent, ns, "hand")
    assert (after["generation"], after["domain_id"]) == (before["generation"],
                                                         before["domain_id"])
    wait_until(lambda: "ServiceAdopted" in describe(control_plane, ns, "hand"),
               "ServiceAdopted in describe", 60)


def test_deleting_the_cr_garbage_collects_service_and_slices(
        control_plane: ControlPlane, agent: HostAgentProc, ns: str) -> None:
    admin = control_plane.admin
    assert admin is not None
    assert get(admin, f"{SLICES.format(ns=ns)}/rack-imex") is not None
    assert admin.delete(f"{ENS.format(ns=ns)}/rack").status_code == 200
    wait_until(lambda: get(admin, f"{SERVICES.format(ns=ns)}/rack") is None
               and get(admin, f"{SLICES.format(ns=ns)}/rack-imex") is None,
               "the garbage collector takes Service and slices", 90)
    wait_until(lambda: not registry(agent, ns, "rack"), "registry drops the ensemble", 30)
    assert get(admin, f"{SLICES.format(ns=ns)}/rack-imex") is None  # not recreated


#: What an ImexEnsemble's story needs, besides what a Service-only one does.
CR_RIGHTS = {
    ("imex-ensemble.io", "imexensembles", "list"),
    ("imex-ensemble.io", "imexensembles", "watch"),
    ("imex-ensemble.io", "imexensembles/status", "patch"),
    ("", "services", "create"),
    ("", "services", "patch"),
    ("events.k8s.io", "events", "create"),
    ("events.k8s.io", "events", "patch"),
}


def test_the_rights_used_are_granted_and_allowed(control_plane: ControlPlane,
                                                 agent: HostAgentProc,
                                                 request: pytest.FixtureRequest) -> None:
    """Last: by now the agent created, adopted, wrote status and Events, repeated one."""
    scenario = {n for n in globals() if n.startswith("test_")} - {request.node.name}
    selected = {i.name for i in request.session.items if i.path == request.node.path}
    if not scenario <= selected:
        pytest.skip(f"judges this module's story; not selected: {sorted(scenario - selected)}")
    admin = control_plane.admin
    assert admin is not None
    # a watch is audited at ResponseComplete only when it ends: stop the agent first
    control_plane.stop_process("crd-host-agent")
    grants: set[tuple[str, str, str, str]] = set()

    def watched() -> bool:
        grants.clear()
        grants.update(rights_used(control_plane, AGENT_USER, agent.audit_mark))  # its own
        return any(g[:3] == ("imex-ensemble.io", "imexensembles", "watch") for g in grants)

    wait_until(watched, "the agent's ended watches in the audit log", 30)
    used = {g[:3] for g in grants}
    assert used >= CR_RIGHTS, f"the story did not use: {sorted(CR_RIGHTS - used)}"
    missing = sorted(g for g in grants if not may(admin, AGENT_USER, *g))
    assert not missing, f"used but not allowed: {missing}"
    # in the agent's own namespace its Roles grant (reports' ConfigMaps, CA Secrets: an
    # authEncryption Service of an earlier module may still be in its namespace's
    # deletion); all else is the base ClusterRole's, but for the start-up checks'
    # SelfSubjectAccessReviews, which every authenticated user may ask (system:basic-user)
    review = ("authorization.k8s.io", "selfsubjectaccessreviews", "create")
    cluster_role = {g[:3] for g in grants if g[3] != AGENT_SA_NAMESPACE} - {review}
    assert cluster_role <= granted_rights(), sorted(cluster_role - granted_rights())
