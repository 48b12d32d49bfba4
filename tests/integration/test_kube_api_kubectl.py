"""The API double driven by the real kubectl, and run standalone as a process.

kubectl exercises what lightkube does not: legacy discovery and short names
(`vmi`), its OpenAPI v3 probe for server-side field validation, client-side
apply with last-applied annotations, the managedFields migration to
server-side apply, 422 rendering from `details.causes`, watch output.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.sandbox.kube_api.fixtures import KubeApiHandle, kube_api_fixture  # noqa: F401

KUBECTL = shutil.which("kubectl")
pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("machine_kubectl"),  # skips without one, fails below the floor
]
REPO = Path(__file__).resolve().parents[2]

MANIFEST = """\
apiVersion: v1
kind: Service
metadata:
  name: ens
  labels: {imex-ensemble.io/ensemble: ens}
spec:
  clusterIP: None
  ports: [{name: imex, port: 50000}]
---
apiVersion: kubevirt.io/v1
kind: VirtualMachineInstance
metadata:
  name: ens-0
  labels: {imex-ensemble.io/ensemble: ens}
spec:
  domain:
    devices: {}
    resources: {requests: {memory: 1Gi}}
"""


def slice_yaml(hostname: str = "imex-0a1b2c3d-0", address: str = "10.244.0.5",
               uid: str = "") -> str:
    owner = (f"  ownerReferences: [{{apiVersion: v1, kind: Service, name: ens, uid: {uid}}}]\n"
             if uid else "")
    return f"""\
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: ens-imex
  labels:
    kubernetes.io/service-name: ens
    endpointslice.kubernetes.io/managed-by: host-agent.imex-ensemble.io
{owner}addressType: IPv4
endpoints:
- addresses: ["{address}"]
  hostname: {hostname}
  conditions: {{ready: true}}
ports: [{{name: imex, port: 50000, protocol: TCP}}]
"""


class Kubectl:
    def __init__(self, kubeconfig: Path, cache: Path) -> None:
        self.base = [str(KUBECTL), "--kubeconfig", str(kubeconfig), "--cache-dir", str(cache)]

    def __call__(self, *args: str, stdin: str | None = None,
                 check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([*self.base, *args], input=stdin, capture_output=True, text=True,
                              timeout=30)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed: {proc.stderr}")
        return proc


@pytest.fixture
def kubectl(kube_api: KubeApiHandle, tmp_path: Path) -> Kubectl:
    return Kubectl(kube_api.kubeconfig_path, tmp_path / "kubectl-cache")


def test_apply_get_and_selectors(kubectl: Kubectl, kube_api: KubeApiHandle) -> None:
    out = kubectl("apply", "-f", "-", stdin=MANIFEST).stdout
    assert "service/ens created" in out
    assert "virtualmachineinstance.kubevirt.io/ens-0 created" in out
    rv = kube_api.resource_version
    again = kubectl("apply", "-f", "-", stdin=MANIFEST).stdout
    assert "service/ens unchanged" in again and kube_api.resource_version == rv
    names = kubectl("get", "svc,vmi", "-l", "imex-ensemble.io/ensemble in (ens),!missing",
                    "-o", "name").stdout.split()
    assert names == ["service/ens", "virtualmachineinstance.kubevirt.io/ens-0"]
    assert kubectl("get", "vmi", "-l", "imex-ensemble.io/ensemble=other",
                   "-o", "name").stdout == ""
    selected = kubectl("get", "vmi", "-A", "--field-selector", "metadata.name=ens-0",
                       "-o", "jsonpath={.items[*].metadata.namespace}").stdout
    assert selected == "default"


def test_status_subresource_and_server_side_apply(kubectl: Kubectl,
                                                  kube_api: KubeApiHandle) -> None:
    kubectl("apply", "-f", "-", stdin=MANIFEST)
    kubectl("patch", "vmi", "ens-0", "--subresource=status", "--type=merge",
            "-p", '{"status":{"phase":"Running","interfaces":[{"name":"default",'
                  '"ipAddress":"10.244.0.5"}]}}')
    ip = kubectl("get", "vmi", "ens-0", "-o",
                 "jsonpath={.status.phase} {.status.interfaces[0].ipAddress}").stdout
    assert ip == "Running 10.244.0.5"
    # server-side printing: KubeVirt's printer columns, as `kubectl get vmi` shows them
    header, row = kubectl("get", "vmi", "ens-0").stdout.splitlines()
    assert header.split() == ["NAME", "AGE", "PHASE", "IP", "NODENAME", "READY"]
    assert row.split()[0] == "ens-0" and row.split()[2:4] == ["Running", "10.244.0.5"]
    # a main-resource patch cannot change status (status subresource split)
    kubectl("patch", "vmi", "ens-0", "--type=merge", "-p", '{"status":{"phase":"Failed"}}')
    assert kubectl("get", "vmi", "ens-0", "-o", "jsonpath={.status.phase}").stdout == "Running"

    applied = kubectl("apply", "--server-side", "--field-manager=imex-host-agent", "-f", "-",
                      stdin=slice_yaml())
    assert "endpointslice.discovery.k8s.io/ens-imex serverside-applied" in applied.stdout
    kube_api.reset_counters()
    kubectl("apply", "--server-side", "--field-manager=imex-host-agent", "-f", "-",
            stdin=slice_yaml())
    assert kube_api.changes == {}  # idempotent apply: nothing stored
    clash = kubectl("apply", "--server-side", "--field-manager=intruder", "-f", "-",
                    stdin=slice_yaml(address="10.244.0.9"), check=False)
    assert clash.returncode != 0
    assert 'conflict with "imex-host-agent"' in clash.stderr and ".endpoints" in clash.stderr


def test_delete_service_garbage_collects_its_slice(kubectl: Kubectl) -> None:
    kubectl("apply", "-f", "-", stdin=MANIFEST)
    uid = kubectl("get", "svc", "ens", "-o", "jsonpath={.metadata.uid}").stdout
    kubectl("apply", "--server-side", "--field-manager=imex-host-agent", "-f", "-",
            stdin=slice_yaml(uid=uid))
    assert kubectl("get", "endpointslices", "-o", "name").stdout.split() == \
        ["endpointslice.discovery.k8s.io/ens-imex"]
    assert 'service "ens" deleted' in kubectl("delete", "svc", "ens").stdout
    assert kubectl("get", "endpointslices", "-o", "name").stdout == ""


@pytest.mark.parametrize(("doc", "words"), [
    (slice_yaml(hostname="Imex_0"),
     ['The EndpointSlice "ens-imex" is invalid', "endpoints[0].hostname", "RFC 1123"]),
    (slice_yaml(address="127.0.0.2"),
     ['The EndpointSlice "ens-imex" is invalid', "endpoints[0].addresses[0]", "loopback"]),
    (MANIFEST.split("---\n")[1].replace("devices: {}", "devices: 7"),
     ['The VirtualMachineInstance "ens-0" is invalid', "spec.domain.devices"]),
])
def test_invalid_objects_get_422_as_kubectl_shows_it(kubectl: Kubectl, doc: str,
                                                     words: list[str]) -> None:
    proc = kubectl("apply", "-f", "-", stdin=doc, check=False)
    assert proc.returncode != 0
    for w in words:
        assert w in proc.stderr, proc.stderr


def test_kubectl_watch_sees_events(kubectl: Kubectl, kube_api: KubeApiHandle) -> None:
    watcher = subprocess.Popen(
        [*kubectl.base, "get", "vmi", "--watch-only", "--output-watch-events", "-o",
         "custom-columns=EVENT:.type,NAME:.object.metadata.name,PHASE:.object.status.phase",
         "--no-headers"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while kube_api.requests[("watch", "virtualmachineinstances")] == 0:
            assert time.monotonic() < deadline, "kubectl never started watching"
            time.sleep(0.05)
        vmi: dict[str, Any] = {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": "ens-1", "namespace": "default"},
            "spec": {"domain": {"devices": {}}}, "status": {"phase": "Scheduling"}}
        kube_api.put(vmi)
        vmi["status"]["phase"] = "Running"
        kube_api.put(vmi)
        kube_api.delete("kubevirt.io/v1", "VirtualMachineInstance", "ens-1", "default")
        assert watcher.stdout is not None
        lines = [watcher.stdout.readline().split() for _ in range(3)]
    finally:
        watcher.terminate()
        watcher.wait(5)
    assert lines == [["ADDED", "ens-1", "Scheduling"], ["MODIFIED", "ens-1", "Running"],
                     ["DELETED", "ens-1", "Running"]]


def test_standalone_process_serves_kubectl_and_stops_on_sigterm(tmp_path: Path) -> None:
    kubeconfig = tmp_path / "kubeconfig"
    seed = tmp_path / "seed.yaml"
    seed.write_text(MANIFEST)
    proc = subprocess.Popen(
        [sys.executable, "-m", "tests.sandbox", "kube-api", "--listen", "127.0.0.1:0",
         "--kubeconfig-out", str(kubeconfig), "--seed", str(seed)],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline()
        assert ready.startswith("kube-api ready url=http://127.0.0.1:"), proc.stderr
        kubectl = Kubectl(kubeconfig, tmp_path / "cache")
        assert kubectl("get", "vmi", "-o", "name").stdout.split() == \
            ["virtualmachineinstance.kubevirt.io/ens-0"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_standalone_refuses_bad_arguments(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "tests.sandbox", "kube-api", "--listen", "localhost",
         "--kubeconfig-out", str(tmp_path / "kc")],
        cwd=REPO, capture_output=True, text=True, timeout=30,
        env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 2 and "--listen wants HOST:PORT" in proc.stderr


def test_kubectl_strict_field_validation(kubectl: Kubectl) -> None:
    doc = slice_yaml().replace("  hostname: imex-0a1b2c3d-0", "  hostName: imex-0a1b2c3d-0")
    proc = kubectl("apply", "-f", "-", stdin=doc, check=False)
    assert proc.returncode != 0
    assert 'unknown field "endpoints[0].hostName"' in proc.stderr, proc.stderr
