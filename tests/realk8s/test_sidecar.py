"""The hook-sidecar layout (manifests/overlays/sidecar) as shipped, on the real apiserver.

The overlay's own objects, as ``kubectl kustomize`` renders them, are applied as a user
applies them (``kubectl apply``, the tier's kubectl, the admin's kubeconfig) to a
kube-apiserver that serves what a KubeVirt cluster with Multus serves (the VMI, pool
and NetworkAttachmentDefinition CRDs, from KubeVirt's schema and Multus' shape). No
KubeVirt runs here, so the test does its parts, in its order:

- the pool controller: each VMI from the pool's template (labels, the sidecar
  annotation, spec), named ``<pool>-<ordinal>``, with KubeVirt's finalizer;
- the launcher pod: the annotation's command, exactly as written, run by ``/bin/sh -c``
  in a mount and UTS namespace that gives it what the pod gives it: its hostname is
  the VMI's name, ``/var/run/secrets/kubernetes.io/serviceaccount`` holds a token of the
  pool's ``serviceAccount`` volume (TokenRequest), the CA and the namespace, the
  in-cluster environment names the apiserver, and ``/var/run/kubevirt-hooks`` is an
  empty directory. Only the registry's port moves off 8080 (the pods' network
  namespaces are one here);
- virt-launcher: the hook ``Info`` call on the socket (which must be answered before a
  VM starts), later ``Shutdown`` (when it is done with the VM);
- virt-handler: the VMI's status (Running, the ``imex`` network's address).

Then: each sidecar publishes its own ``<svc>-imex-vmi-<vmi>`` slice, CoreDNS merges
them into the slot names, one SRV and the Service's A record; a VMI's deletion removes
its slice while the VMI still waits for its finalizer, and the sidecar stops after the
Shutdown call; the overlay's Role is enough (no 403 in the audit log).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
import yaml

from imex_shared.model import EnsembleId
from tests.host_support.hook_oracle import message
from tests.realk8s.crd import kubevirt_openapi, network_attachment_definition_crd, pool_crd
from tests.realk8s.harness import ControlPlane, Proc, _die_with_parent, free_port, wait_until
from tests.realk8s.kubeops import SLICES, VMIS, wait_dns, wait_namespace_absent

pytestmark = [pytest.mark.realk8s, pytest.mark.root]  # unshare: the launcher pod's mounts

OVERLAY = Path(__file__).resolve().parents[2] / "manifests" / "overlays" / "sidecar"
HOOKS = "/var/run/kubevirt-hooks"
SA_DIR = "secrets/kubernetes.io/serviceaccount"  # under /var/run, which is /run
FINALIZER = "kubevirt.io/foregroundDeleteVirtualMachine"
IMEX_IPS = {0: "10.60.0.10", 1: "10.60.0.11"}
#: as the pod would: its own /run (so /var/run/secrets and /var/run/kubevirt-hooks are
#: the pod's), its own hostname, then the annotation's command, exec'd
POD_SHELL = 'mount --bind "$1" /run && hostname "$2" && shift 2 && exec "$@"'


@pytest.fixture(scope="module")
def kubevirt_crds(control_plane: ControlPlane) -> None:
    openapi = json.loads(kubevirt_openapi().read_text())
    control_plane.apply_crd(pool_crd(openapi))
    control_plane.apply_crd(network_attachment_definition_crd())


def hook_call(socket: Path, method: str, request: str, response: str) -> Any:
    """One unary call on the hook socket, as virt-launcher makes it (1 s deadline)."""
    raw = message(request)().SerializeToString()
    with grpc.insecure_channel(f"unix:{socket}") as channel:
        answer: bytes = channel.unary_unary(method)(raw, timeout=1.0)
    return message(response).FromString(answer)


class Pod:
    """One virt-launcher pod's worth of the sidecar: its /run, its process."""

    def __init__(self, cp: ControlPlane, vmi: str, namespace: str, token: str,
                 command: list[str], logs: Path) -> None:
        self.vmi = vmi
        self.root = Path(tempfile.mkdtemp(prefix="rk8s-pod-", dir="/tmp"))  # short: socket
        run = self.root / "run"
        account = run / SA_DIR
        account.mkdir(parents=True)
        (account / "token").write_text(token)
        (account / "namespace").write_text(namespace)
        shutil.copy(cp.ca, account / "ca.crt")
        (run / "kubevirt-hooks").mkdir()
        self.socket = run / "kubevirt-hooks" / "imex-host-agent.sock"
        self.port = free_port()
        assert command[:2] == ["/bin/sh", "-c"] and len(command) == 3
        script = command[2]
        assert script.count("--listen 127.0.0.1:8080") == 1
        script = script.replace("--listen 127.0.0.1:8080", f"--listen 127.0.0.1:{self.port}")
        host, _, port = cp.server.removeprefix("https://").rpartition(":")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("IMEX_", "KUBECONFIG", "POD_"))}
        env.update(KUBERNETES_SERVICE_HOST=host, KUBERNETES_SERVICE_PORT=port,
                   PATH=f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}")
        log = logs / f"sidecar-{vmi}.log"
        with log.open("wb") as out:
            popen = subprocess.Popen(
                ["unshare", "--mount", "--uts", "--propagation", "private", "--",
                 "/bin/sh", "-c", POD_SHELL, "pod", str(run), vmi, "/bin/sh", "-c", script],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, env=env,
                start_new_session=True, preexec_fn=_die_with_parent)
        self.proc = Proc(f"sidecar-{vmi}", popen, log)
        self.url = f"http://127.0.0.1:{self.port}"

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.url}/readyz", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    def close(self) -> None:
        self.proc.stop()
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def rendered(control_plane: ControlPlane) -> Iterator[list[dict[str, Any]]]:
    text = control_plane.kubectl("kustomize", str(OVERLAY)).stdout
    objs = [o for o in yaml.safe_load_all(text) if o]
    assert not [o for o in objs if o["kind"] == "Namespace"]  # the namespace is the user's
    ns = next(o for o in objs if o["kind"] == "VirtualMachinePool")["metadata"]["namespace"]
    admin = control_plane.admin
    assert admin is not None
    wait_namespace_absent(admin, ns)  # the namespaced overlay's test uses it too
    control_plane.kubectl("create", "namespace", ns)  # as the README says: create it first
    try:
        yield objs
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")


def test_the_sidecar_overlay_as_shipped(control_plane: ControlPlane, kubevirt_crds: None,
                                        rendered: list[dict[str, Any]],
                                        tmp_path: Path) -> None:
    admin = control_plane.admin
    assert admin is not None
    mark = control_plane.audit_mark()
    # as a user applies it: the rendered overlay, every object, one kubectl apply
    applied = control_plane.kubectl("apply", "-f", "-", stdin=yaml.safe_dump_all(rendered))
    assert applied.stdout.count("created") == len(rendered), applied.stdout
    pool = next(o for o in rendered if o["kind"] == "VirtualMachinePool")
    svc = next(o for o in rendered if o["kind"] == "Service")
    ns, name = pool["metadata"]["namespace"], pool["metadata"]["name"]
    ens = EnsembleId(ns, svc["metadata"]["name"])
    template = admin.get(f"/apis/pool.kubevirt.io/v1beta1/namespaces/{ns}/"
                         f"virtualmachinepools/{name}")["spec"]["virtualMachineTemplate"][
                             "spec"]["template"]
    (sidecar,) = json.loads(template["metadata"]["annotations"]["hooks.kubevirt.io/hookSidecars"])
    (account,) = [v["serviceAccount"]["serviceAccountName"]
                  for v in template["spec"]["volumes"] if "serviceAccount" in v]
    user = f"system:serviceaccount:{ns}:{account}"

    # the pool controller: the VMIs, spec only, with KubeVirt's finalizer
    for i in IMEX_IPS:
        body = {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
                "metadata": {"name": f"{name}-{i}", "namespace": ns,
                             "labels": template["metadata"]["labels"],
                             "annotations": template["metadata"]["annotations"],
                             "finalizers": [FINALIZER]},
                "spec": copy.deepcopy(template["spec"])}
        admin.create(VMIS.format(ns=ns), body)

    pods: dict[int, Pod] = {}
    try:
        for i in IMEX_IPS:
            token = control_plane.service_account_token(ns, account)
            pods[i] = Pod(control_plane, f"{name}-{i}", ns, token, sidecar["command"],
                          tmp_path)
        for i, pod in pods.items():
            # virt-launcher: Info must answer before the VM starts
            wait_until(pod.socket.exists, f"{pod.vmi}'s hook socket", 60, pod.proc.tail)
            info = hook_call(pod.socket, "/kubevirt.hooks.info.Info/Info",
                             "kubevirt.hooks.info.InfoParams", "kubevirt.hooks.info.InfoResult")
            assert info.name == "imex-host-agent" and "v1alpha3" in info.versions
            assert [p.name for p in info.hookPoints] == ["Shutdown"]
            wait_until(pod.ready, f"{pod.vmi} ready", 60, pod.proc.tail)
            # virt-handler: the VM runs, the guest agent reports its addresses
            vmi = admin.get(f"{VMIS.format(ns=ns)}/{pod.vmi}")
            vmi["status"] = {
                "phase": "Running", "nodeName": f"gpu-node-{i}",
                "conditions": [{"type": "Ready", "status": "True"}],
                "interfaces": [
                    {"name": "default", "ipAddress": f"10.244.{i}.5",
                     "ipAddresses": [f"10.244.{i}.5"], "infoSource": "domain, guest-agent"},
                    {"name": "imex", "ipAddress": IMEX_IPS[i], "ipAddresses": [IMEX_IPS[i]],
                     "infoSource": "domain, guest-agent"}]}
            admin.ok("PUT", f"{VMIS.format(ns=ns)}/{pod.vmi}/status", vmi)

        def slices() -> dict[str, list[tuple[str, list[str]]]]:
            return {s["metadata"]["name"]: [(e["hostname"], e["addresses"])
                                            for e in s.get("endpoints") or []]
                    for s in admin.get(SLICES.format(ns=ns))["items"]}

        want = {f"{ens.name}-imex-vmi-{name}-{i}": [(ens.slot(i), [ip])]
                for i, ip in IMEX_IPS.items()}
        wait_until(lambda: slices() == want, f"per-VMI slices {want}", 60,
                   lambda: f"; last: {slices()}")
        dns_port = control_plane.dns_port
        for i, ip in IMEX_IPS.items():
            wait_dns(dns_port, ens.slot_fqdn(i) + ".", "A", {ip})
        wait_dns(dns_port, ens.srv_name() + ".", "SRV",
                 {f"0 50 50000 {ens.slot_fqdn(i)}." for i in IMEX_IPS})
        wait_dns(dns_port, ens.service_fqdn() + ".", "A", set(IMEX_IPS.values()))

        # a VMI deleted: it waits for its finalizer (the launcher is still shutting the
        # VM down), and its sidecar takes its slice away meanwhile
        gone = pods[1]
        admin.delete(f"{VMIS.format(ns=ns)}/{gone.vmi}")
        del want[f"{ens.name}-imex-vmi-{gone.vmi}"]
        wait_until(lambda: slices() == want, "the deleted VMI's slice removed", 30,
                   lambda: f"; last: {slices()}")
        terminating = admin.get(f"{VMIS.format(ns=ns)}/{gone.vmi}")
        assert terminating["metadata"].get("deletionTimestamp")
        wait_dns(dns_port, ens.slot_fqdn(1) + ".", "A", set())
        # virt-launcher is done with the VM: Shutdown, and the sidecar stops by itself
        hook_call(gone.socket, "/kubevirt.hooks.v1alpha3.Callbacks/Shutdown",
                  "kubevirt.hooks.v1alpha3.ShutdownParams",
                  "kubevirt.hooks.v1alpha3.ShutdownResult")
        assert gone.proc.popen.wait(timeout=30) == 0, gone.proc.tail()
        assert not gone.socket.exists()
        admin.ok("PATCH", f"{VMIS.format(ns=ns)}/{gone.vmi}",
                 {"metadata": {"finalizers": None}},
                 content_type="application/merge-patch+json")
        assert slices() == want and pods[0].proc.alive()
    finally:
        for pod in pods.values():
            pod.close()

    denied = [(e["verb"], e["requestURI"]) for e in control_plane.audit_events(user, mark)
              if e.get("stage") == "ResponseComplete"
              and e.get("responseStatus", {}).get("code") == 403]
    assert not denied, f"the sidecar overlay's Role lacks rights: {denied}"
    used = {(e["verb"], e["objectRef"]["resource"]) for e in
            control_plane.audit_events(user, mark) if "objectRef" in e}
    assert ("create", "selfsubjectaccessreviews") in used  # its start-up checks ran
    assert ("delete", "endpointslices") in used
