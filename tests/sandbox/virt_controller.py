"""A scripted virt-controller: does through the API double what KubeVirt would.

TEST STAND-IN, never product code. It talks to the API double with the real lightkube
client (spec through the main endpoint, status through ``/status`` as virt-controller and
virt-handler write it) and asks the :class:`~tests.sandbox.ensemble.Sandbox` to power
namespace VMs on and off, as virt-handler starts domains:

* :meth:`VirtController.create_ensemble`: the namespace and the ensemble Service
  (headless, selector-less, label ``imex-ensemble.io/ensemble=<name>``, annotations
  max-members, port and token-sha256; DESIGN.md "Names"), or an ImexEnsemble with the
  same settings (``form="cr"``), as an operator would declare either.
* :class:`Pool` (a VirtualMachinePool's VMIs, named ``<pool>-<i>``, lowest free index):
  ``scale(n)``; each new VMI goes Pending -> Scheduled (``nodeName``) -> the VM boots ->
  Running with ``status.interfaces[0].ipAddress`` and a Ready condition.
* ``crash(i)``: every process of the VM is killed, the VMI turns Failed (Ready False);
  ``restore(i)``: the pool deletes the VMI and creates it again; the new VM gets a new IP.
* ``migrate(i)``: ``migrationState`` (source/target node) while the VM moves, then the new
  node and a new IP, ``migrationState.completed``.

Ordering: a VMI's status is written only after the VM's side has happened (the VM is
booted before Running is reported, killed before Failed), as KubeVirt reports what it
observed.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from lightkube import Client, KubeConfig
from lightkube.core.exceptions import ApiError
from lightkube.generic_resource import create_global_resource, create_namespaced_resource
from lightkube.types import PatchType

from tests.sandbox.ensemble import EnsembleSpec, Sandbox

VMI = create_namespaced_resource("kubevirt.io", "v1", "VirtualMachineInstance",
                                 "virtualmachineinstances")
Service = create_namespaced_resource("", "v1", "Service", "services")
Namespace = create_global_resource("", "v1", "Namespace", "namespaces")
ImexEnsemble = create_namespaced_resource("imex-ensemble.io", "v1alpha1", "ImexEnsemble",
                                          "imexensembles")
EventV1 = create_namespaced_resource("events.k8s.io", "v1", "Event", "events")

LABEL = "imex-ensemble.io/ensemble"
NODES = tuple(f"gb200-tray-{i:02d}" for i in range(24))


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def service_manifest(spec: EnsembleSpec) -> dict[str, Any]:
    """The ensemble Service (DESIGN.md "Names")."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": spec.name,
            "namespace": spec.namespace,
            "labels": {LABEL: spec.name},
            "annotations": {
                "imex-ensemble.io/max-members": str(spec.max_members),
                "imex-ensemble.io/port": str(spec.port),
                "imex-ensemble.io/token-sha256": spec.token_sha256,
                **({"imex-ensemble.io/auth-encryption": "true"} if spec.auth_encryption
                   else {}),
            },
        },
        "spec": {
            "clusterIP": "None",
            "ports": [{"name": "imex", "port": spec.port, "protocol": "TCP"}],
        },
    }


def ensemble_manifest(spec: EnsembleSpec) -> dict[str, Any]:
    """The same ensemble as an ImexEnsemble (issue 15)."""
    return {
        "apiVersion": "imex-ensemble.io/v1alpha1",
        "kind": "ImexEnsemble",
        "metadata": {"name": spec.name, "namespace": spec.namespace},
        "spec": {"maxMembers": spec.max_members, "port": spec.port,
                 "tokenSHA256": spec.token_sha256, "authEncryption": spec.auth_encryption},
    }


def vmi_manifest(spec: EnsembleSpec, name: str, pool: str) -> dict[str, Any]:
    """A pool member's VMI as the pool would create it (bridge binding on the pod network)."""
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {
            "name": name,
            "namespace": spec.namespace,
            "labels": {LABEL: spec.name, "kubevirt.io/vmpool": pool},
        },
        "spec": {
            "domain": {
                "devices": {"interfaces": [{"name": "default", "bridge": {}}]},
                "resources": {"requests": {"memory": "1Gi"}},
            },
            "networks": [{"name": "default", "pod": {}}],
            "hostname": name,
        },
    }


def running_status(ip: str, node: str, mac: str) -> dict[str, Any]:
    return {
        "phase": "Running",
        "nodeName": node,
        "conditions": [{"type": "Ready", "status": "True", "lastProbeTime": None,
                        "lastTransitionTime": _now()}],
        "interfaces": [{"name": "default", "ipAddress": ip, "ipAddresses": [ip], "mac": mac,
                        "infoSource": "domain, guest-agent", "podInterfaceName": "eth0"}],
    }


@dataclass
class Member:
    """What the controller remembers of one VMI."""

    name: str
    index: int
    node: str
    mac: str


class VirtController:
    """The scripted controller; one per sandbox (see the module docstring)."""

    def __init__(self, sandbox: Sandbox) -> None:
        self.sandbox = sandbox
        self.client = Client(KubeConfig.from_file(sandbox.kubeconfig), trust_env=False,
                             field_manager="virt-controller")
        self._next_node = 0

    def ensure_namespace(self, name: str) -> None:
        try:
            self.client.create(Namespace.from_dict({
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}))
        except ApiError as e:
            if e.status.code != 409:
                raise

    def close(self) -> None:
        self.client.close()

    def pick_node(self, avoid: str | None = None) -> str:
        while True:
            node = NODES[self._next_node % len(NODES)]
            self._next_node += 1
            if node != avoid:
                return node

    def create_ensemble(self, namespace: str, name: str, max_members: int = 18,
                        token: str | None = None, auth_encryption: bool = False,
                        form: str = "service") -> EnsembleSpec:
        """The ensemble as an operator declares it: a hand-made Service (``form="service"``)
        or an ImexEnsemble (``form="cr"``), whose Service the host agent then creates."""
        spec = EnsembleSpec(namespace, name, max_members, auth_encryption=auth_encryption) \
            if token is None else EnsembleSpec(namespace, name, max_members, token=token,
                                               auth_encryption=auth_encryption)
        self.ensure_namespace(namespace)
        if form == "cr":
            self.client.create(ImexEnsemble.from_dict(ensemble_manifest(spec)))
        else:
            self.client.create(Service.from_dict(service_manifest(spec)))
        return spec

    def get_ensemble(self, spec: EnsembleSpec) -> dict[str, Any]:
        """The ImexEnsemble as the API serves it (status included)."""
        obj = self.client.get(ImexEnsemble, spec.name, namespace=spec.namespace)
        return dict(obj.to_dict())  # type: ignore[no-untyped-call]

    def events(self, spec: EnsembleSpec, kind: str = "ImexEnsemble") -> list[dict[str, Any]]:
        """events.k8s.io/v1 Events regarding the ensemble's CR (or its Service), by time."""
        got = [dict(e.to_dict()) for e in self.client.list(  # type: ignore[no-untyped-call]
            EventV1, namespace=spec.namespace)]
        return sorted((e for e in got if e["regarding"]["kind"] == kind
                       and e["regarding"]["name"] == spec.name),
                      key=lambda e: str(e.get("eventTime")))

    def pool(self, spec: EnsembleSpec, name: str | None = None) -> Pool:
        return Pool(self, spec, name or spec.name)

    # ---- VMI writes
    def set_status(self, spec: EnsembleSpec, name: str, status: dict[str, Any]) -> None:
        self.client.patch(VMI.Status, name, {"status": status}, namespace=spec.namespace,
                          patch_type=PatchType.MERGE)

    def get_vmi(self, spec: EnsembleSpec, name: str) -> dict[str, Any]:
        obj = self.client.get(VMI, name, namespace=spec.namespace)
        return dict(obj.to_dict())  # type: ignore[no-untyped-call]


class Pool:
    """A VirtualMachinePool's VMIs ``<pool>-<i>`` and the VMs behind them."""

    def __init__(self, ctl: VirtController, spec: EnsembleSpec, name: str) -> None:
        self.ctl = ctl
        self.spec = spec
        self.name = name
        self.members: dict[int, Member] = {}

    def vmi_name(self, index: int) -> str:
        return f"{self.name}-{index}"

    def scale(self, replicas: int) -> None:
        """Create the lowest free indexes up to ``replicas``; delete the highest above it."""
        while len(self.members) > replicas:
            self.delete(max(self.members))
        free = (i for i in range(10_000) if i not in self.members)
        todo = [next(free) for _ in range(replicas - len(self.members))]
        # As a pool burst goes: every VMI is created and scheduled first, then the VMs boot
        # (the CPU-heavy part, all at once), then each reports Running with its IP.
        members = [self._schedule(i) for i in todo]
        for m in members:
            self.ctl.sandbox.vm(self.spec, m.name).start()
        for m in members:
            self._running(m)

    def create(self, index: int, node: str | None = None) -> Member:
        """A new VMI for ``index``: Pending -> Scheduled -> (VM boots) -> Running."""
        member = self._schedule(index, node)
        self.ctl.sandbox.vm(self.spec, member.name).start()
        self._running(member)
        return member

    def _schedule(self, index: int, node: str | None = None) -> Member:
        name = self.vmi_name(index)
        c = self.ctl
        c.client.create(VMI.from_dict(vmi_manifest(self.spec, name, self.name)))
        c.set_status(self.spec, name, {"phase": "Pending"})
        member = Member(name, index, node or c.pick_node(),
                        "02:" + ":".join(f"{b:02x}" for b in uuid.uuid4().bytes[:5]))
        c.set_status(self.spec, name, {"phase": "Scheduled", "nodeName": member.node})
        c.sandbox.create_vm(self.spec, name)
        self.members[index] = member
        return member

    def _running(self, member: Member) -> None:
        vm = self.ctl.sandbox.vm(self.spec, member.name)
        self.ctl.set_status(self.spec, member.name,
                            running_status(vm.ip, member.node, member.mac))

    def delete(self, index: int) -> None:
        """Scale-down: the VM shuts down and its VMI is deleted."""
        member = self.members.pop(index)
        self.ctl.sandbox.destroy_vm(self.spec, member.name)
        self.ctl.client.delete(VMI, member.name, namespace=self.spec.namespace)

    def crash(self, index: int) -> None:
        """The VM dies (every process killed); the VMI turns Failed."""
        member = self.members[index]
        self.ctl.sandbox.vm(self.spec, member.name).kill()
        self.ctl.set_status(self.spec, member.name, {
            "phase": "Failed", "reason": "Crashed",
            "conditions": [{"type": "Ready", "status": "False", "lastProbeTime": None,
                            "lastTransitionTime": _now(), "reason": "GuestCrashed"}]})

    def restore(self, index: int) -> Member:
        """The pool replaces a failed VMI: delete it, create it again (new pod, new IP)."""
        member = self.members.pop(index)
        self.ctl.client.delete(VMI, member.name, namespace=self.spec.namespace)
        return self.create(index, self.ctl.pick_node(avoid=member.node))

    def migrate(self, index: int) -> str:
        """Live-migrate: migrationState while moving, then a new node and a new IP."""
        member = self.members[index]
        c = self.ctl
        target = c.pick_node(avoid=member.node)
        mig_uid = str(uuid.uuid4())
        c.set_status(self.spec, member.name, {"migrationState": {
            "migrationUid": mig_uid, "sourceNode": member.node, "targetNode": target,
            "startTimestamp": _now(), "mode": "PreCopy"}})
        vm = c.sandbox.vm(self.spec, member.name)
        new_ip = vm.node.set_address()
        status = running_status(new_ip, target, member.mac)
        status["migrationState"] = {
            "migrationUid": mig_uid, "sourceNode": member.node, "targetNode": target,
            "startTimestamp": _now(), "endTimestamp": _now(), "completed": True,
            "mode": "PreCopy"}
        c.set_status(self.spec, member.name, status)
        member.node = target
        return new_ip
