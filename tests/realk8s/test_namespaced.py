"""The namespaced overlay (manifests/overlays/namespaced) against the real apiserver.

``kubectl kustomize`` renders the overlay; its Namespace, ServiceAccount, Role and
RoleBinding are applied as rendered, and the agent runs with the rendered
Deployment's own arguments (only ``--listen`` moved to loopback). The Role is
granted in one namespace only, so the agent must keep to it: it publishes the
ensemble there, ignores an ensemble elsewhere, and is never refused (a cluster-wide
list would be: 403).
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from imex_shared.model import EnsembleId
from tests.realk8s.fixtures import ensemble_service, vmi
from tests.realk8s.harness import ControlPlane, end_processes, free_port, wait_until
from tests.realk8s.kubeops import (
    SERVICES,
    SLICES,
    create_vmi,
    wait_dns,
    wait_namespace_absent,
)
from tests.realk8s.podspec import tls_on_loopback

pytestmark = pytest.mark.realk8s

OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "overlays" / "namespaced"
PATHS = {
    "Namespace": "/api/v1/namespaces/{name}",
    "ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts/{name}",
    "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{name}",
    "RoleBinding": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/rolebindings/{name}",
}


def render(control_plane: ControlPlane) -> list[dict[str, Any]]:
    """The overlay as the tier's own kubectl (built with the apiserver) renders it."""
    out = control_plane.kubectl("kustomize", str(OVERLAY)).stdout
    return [o for o in yaml.safe_load_all(out) if o]


def test_namespaced_overlay_keeps_to_its_namespace(control_plane: ControlPlane,
                                                   tmp_path: Path) -> None:
    admin = control_plane.admin
    assert admin is not None
    objs = render(control_plane)
    role = next(o for o in objs if o["kind"] == "Role")
    vm_ns = role["metadata"]["namespace"]
    deployment = next(o for o in objs if o["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    sa_ns = deployment["metadata"]["namespace"]
    sa = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert f"--namespace={vm_ns}" in container["args"]

    wait_namespace_absent(admin, vm_ns)
    admin.apply(f"/api/v1/namespaces/{vm_ns}",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": vm_ns}})
    for obj in objs:
        if obj["kind"] in PATHS:
            md = obj["metadata"]
            admin.apply(PATHS[obj["kind"]].format(ns=md.get("namespace"), name=md["name"]),
                        obj)
    other = f"rk8s-other-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": other}})
    # A fresh namespaced install has no cluster-wide grant; the base install of
    # another test in this session does (same ServiceAccount): remove it.
    for kind in ("clusterrolebindings", "clusterroles"):
        admin.delete(f"/apis/rbac.authorization.k8s.io/v1/{kind}/{sa}")
    token = control_plane.service_account_token(sa_ns, sa)
    kc = control_plane.write_kubeconfig(tmp_path / "ns.kubeconfig", token, sa)
    port = free_port()
    args = tls_on_loopback([a for a in container["args"] if not a.startswith("--listen")],
                           free_port())
    log = tmp_path / "agent.log"
    mark = control_plane.audit_mark()
    agent = subprocess.Popen(
        [str(Path(sys.executable).with_name("imex-host-agent")), *args,
         "--listen", f"127.0.0.1:{port}", "--kubeconfig", str(kc)],
        stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        for ns in (vm_ns, other):
            admin.create(SERVICES.format(ns=ns), ensemble_service(ns, "racky"))
            create_vmi(admin, vmi(ns, "racky-0", "racky", ip="10.70.0.1"))
        wait_until(lambda: httpx.get(f"http://127.0.0.1:{port}/readyz",
                                     timeout=2).status_code == 200,
                   "namespaced agent ready", 60, lambda: log.read_text()[-3000:])
        ens = EnsembleId(vm_ns, "racky")
        wait_dns(control_plane.dns_port, ens.slot_fqdn(0) + ".", "A", {"10.70.0.1"})
        names = [s["metadata"]["name"] for s in admin.get(SLICES.format(ns=other))["items"]]
        assert names == [], "the agent published outside its namespace"
        listed = httpx.get(f"http://127.0.0.1:{port}/v1/ensembles", timeout=5).json()
        assert {(e["namespace"], e["name"]) for e in listed["items"]} == {(vm_ns, "racky")}
        user = f"system:serviceaccount:{sa_ns}:{sa}"
        denied = [(e["verb"], e["requestURI"]) for e in control_plane.audit_events(user, mark)
                  if e.get("stage") == "ResponseComplete"
                  and e.get("responseStatus", {}).get("code") == 403]
        assert not denied, f"refused: {denied}"
    finally:
        end_processes(agent)
        for ns in (vm_ns, other):
            admin.delete(f"/api/v1/namespaces/{ns}")
