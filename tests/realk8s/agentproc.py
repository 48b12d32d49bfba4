"""The host agent as the realk8s tests run it: its identity (the base manifests'
ServiceAccount, RBAC and admission policy, applied verbatim), a view of its registry
and metrics, and what its rights are and which of them it used (audit log).

``MANIFESTS`` is what an operator installs (manifests/base: the CRD, the namespace and
the agent); ``AGENT_MANIFESTS`` holds the agent's own files (manifests/agent),
``CRD_MANIFESTS`` the CRD's."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tests.realk8s.harness import Api, ControlPlane, Proc, free_port, wait_until

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "base"
AGENT_MANIFESTS = MANIFESTS.parent / "agent"
CRD_MANIFESTS = MANIFESTS.parent / "crds"
AGENT_SA_NAMESPACE = "imex-system"
AGENT_SA = "imex-host-agent"
AGENT_USER = f"system:serviceaccount:{AGENT_SA_NAMESPACE}:{AGENT_SA}"
Right = tuple[str, str, str]  # (API group, resource[/subresource], verb)
Grant = tuple[str, str, str, str]  # a Right and its namespace ("" for cluster-wide)


@dataclass
class HostAgentProc:
    registry: str  # base URL of its HTTP registry on loopback
    proc: Proc
    kubeconfig: Path
    #: the audit log's position before it started (identities are shared by a session's
    #: tests: its own requests are the ones after this mark)
    audit_mark: int = 0

    def metric(self, name: str, **labels: str) -> float:
        """Current value of one Prometheus sample (0 when absent)."""
        text = httpx.get(f"{self.registry}/metrics", timeout=5).text
        for line in text.splitlines():
            if not line.startswith(name):
                continue
            head, _, value = line.rpartition(" ")
            if head.split("{", 1)[0] != name:
                continue
            if all(f'{k}="{v}"' in head for k, v in labels.items()):
                return float(value)
        return 0.0


#: What of the base kustomization makes up the agent's identity and its limits (the
#: Deployment, Service, NetworkPolicy and the CRD are not applied by this helper).
#: kind -> (apiVersion, plural, namespaced).
IDENTITY_KINDS = {
    "Namespace": ("v1", "namespaces", False),
    "ServiceAccount": ("v1", "serviceaccounts", True),
    "ClusterRole": ("rbac.authorization.k8s.io/v1", "clusterroles", False),
    "ClusterRoleBinding": ("rbac.authorization.k8s.io/v1", "clusterrolebindings", False),
    "Role": ("rbac.authorization.k8s.io/v1", "roles", True),
    "RoleBinding": ("rbac.authorization.k8s.io/v1", "rolebindings", True),
    "ValidatingAdmissionPolicy": ("admissionregistration.k8s.io/v1",
                                  "validatingadmissionpolicies", False),
    "ValidatingAdmissionPolicyBinding": ("admissionregistration.k8s.io/v1",
                                         "validatingadmissionpolicybindings", False),
}


def start_host_agent(cp: ControlPlane, name: str, kubeconfig: Path,
                     *extra: str) -> HostAgentProc:
    """The installed ``imex-host-agent`` as process ``name`` of ``cp`` (stopped with
    ``cp.stop_process(name)``), registry on a free loopback port, JSON logs, ``extra``
    flags; returned once its /readyz answers 200."""
    mark = cp.audit_mark()
    port = free_port()
    exe = Path(sys.executable).with_name("imex-host-agent")
    proc = cp._spawn(name, [str(exe), "--kubeconfig", str(kubeconfig), "--listen",
                            f"127.0.0.1:{port}", "--json", *extra])
    agent = HostAgentProc(f"http://127.0.0.1:{port}", proc, kubeconfig, mark)
    cp._await(proc, f"{name} /readyz",
              lambda: httpx.get(f"{agent.registry}/readyz", timeout=2).status_code == 200, 60)
    return agent


def object_path(obj: dict[str, object]) -> str:
    """The REST path of one object of IDENTITY_KINDS."""
    api_version, plural, namespaced = IDENTITY_KINDS[str(obj["kind"])]
    meta = obj["metadata"]
    assert isinstance(meta, dict)
    base = f"/api/{api_version}" if "/" not in api_version else f"/apis/{api_version}"
    if namespaced:
        return f"{base}/namespaces/{meta['namespace']}/{plural}/{meta['name']}"
    return f"{base}/{plural}/{meta['name']}"


def apply_base_rbac(cp: ControlPlane) -> None:
    """Apply every Namespace, ServiceAccount, (Cluster)Role, binding and admission
    policy of the base kustomization exactly as `kubectl kustomize manifests/base`
    renders it (the pinned kubectl), so a role another file adds comes along; returns
    once the Service policy is enforced, so the agent never runs a moment without it."""
    admin = cp.admin
    assert admin is not None
    rendered = cp.kubectl("kustomize", str(MANIFESTS)).stdout
    for obj in yaml.safe_load_all(rendered):
        if isinstance(obj, dict) and obj.get("kind") in IDENTITY_KINDS:
            admin.apply(object_path(obj), obj)
    wait_policy_enforced(admin, AGENT_USER)


def foreign_service(namespace: str, name: str, **spec: object) -> dict[str, object]:
    """A Service that is no ensemble's (no label; a LoadBalancer unless told otherwise)."""
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "namespace": namespace},
            "spec": {"type": "LoadBalancer", "ports": [{"port": 80}], **spec}}


def wait_policy_enforced(admin: Api, user: str, timeout: float = 60) -> None:
    """Until the apiserver's policy informer has the policy: a dry-run create of a
    LoadBalancer Service, impersonating ``user``, is denied by it."""
    ns = AGENT_SA_NAMESPACE

    def denied() -> bool:
        resp = admin.request("POST", f"/api/v1/namespaces/{ns}/services",
                             foreign_service(ns, "vap-probe"), params={"dryRun": "All"},
                             headers={"Impersonate-User": user})
        return resp.status_code == 403 and "ValidatingAdmissionPolicy" in resp.text

    wait_until(denied, "the Service admission policy to be enforced", timeout)


def granted_rights(role_file: str = "clusterrole.yaml") -> set[Right]:
    """Every (group, resource, verb) the committed role grants."""
    role = yaml.safe_load((AGENT_MANIFESTS / role_file).read_text())
    return {(group, res, verb) for rule in role["rules"] for group in rule["apiGroups"]
            for res in rule["resources"] for verb in rule["verbs"]}


def may(admin: Api, user: str, group: str, resource: str, verb: str,
        namespace: str = "") -> bool:
    """Ask the apiserver's authorizer (SubjectAccessReview) about a ServiceAccount user."""
    res, _, sub = resource.partition("/")
    sa_ns = user.split(":")[2]
    review = admin.create("/apis/authorization.k8s.io/v1/subjectaccessreviews", {
        "apiVersion": "authorization.k8s.io/v1", "kind": "SubjectAccessReview",
        "spec": {"user": user,
                 "groups": ["system:serviceaccounts", f"system:serviceaccounts:{sa_ns}",
                            "system:authenticated"],
                 "resourceAttributes": {"group": group, "resource": res, "subresource": sub,
                                        "verb": verb, "namespace": namespace}}})
    return bool(review["status"].get("allowed"))


def rights_used(cp: ControlPlane, user: str = AGENT_USER, after: int = 0) -> set[Grant]:
    """What ``user`` did and where, from the audit log (after the mark ``after``): a
    server-side apply that created its object was authorized as create too, though the
    audit event only names patch. The namespace is "" for cluster-wide requests."""
    used: set[Grant] = set()
    for e in cp.audit_events(user, after):
        if e.get("stage") != "ResponseComplete" or "objectRef" not in e:
            continue
        ref = e["objectRef"]
        res = ref["resource"] + (f"/{ref['subresource']}" if ref.get("subresource") else "")
        ns = ref.get("namespace", "")
        used.add((ref.get("apiGroup", ""), res, e["verb"], ns))
        if e["verb"] == "patch" and e.get("responseStatus", {}).get("code") == 201:
            used.add((ref.get("apiGroup", ""), res, "create", ns))
    return used


def agent_grants(cp: ControlPlane, sa_namespace: str = AGENT_SA_NAMESPACE,
                 sa: str = AGENT_SA) -> set[Grant]:
    """Every right the base kustomization gives the ServiceAccount, through each
    binding naming it: cluster-wide for ClusterRoleBindings (namespace ""), in the
    binding's namespace for RoleBindings."""
    objs = [o for o in yaml.safe_load_all(cp.kubectl("kustomize", str(MANIFESTS)).stdout)
            if isinstance(o, dict)]
    roles = {(o["kind"], o["metadata"].get("namespace", "") if o["kind"] == "Role" else "",
              o["metadata"]["name"]): o.get("rules") or []
             for o in objs if o["kind"] in ("Role", "ClusterRole")}
    out: set[Grant] = set()
    for b in objs:
        if b["kind"] not in ("RoleBinding", "ClusterRoleBinding"):
            continue
        if not any(s.get("kind") == "ServiceAccount" and s.get("name") == sa
                   and s.get("namespace") == sa_namespace for s in b.get("subjects") or []):
            continue
        ns = b["metadata"].get("namespace", "") if b["kind"] == "RoleBinding" else ""
        ref = b["roleRef"]
        rules = roles[(ref["kind"], ns if ref["kind"] == "Role" else "", ref["name"])]
        out |= {(g, r, v, ns) for rule in rules for g in rule["apiGroups"]
                for r in rule["resources"] for v in rule["verbs"]}
    return out


def covers(grant: Grant, used: Grant) -> bool:
    """A cluster-wide grant covers a use anywhere; a namespaced one, in its namespace."""
    return grant[:3] == used[:3] and grant[3] in ("", used[3])
