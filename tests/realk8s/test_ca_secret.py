"""The per-ensemble CA Secret on a real apiserver (issue 19): created by the agent under
exactly the rights of manifests/agent/role-ca-secrets.yaml (as the audit log shows), in
the agent's own namespace only, and the same CA after the agent restarts.

The agent runs as the base manifests' ServiceAccount with the committed RBAC; the
Role is applied verbatim.
"""

from __future__ import annotations

import base64
import hashlib
import ssl
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from imex_shared.model import EnsembleId
from tests.realk8s.agentproc import (
    AGENT_MANIFESTS,
    AGENT_SA,
    AGENT_SA_NAMESPACE,
    AGENT_USER,
    HostAgentProc,
    apply_base_rbac,
    may,
    rights_used,
    start_host_agent,
)
from tests.realk8s.fixtures import ensemble_service
from tests.realk8s.harness import ControlPlane, wait_until
from tests.realk8s.kubeops import SERVICES

pytestmark = pytest.mark.realk8s

ROLE_FILE = AGENT_MANIFESTS / "role-ca-secrets.yaml"
SECRETS = f"/api/v1/namespaces/{AGENT_SA_NAMESPACE}/secrets"


def apply_ca_role(cp: ControlPlane) -> set[tuple[str, str, str]]:
    """The Role and RoleBinding exactly as committed; returns the rights the Role grants."""
    admin = cp.admin
    assert admin is not None
    granted: set[tuple[str, str, str]] = set()
    for obj in yaml.safe_load_all(ROLE_FILE.read_text()):
        kind, name = obj["kind"], obj["metadata"]["name"]
        plural = "roles" if kind == "Role" else "rolebindings"
        admin.apply(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{AGENT_SA_NAMESPACE}/"
                    f"{plural}/{name}", obj)
        if kind == "Role":
            granted |= {(g, r, v) for rule in obj["rules"] for g in rule["apiGroups"]
                        for r in rule["resources"] for v in rule["verbs"]}
    return granted


def start_agent(cp: ControlPlane, name: str) -> HostAgentProc:
    token = cp.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
    kc = cp.write_kubeconfig(cp.workdir / f"{name}.kubeconfig", token, AGENT_SA)
    return start_host_agent(cp, name, kc, "--agent-namespace", AGENT_SA_NAMESPACE)


def fingerprint(secret: dict[str, Any]) -> str:
    pem = base64.b64decode(secret["data"]["ca.crt"]).decode()
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


@pytest.fixture(scope="module")
def ensemble(control_plane: ControlPlane) -> Iterator[EnsembleId]:
    admin = control_plane.admin
    assert admin is not None
    apply_base_rbac(control_plane)
    ns = f"rk8s-tls-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        yield EnsembleId(ns, "tls")
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")
        admin.delete(f"{SECRETS}/imex-ca-{ns}.tls")


def test_ca_secret_under_exactly_the_roles_rights_and_kept_across_a_restart(
        control_plane: ControlPlane, ensemble: EnsembleId) -> None:
    admin = control_plane.admin
    assert admin is not None
    granted = apply_ca_role(control_plane)
    assert granted == {("", "secrets", "get"), ("", "secrets", "create"),
                       ("", "secrets", "update")}
    # the Role is namespaced: no Secret anywhere else, nothing cluster-wide
    assert may(admin, AGENT_USER, "", "secrets", "get", AGENT_SA_NAMESPACE)
    assert may(admin, AGENT_USER, "", "secrets", "create", AGENT_SA_NAMESPACE)
    assert not may(admin, AGENT_USER, "", "secrets", "get", ensemble.namespace)
    assert not may(admin, AGENT_USER, "", "secrets", "list", AGENT_SA_NAMESPACE)
    assert not may(admin, AGENT_USER, "", "secrets", "watch", AGENT_SA_NAMESPACE)
    assert not may(admin, AGENT_USER, "", "secrets", "get", "")
    mark = control_plane.audit_mark()
    agent = start_agent(control_plane, "host-agent-tls")
    name = f"imex-ca-{ensemble.namespace}.{ensemble.name}"
    try:
        svc = ensemble_service(ensemble.namespace, ensemble.name)
        svc["metadata"]["annotations"]["imex-ensemble.io/auth-encryption"] = "true"
        admin.create(SERVICES.format(ns=ensemble.namespace), svc)
        got: dict[str, Any] = {}

        def created() -> bool:
            r = admin.request("GET", f"{SECRETS}/{name}")
            if r.status_code == 200:
                got.update(r.json())
            return r.status_code == 200

        wait_until(created, f"Secret {AGENT_SA_NAMESPACE}/{name}", 30)
        sha = fingerprint(got)
        assert set(got["data"]) == {"ca.crt", "ca.key"}
        rv = got["metadata"]["resourceVersion"]

        def published() -> bool:
            doc = httpx.get(f"{agent.registry}/v1/ensembles/{ensemble.namespace}/"
                            f"{ensemble.name}", timeout=5).json()
            svc_now = admin.get(f"{SERVICES.format(ns=ensemble.namespace)}/{ensemble.name}")
            return bool((doc.get("tls") or {}).get("ca_sha256") == sha and
                        svc_now["metadata"]["annotations"].get(
                            "imex-ensemble.io/ca-sha256") == sha)

        wait_until(published, "the fingerprint in the registry and on the Service", 30)
    finally:
        control_plane.stop_process("host-agent-tls")
    # every Secret call the agent made: within the Role, in its namespace, on that name
    events = [e for e in control_plane.audit_events(AGENT_USER, mark)
              if e.get("stage") == "ResponseComplete"
              and e.get("objectRef", {}).get("resource") == "secrets"]
    assert events, "no Secret calls in the audit log"
    for e in events:
        ref = e["objectRef"]
        assert ref.get("namespace") == AGENT_SA_NAMESPACE, e
        assert ref.get("name") in (name, None), e
        code = e["responseStatus"]["code"]
        assert code < 400 or (code == 404 and e["verb"] == "get"), e  # never a 403
    used = {r for r in rights_used(control_plane, AGENT_USER, mark) if r[1] == "secrets"}
    assert used == {("", "secrets", "get", AGENT_SA_NAMESPACE),
                    ("", "secrets", "create", AGENT_SA_NAMESPACE)}
    assert {r[:3] for r in used} <= granted
    # a restart finds the same CA: nothing is written, the fingerprint stays
    mark = control_plane.audit_mark()
    agent = start_agent(control_plane, "host-agent-tls-2")
    try:
        def same() -> bool:
            doc = httpx.get(f"{agent.registry}/v1/ensembles/{ensemble.namespace}/"
                            f"{ensemble.name}", timeout=5).json()
            return bool((doc.get("tls") or {}).get("ca_sha256") == sha)

        wait_until(same, "the restarted agent to serve the same CA", 30)
        after = admin.get(f"{SECRETS}/{name}")
        assert fingerprint(after) == sha and after["metadata"]["resourceVersion"] == rv
    finally:
        control_plane.stop_process("host-agent-tls-2")
    used = {r for r in rights_used(control_plane, AGENT_USER, mark) if r[1] == "secrets"}
    assert used == {("", "secrets", "get", AGENT_SA_NAMESPACE)}
