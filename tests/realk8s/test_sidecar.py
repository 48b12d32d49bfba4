"""The hook-sidecar variant (manifests/overlays/sidecar) against the real apiserver.

Each VM's launcher pod runs its own host agent in sidecar scope (``--vmi``), as the
overlay's ServiceAccount, whose rights are the overlay's namespaced Role, applied
verbatim. Each agent owns one slice per VMI (``<svc>-imex-vmi-<vmi>``); the real
CoreDNS must merge the slices of one Service into one set of names and one SRV, and
the namespaced Role must be enough (no 403 in the audit log once the apiserver is up).
"""

from __future__ import annotations

import functools
import subprocess
import sys
from collections.abc import Iterator
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

pytestmark = pytest.mark.realk8s

OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "overlays" / "sidecar"
IPS = {0: "10.60.0.10", 1: "10.60.0.11"}


def _ready(url: str) -> bool:
    return httpx.get(url, timeout=2).status_code == 200


def _tail(path: Path) -> str:
    return path.read_text()[-2000:]


def _overlay_rbac() -> list[dict[str, Any]]:
    return [o for o in yaml.safe_load_all((OVERLAY / "rbac.yaml").read_text()) if o]


@pytest.fixture
def sidecars(control_plane: ControlPlane, tmp_path: Path) -> Iterator[tuple[str, str]]:
    """Namespace, Service, two VMIs and one sidecar-scope agent per VMI.
    Yields (namespace, ServiceAccount user name)."""
    if not (OVERLAY / "rbac.yaml").exists():
        pytest.skip("manifests/overlays/sidecar/rbac.yaml is not in this tree")
    admin = control_plane.admin
    assert admin is not None
    objs = _overlay_rbac()
    ns = objs[0]["metadata"]["namespace"]  # the overlay names its namespace
    sa = next(o for o in objs if o["kind"] == "ServiceAccount")["metadata"]["name"]
    wait_namespace_absent(admin, ns)  # the namespaced overlay's test uses it too
    admin.apply(f"/api/v1/namespaces/{ns}",
                {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    plural = {"ServiceAccount": "/api/v1/namespaces/{ns}/serviceaccounts/{name}",
              "Role": "/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/roles/{name}",
              "RoleBinding": ("/apis/rbac.authorization.k8s.io/v1/namespaces/{ns}/"
                              "rolebindings/{name}")}
    for obj in objs:
        admin.apply(plural[obj["kind"]].format(ns=ns, name=obj["metadata"]["name"]), obj)
    token = control_plane.service_account_token(ns, sa)
    kc = control_plane.write_kubeconfig(tmp_path / "sidecar.kubeconfig", token, sa)

    admin.create(SERVICES.format(ns=ns), ensemble_service(ns, "pool"))
    for i, ip in IPS.items():
        create_vmi(admin, vmi(ns, f"pool-{i}", "pool", ip=ip, node=f"n{i}"))
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = {i: free_port() for i in IPS}
        for i, port in ports.items():
            procs.append(subprocess.Popen(
                [str(Path(sys.executable).with_name("imex-host-agent")), "--kubeconfig",
                 str(kc), "--json", "--listen", f"127.0.0.1:{port}", "--vmi", f"pool-{i}",
                 "--namespace", ns],
                stdout=(tmp_path / f"agent-{i}.log").open("wb"), stderr=subprocess.STDOUT))
        for i, port in ports.items():
            wait_until(functools.partial(_ready, f"http://127.0.0.1:{port}/readyz"),
                       f"sidecar agent {i} ready", 60,
                       functools.partial(_tail, tmp_path / f"agent-{i}.log"))
        yield ns, f"system:serviceaccount:{ns}:{sa}"
    finally:
        end_processes(*procs)
        admin.delete(f"/api/v1/namespaces/{ns}")


def test_sidecar_agents_publish_per_vmi_slices_that_coredns_merges(
        control_plane: ControlPlane, sidecars: tuple[str, str]) -> None:
    ns, user = sidecars
    admin = control_plane.admin
    assert admin is not None
    ens = EnsembleId(ns, "pool")

    def slices() -> dict[str, list[str]]:
        items = admin.get(SLICES.format(ns=ns))["items"]
        return {s["metadata"]["name"]: [e["hostname"] for e in s.get("endpoints") or []]
                for s in items}

    want = {f"pool-imex-vmi-pool-{i}": [ens.slot(i)] for i in IPS}
    wait_until(lambda: slices() == want, f"per-VMI slices {want}", 60,
               lambda: f"; last: {slices()}")
    port = control_plane.dns_port
    for i, ip in IPS.items():
        wait_dns(port, ens.slot_fqdn(i) + ".", "A", {ip})
    wait_dns(port, ens.srv_name() + ".", "SRV",
             {f"0 50 50000 {ens.slot_fqdn(i)}." for i in IPS})
    wait_dns(port, ens.service_fqdn() + ".", "A", set(IPS.values()))

    denied = [(e["verb"], e["requestURI"]) for e in control_plane.audit_events(user)
              if e.get("stage") == "ResponseComplete"
              and e.get("responseStatus", {}).get("code") == 403]
    assert not denied, f"the sidecar overlay's Role lacks rights: {denied}"
