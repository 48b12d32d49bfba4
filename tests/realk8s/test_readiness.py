"""An agent that cannot work is not ready, against the real kube-apiserver and its RBAC.

The agent runs with the rendered Deployment's own arguments (``--leader-elect``; only
``--listen`` moved to loopback, and an identity of its own so the audit log tells it
apart) and the base manifests' RBAC applied exactly as ``kubectl kustomize`` renders it
(agentproc.apply_base_rbac):

- as the base ServiceAccount: ready; every right its start-up checks ask about is one
  the apiserver allows (its SelfSubjectAccessReviews are in the audit log, and it was
  never refused: no 403);
- as an account bound to the base ClusterRole only (the namespace Roles bound to
  another account): 503 naming the eight rights in imex-system it lacks, until
  RoleBindings give it the base Roles; then ready, without a restart;
- as the cluster admin, outside the cluster, with an ``--agent-namespace`` that does not
  exist: 503 naming it, until it is created.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.realk8s.agentproc import AGENT_SA, AGENT_SA_NAMESPACE, MANIFESTS, apply_base_rbac
from tests.realk8s.harness import ControlPlane, end_processes, free_port, wait_until
from tests.realk8s.podspec import tls_on_loopback

pytestmark = pytest.mark.realk8s

EXE = str(Path(sys.executable).with_name("imex-host-agent"))
RBAC = "/apis/rbac.authorization.k8s.io/v1"


def deployment_args(cp: ControlPlane) -> list[str]:
    objs = [o for o in yaml.safe_load_all(cp.kubectl("kustomize", str(MANIFESTS)).stdout) if o]
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    args = deployment["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-elect" in args
    return tls_on_loopback([a for a in args if not a.startswith("--listen")], free_port())


class Agent:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path,
                 identity: str) -> None:
        self.proc, self.port, self.log, self.identity = proc, port, log, identity

    def readyz(self) -> tuple[int, str]:
        try:
            r = httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=2)
        except httpx.TransportError as exc:
            return 0, str(exc)
        return r.status_code, r.text

    def tail(self) -> str:
        return self.log.read_text()[-3000:]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Any]:
    procs: list[subprocess.Popen[bytes]] = []

    def run(kubeconfig: Path, *args: str) -> Agent:
        identity = f"readiness-{uuid.uuid4().hex[:6]}"
        port = free_port()
        log = tmp_path / f"{identity}.log"
        proc = subprocess.Popen([EXE, "--kubeconfig", str(kubeconfig), *args, "--identity",
                                 identity, "--listen", f"127.0.0.1:{port}"],
                                stdout=log.open("wb"), stderr=subprocess.STDOUT)
        procs.append(proc)
        return Agent(proc, port, log, identity)

    try:
        yield run
    finally:
        end_processes(*procs)


def test_with_the_base_rbac_it_is_ready_and_never_refused(
        control_plane: ControlPlane, start: Any, tmp_path: Path) -> None:
    apply_base_rbac(control_plane)
    token = control_plane.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
    kc = control_plane.write_kubeconfig(tmp_path / "base.kubeconfig", token, AGENT_SA)
    mark = control_plane.audit_mark()
    agent = start(kc, *deployment_args(control_plane))
    wait_until(lambda: agent.readyz()[0] == 200, "ready with the base RBAC", 60, agent.tail)
    assert "start-up checks hold: RBAC allows the 23 rights" in agent.log.read_text()
    user = f"system:serviceaccount:{AGENT_SA_NAMESPACE}:{AGENT_SA}"
    mine = [e for e in control_plane.audit_events(user, mark)
            if agent.identity in e.get("userAgent", "") and e.get("stage") == "ResponseComplete"]
    reviews = [e for e in mine if e["objectRef"]["resource"] == "selfsubjectaccessreviews"]
    assert len(reviews) == 24  # 23 rights and the ImexEnsemble list their need hangs on
    refused = [(e["verb"], e["requestURI"]) for e in mine
               if e.get("responseStatus", {}).get("code") == 403]
    assert refused == []
    dry = [e for e in mine if "dryRun=All" in e["requestURI"]]
    assert [(e["verb"], e["objectRef"]["resource"], e["objectRef"]["namespace"],
             e["responseStatus"]["code"]) for e in dry] == [
        ("create", "configmaps", AGENT_SA_NAMESPACE, 201)]


def test_missing_namespace_roles_are_named_until_bound(
        control_plane: ControlPlane, start: Any, tmp_path: Path) -> None:
    apply_base_rbac(control_plane)
    admin = control_plane.admin
    assert admin is not None
    sa = f"readiness-{uuid.uuid4().hex[:4]}"
    token = control_plane.service_account_token(AGENT_SA_NAMESPACE, sa,
                                                cluster_role="imex-host-agent")
    kc = control_plane.write_kubeconfig(tmp_path / "sa.kubeconfig", token, sa)
    agent = start(kc, *deployment_args(control_plane))
    wait_until(lambda: "RBAC refuses" in agent.readyz()[1], "the missing rights named", 60,
               agent.tail)
    code, text = agent.readyz()
    assert code == 503
    ns = AGENT_SA_NAMESPACE
    assert (f"not ready: RBAC refuses 8 rights the agent needs: create configmaps in "
            f"namespace {ns} (storing guest reports); patch configmaps in namespace {ns} "
            f"(storing guest reports); get secrets in namespace {ns} (the ensemble CAs "
            f"(authEncryption)); create secrets in namespace {ns} (the ensemble CAs "
            f"(authEncryption)); update secrets in namespace {ns} (the ensemble CAs "
            f"(authEncryption)); get leases.coordination.k8s.io in namespace {ns} (leader "
            f"election); create leases.coordination.k8s.io in namespace {ns} (leader "
            f"election); update leases.coordination.k8s.io in namespace {ns} (leader "
            f"election)") in text
    bindings = []
    try:
        for role in ("imex-host-agent-ca", "imex-host-agent-leader-election"):
            name = f"{sa}-{role}"
            bindings.append(name)
            admin.apply(f"{RBAC}/namespaces/{ns}/rolebindings/{name}", {
                "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                "metadata": {"name": name, "namespace": ns},
                "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                            "name": role},
                "subjects": [{"kind": "ServiceAccount", "name": sa, "namespace": ns}]})
        wait_until(lambda: agent.readyz()[0] == 200, "ready once the Roles are bound", 30,
                   agent.tail)
        assert agent.log.read_text().count("not ready: RBAC refuses 8 rights") == 1
    finally:
        for name in bindings:
            admin.delete(f"{RBAC}/namespaces/{ns}/rolebindings/{name}")


def test_a_missing_agent_namespace_is_named_until_created(
        control_plane: ControlPlane, start: Any) -> None:
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-ready-{uuid.uuid4().hex[:6]}"
    agent = start(control_plane.admin_kubeconfig, "--agent-namespace", ns)
    wait_until(lambda: "does not exist" in agent.readyz()[1], "the namespace named", 60,
               agent.tail)
    assert agent.readyz() == (503, (
        f'{{"error":"not ready: namespace {ns} does not exist: the agent keeps its '
        f'guest-report ConfigMaps, its CA Secrets there; create it, or pass '
        f'--agent-namespace (env IMEX_AGENT_NAMESPACE)"}}'))
    try:
        admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                            "metadata": {"name": ns}})
        wait_until(lambda: agent.readyz()[0] == 200, "ready once the namespace exists", 30,
                   agent.tail)
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")
