"""The host agent as the realk8s tests run it: its identity (the base manifests'
ServiceAccount and RBAC, applied verbatim) and a view of its registry and metrics."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml

from tests.realk8s.harness import ControlPlane, Proc

MANIFESTS = Path(__file__).resolve().parents[2] / "manifests" / "base"
AGENT_SA_NAMESPACE = "imex-system"
AGENT_SA = "imex-host-agent"
AGENT_USER = f"system:serviceaccount:{AGENT_SA_NAMESPACE}:{AGENT_SA}"


@dataclass
class HostAgentProc:
    registry: str  # base URL of its HTTP registry on loopback
    proc: Proc
    kubeconfig: Path

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


def apply_base_rbac(cp: ControlPlane) -> None:
    """Apply the base kustomization's Namespace, ServiceAccount, ClusterRole and binding
    exactly as committed (the kustomization's namespace is imex-system throughout)."""
    admin = cp.admin
    assert admin is not None
    paths = {
        "Namespace": lambda m: f"/api/v1/namespaces/{m['name']}",
        "ServiceAccount": lambda m: (f"/api/v1/namespaces/{AGENT_SA_NAMESPACE}"
                                     f"/serviceaccounts/{m['name']}"),
        "ClusterRole": lambda m: f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{m['name']}",
        "ClusterRoleBinding": lambda m: ("/apis/rbac.authorization.k8s.io/v1/"
                                         f"clusterrolebindings/{m['name']}"),
    }
    for fname in ("namespace.yaml", "serviceaccount.yaml", "clusterrole.yaml",
                  "clusterrolebinding.yaml"):
        for obj in yaml.safe_load_all((MANIFESTS / fname).read_text()):
            if obj is None:
                continue
            if obj["kind"] == "ServiceAccount":
                obj["metadata"]["namespace"] = AGENT_SA_NAMESPACE
            admin.apply(paths[obj["kind"]](obj["metadata"]), obj)
