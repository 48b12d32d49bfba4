"""The VMs of the peers benchmark and the four ways they are run: recipe, ours, DNS-only, floor.

TEST HARNESS, never product code. One :class:`Fleet` of network-namespace "VMs"
(``vm-<i>``, hostname ``vm-<i>``, on the cluster's fabric) serves every side in turn; a
side (:class:`Side`) says what the API holds for a slot and what runs inside its VM:

* :class:`RecipeSide`, the manual recipe (FACTS.md "The manual recipe, precisely"): one
  virt-launcher stand-in Pod per VM (``hostname: vm-<i>``, ``subdomain: imex``),
  created through the API with its status written as kubelet writes it (strategic merge
  patch of ``status``: podIP, phase Running, Ready), a headless Service with a selector,
  kube-controller-manager's EndpointSlice controller publishing them, CoreDNS answering.
  In each VM only the IMEX stand-in, nodes file ``vm-<j>.imex.recipe.svc.cluster.local``,
  resolving through the system resolver with what KubeVirt's DHCP hands a guest: the
  nameserver and the pod's search list, no ``ndots`` (glibc's default, 1). No agent.
  IMEX finds its own node by resolving its own name, so a recipe VM's IMEX is started the
  moment CoreDNS answers its own name (:mod:`tests.bench.peers.recipe_boot`, inside the
  VM, asks every 50 ms): a real guest boots long after its pod is Ready, so this is the
  recipe's best case.
* :class:`OursSide`: VMIs (created, then ``status`` merge-patched as KubeVirt writes it),
  the ensemble Service, the real host agent, and in each VM the real guest agent (from a
  venv holding only the guest extra, production settings) with the IMEX stand-in as its
  child; ``registry=False`` is the DNS-only guest (no ``registry_url``).
* :class:`FloorSide`: the same VMIs and host agent, and in each VM the floor probe
  (:mod:`tests.bench.peers.floor_probe`) instead of the agents.

Every status write and deletion carries a unique ``User-Agent``, so its moment of arrival
at the apiserver is read from the audit log (:meth:`Cluster.received_at`).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from imex_shared.model import EnsembleId
from tests.bench.peers.cluster import Cluster
from tests.bench.peers.measure import Attempt, events_since, parse_attempts
from tests.bench.peers.resolved import (
    Resolved,
    resolved_argv,
    resolved_conf,
    stub_resolv_conf,
)
from tests.realk8s.fixtures import ENSEMBLE_LABEL, INDEX_LABEL
from tests.sandbox.ctl_build import standin_ctl, standin_daemon
from tests.sandbox.imex_standin import write_standin_files
from tests.sandbox.netns import DEFAULT_HOSTS, NetnsError, Node, netns_pids
from tests.sandbox.netns import ip as ip_cmd

log = logging.getLogger("bench.peers")

REPO_ROOT = Path(__file__).resolve().parents[3]
STANDIN_CTL = str(REPO_ROOT / "tests" / "sandbox" / "bin" / "nvidia-imex-ctl")
FLOOR_PROBE = str(Path(__file__).with_name("floor_probe.py"))
RECIPE_BOOT = str(Path(__file__).with_name("recipe_boot.py"))
SERVICE = "imex"
ZONE = "cluster.local"
PORT = 50000
PR_SET_PDEATHSIG = 1


def _pdeathsig() -> None:
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{pp}" if pp else str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1", "NO_PROXY": "*", "no_proxy": "*"}


def now_rfc3339() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def search_list(namespace: str) -> list[str]:
    """The search list kubelet writes into a pod's resolv.conf (and KubeVirt's DHCP hands
    the guest). Assumption: the node has no search domains of its own to append."""
    return [f"{namespace}.svc.{ZONE}", f"svc.{ZONE}", ZONE]


@dataclass
class Slot:
    """One VM slot: its namespace stays, its address and processes change per boot."""

    index: int
    node: Node
    boots: int = 0
    dir: Path = Path("/nonexistent")
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    #: the IMEX attempt log of the current boot (None for sides without IMEX)
    attempt_log: Path | None = None
    state_file: Path | None = None
    imex_cfg: Path | None = None
    _read: int = 0
    _attempts: list[Attempt] = field(default_factory=list)

    @property
    def name(self) -> str:
        return f"vm-{self.index}"

    @property
    def ip(self) -> str:
        return self.node.ip

    def attempts(self) -> list[Attempt]:
        """This boot's attempt log so far (read incrementally)."""
        if self.attempt_log is None:
            return []
        try:
            with open(self.attempt_log, "rb") as f:
                f.seek(self._read)
                data = f.read()
        except FileNotFoundError:
            return self._attempts
        end = data.rfind(b"\n") + 1
        if end:
            self._read += end
            self._attempts += parse_attempts(data[:end].decode())
        return self._attempts

    def attempts_since(self, t: float) -> list[Attempt]:
        """This boot's events that started or ended at wall time ``t`` or later."""
        return events_since(self.attempts(), t)

    def imex_state(self) -> dict[str, Any]:
        if self.state_file is None:
            return {}
        try:
            doc = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def new_boot(self, base: Path) -> None:
        self.boots += 1
        self.dir = base / f"{self.name}.{self.boots}"
        self.dir.mkdir(parents=True, exist_ok=True)
        self.attempt_log = self.state_file = self.imex_cfg = None
        self._read = 0
        self._attempts = []


class Fleet:
    """``n`` namespace VMs on the cluster's fabric, reused by every side."""

    def __init__(self, cluster: Cluster, n: int, workdir: Path) -> None:
        assert cluster.fabric is not None
        self.cluster = cluster
        self.fabric = cluster.fabric
        self.workdir = workdir
        self.slots = [Slot(i, self.fabric.add_node(f"vm{i}", hostname=f"vm-{i}"))
                      for i in range(n)]
        for s in self.slots:
            s.node.set_link(False)

    def __len__(self) -> int:
        return len(self.slots)

    def kill(self, slot: Slot, sig: int = signal.SIGTERM, wait: float = 5.0) -> None:
        """Stop every process in the slot's namespace (``sig``, then SIGKILL)."""
        for s in (sig, signal.SIGKILL):
            pids = netns_pids(slot.node.name)
            if not pids:
                break
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, s)
            deadline = time.monotonic() + wait
            while netns_pids(slot.node.name) and time.monotonic() < deadline:
                time.sleep(0.02)
        for p in slot.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(1)
        slot.procs.clear()

    def new_address(self, slot: Slot) -> str:
        """The slot's VM comes back with a fresh address (the old one is gone already)."""
        new = self.fabric.allocate()
        slot.node.add_address(new)
        slot.node.ip = new
        return new

    def drop_address(self, slot: Slot) -> None:
        with contextlib.suppress(NetnsError):
            slot.node.del_address(slot.ip)

    def popen(self, slot: Slot, argv: list[str], log_name: str) -> subprocess.Popen[bytes]:
        with open(slot.dir / log_name, "ab") as out:
            p: subprocess.Popen[bytes] = subprocess.Popen(
                slot.node.argv(argv), stdout=out, stderr=subprocess.STDOUT, env=child_env(),
                cwd=REPO_ROOT, preexec_fn=_pdeathsig)
        slot.procs.append(p)
        slot.node.procs.append(p)
        return p

    def close(self) -> None:
        for s in self.slots:
            with contextlib.suppress(Exception):
                self.kill(s, signal.SIGKILL, 1)


class Side:
    """What one side does for a slot; the scenarios call these in the same order for all."""

    name = "side"
    namespace = ""
    has_imex = True
    watches_hosts = False

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.cluster = fleet.cluster
        self.workdir = fleet.workdir / self.name
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._seq = 0

    # -- helpers
    def tag(self, what: str, slot: Slot) -> str:
        """A unique User-Agent for one API write (found again in the audit log)."""
        self._seq += 1
        return f"bench-peers/{self.name}/{what}/{slot.name}/{self._seq}/{secrets.token_hex(3)}"

    def node_name(self, slot: Slot, other: bool = False) -> str:
        return f"gb200-tray-{slot.index + (len(self.fleet) if other else 0):02d}"

    def setup(self) -> None:
        self.cluster.ensure_namespace(self.namespace)
        self.cluster.ensure_nodes([f"gb200-tray-{i:02d}" for i in range(2 * len(self.fleet))])

    #: collections this side creates, force-deleted at teardown (no kubelet confirms a
    #: graceful pod deletion here, so the namespace controller would wait for ever)
    collections: tuple[str, ...] = ()

    def teardown(self) -> None:
        for s in self.fleet.slots:
            self.power_off(s)
        for path in self.collections:
            self.cluster.api.request("DELETE", path.format(ns=self.namespace),
                                     params={"gracePeriodSeconds": "0"})
        self.cluster.delete_namespace(self.namespace)

    def wait_booted(self, slot: Slot, timeout: float = 180) -> None:
        """Until the slot's guest side is up and waiting for its publication."""

    # -- per slot, overridden
    def create(self, slot: Slot) -> None:
        raise NotImplementedError

    def write_running(self, slot: Slot) -> str:
        raise NotImplementedError

    def delete(self, slot: Slot) -> str:
        raise NotImplementedError

    def boot(self, slot: Slot) -> None:
        raise NotImplementedError

    def power_off(self, slot: Slot, crash: bool = False) -> None:
        """The VM goes: clean shutdown (peers see their connections close) or, ``crash``,
        silent (its link goes down first, so peers only notice by timeouts)."""
        if crash:
            slot.node.set_link(False)
        self.fleet.kill(slot, signal.SIGKILL if crash else signal.SIGTERM)
        self.fleet.drop_address(slot)
        slot.node.set_link(False)

    def fresh_vm(self, slot: Slot) -> str:
        """A new VM in the slot: new boot directory, new address, fresh /etc files."""
        slot.new_boot(self.workdir)
        if slot.ip in slot.node.addresses():
            self.fleet.drop_address(slot)
        ip = self.fleet.new_address(slot)
        slot.node.write_hosts(DEFAULT_HOSTS)
        slot.node.write_resolv(self.resolv_conf())
        slot.node.set_link(True)
        # the old address took the default route with it (KubeVirt's DHCP gives one)
        gw = self.fleet.fabric.gateway_ip
        if gw:
            ip_cmd("route", "replace", "default", "via", gw, netns=slot.node.name)
        return ip

    def resolv_conf(self) -> str:
        return (f"nameserver {self.cluster.dns_ip}\n"
                f"search {' '.join(search_list(self.namespace))}\n")

    def dns_name(self, slot: Slot) -> str:
        """The name CoreDNS answers with the slot's address (for the propagation time)."""
        raise NotImplementedError

    def domain_up(self, slot: Slot, members: list[int]) -> bool:
        """The slot's IMEX is READY with every other listed member CONNECTED."""
        st = slot.imex_state()
        if st.get("state") != "READY":
            return False
        peers = st.get("peers") or {}
        return all((peers.get(str(j)) or {}).get("status") == "CONNECTED"
                   for j in members if j != slot.index)

    def ctl_domain_state(self, slot: Slot) -> str | None:
        """``nvidia-imex-ctl -N`` in the VM: its ``Domain State:`` value."""
        if slot.imex_cfg is None:
            return None
        out = slot.node.run([STANDIN_CTL, "-c", str(slot.imex_cfg), "-N"], check=False,
                            timeout=30, env=child_env(), cwd=REPO_ROOT)
        for line in out.stdout.splitlines():
            if line.startswith("Domain State:"):
                return line.split(":", 1)[1].strip()
        return None

    def counters(self, slot: Slot) -> tuple[int, int]:
        """(IMEX restarts, SIGUSR1 received) of the slot's current boot."""
        st = slot.imex_state()
        return max(0, int(st.get("starts", 1)) - 1), int(st.get("signals_received", 0))


# ----------------------------------------------------------------------------- recipe


class RecipeSide(Side):
    name = "recipe"
    namespace = "recipe"
    has_imex = True
    collections = ("/api/v1/namespaces/{ns}/pods",)

    def __init__(self, fleet: Fleet, resolved: Resolved | None = None) -> None:
        if resolved is not None:
            self.name = "recipe-resolved"
        super().__init__(fleet)
        self.resolved = resolved
        self.pods: dict[int, str] = {}

    def fqdn(self, index: int) -> str:
        return f"vm-{index}.{SERVICE}.{self.namespace}.svc.{ZONE}"

    def dns_name(self, slot: Slot) -> str:
        return self.fqdn(slot.index)

    def setup(self) -> None:
        super().setup()
        self.cluster.api.apply(f"/api/v1/namespaces/{self.namespace}/services/{SERVICE}", {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": SERVICE, "namespace": self.namespace},
            "spec": {"clusterIP": "None", "selector": {"imex-recipe": "member"},
                     "ports": [{"name": "imex", "port": PORT, "protocol": "TCP"}]}})

    def resolv_conf(self) -> str:
        if self.resolved is not None:
            return stub_resolv_conf(search_list(self.namespace))
        return super().resolv_conf()

    def create(self, slot: Slot) -> None:
        self.pods[slot.index] = self.create_pod(slot, self.node_name(slot))

    def create_pod(self, slot: Slot, node_name: str) -> str:
        """A virt-launcher stand-in pod for the slot's VM (hostname/subdomain as KubeVirt
        copies them from the VMI); returns its name."""
        name = f"virt-launcher-vm-{slot.index}-{secrets.token_hex(3)}"
        self.cluster.api.create(f"/api/v1/namespaces/{self.namespace}/pods", {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {"name": name, "namespace": self.namespace,
                         "labels": {"imex-recipe": "member", "kubevirt.io": "virt-launcher",
                                    "vm.kubevirt.io/name": slot.name}},
            "spec": {"hostname": slot.name, "subdomain": SERVICE, "nodeName": node_name,
                     "automountServiceAccountToken": False,
                     "containers": [{"name": "compute",
                                     "image": "example.invalid/virt-launcher:1"}]}})
        return name

    def write_running(self, slot: Slot, *, ip: str | None = None, pod: str | None = None
                      ) -> str:
        """As kubelet reports a started, ready pod: one strategic merge patch of status."""
        ua = self.tag("running", slot)
        ip = ip or slot.ip
        ts = now_rfc3339()
        conds = [{"type": t, "status": "True", "lastTransitionTime": ts}
                 for t in ("PodReadyToStartContainers", "Initialized", "ContainersReady",
                           "Ready", "PodScheduled")]
        body = {"status": {
            "phase": "Running", "podIP": ip, "podIPs": [{"ip": ip}], "startTime": ts,
            "conditions": conds,
            "containerStatuses": [{"name": "compute", "ready": True, "started": True,
                                   "restartCount": 0, "image": "example.invalid/virt-launcher:1",
                                   "imageID": "", "state": {"running": {"startedAt": ts}}}]}}
        self._send("PATCH", f"pods/{pod or self.pods[slot.index]}/status", body, ua,
                   "application/strategic-merge-patch+json")
        return ua

    def delete(self, slot: Slot, *, pod: str | None = None) -> str:
        ua = self.tag("delete", slot)
        name = pod or self.pods.pop(slot.index)
        self._send("DELETE", f"pods/{name}", {"gracePeriodSeconds": 0}, ua)
        return ua

    def _send(self, method: str, path: str, body: Any, ua: str,
              content_type: str = "application/json") -> None:
        api = self.cluster.api
        resp = api.client.request(method, f"/api/v1/namespaces/{self.namespace}/{path}",
                                  content=json.dumps(body),
                                  headers={"Content-Type": content_type, "User-Agent": ua})
        if resp.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")

    def boot(self, slot: Slot) -> None:
        entries = [self.fqdn(j) for j in range(len(self.fleet))]
        slot.imex_cfg = write_standin_files(slot.dir / "imex", entries, server_port=PORT)
        slot.state_file = slot.dir / "imex" / "state.json"
        slot.attempt_log = slot.dir / "imex" / "attempts.jsonl"
        if self.resolved is not None:
            conf = slot.dir / "resolved"
            conf.mkdir(exist_ok=True)
            (conf / "resolved.conf").write_text(resolved_conf(self.cluster.dns_ip,
                                                              search_list(self.namespace)))
            self.fleet.popen(slot, resolved_argv(self.resolved, conf), "resolved.log")
        self.start_imex(slot, wait_for_name=True)

    def imex_argv(self, slot: Slot) -> list[str]:
        assert slot.imex_cfg is not None and slot.state_file is not None
        # the native stand-in on every side (issue 27): what each side's IMEX costs must
        # be a small daemon's, not an interpreter's, or it is the stand-ins that race
        return [str(standin_daemon()), "-c", str(slot.imex_cfg), "--state-file",
                str(slot.state_file),
                "--attempt-log", str(slot.attempt_log)]

    def start_imex(self, slot: Slot, wait_for_name: bool = False) -> None:
        """Start the slot's IMEX; ``wait_for_name``: through :mod:`recipe_boot`, inside the
        VM, the moment CoreDNS answers the VM's own name with its address."""
        mark = slot.dir / "imex-started"
        argv = self.imex_argv(slot)
        if wait_for_name:
            argv = [sys.executable, RECIPE_BOOT, self.cluster.dns_ip, self.fqdn(slot.index),
                    slot.ip, str(mark), "--", *argv]
        else:
            with open(mark, "a") as f:
                f.write(f"{time.time()}\n")
        self.fleet.popen(slot, argv, "imex.out")

    @staticmethod
    def spawned_at(slot: Slot) -> float | None:
        """When this boot's IMEX was started (the last start; None before)."""
        try:
            lines = (slot.dir / "imex-started").read_text().split()
        except FileNotFoundError:
            return None
        return float(lines[-1]) if lines else None


# ----------------------------------------------------------------------------- ours


class OursSide(Side):
    namespace = "ours"
    watches_hosts = True
    collections = ("/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances",)

    def __init__(self, fleet: Fleet, *, registry: bool = True, guest_python: str = "",
                 own_slot: str | None = None) -> None:
        self.name = ("ours_registry" if registry else "ours_dns") + (
            f"_own_slot_{own_slot}" if own_slot else "")
        super().__init__(fleet)
        self.registry = registry
        self.own_slot = own_slot
        self.guest_python = guest_python
        self.token = secrets.token_hex(16)
        self.ens = EnsembleId(self.namespace, SERVICE)

    def dns_name(self, slot: Slot) -> str:
        return f"{self.ens.slot(slot.index)}.{SERVICE}.{self.namespace}.svc.{ZONE}"

    @property
    def vmis(self) -> str:
        return f"/apis/kubevirt.io/v1/namespaces/{self.namespace}/virtualmachineinstances"

    def setup(self) -> None:
        import hashlib

        super().setup()
        self.cluster.start_host_agent()
        n = len(self.fleet)
        self.cluster.api.apply(f"/api/v1/namespaces/{self.namespace}/services/{SERVICE}", {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": SERVICE, "namespace": self.namespace,
                         "labels": {ENSEMBLE_LABEL: SERVICE},
                         "annotations": {"imex-ensemble.io/max-members": str(n),
                                         "imex-ensemble.io/port": str(PORT),
                                         "imex-ensemble.io/token-sha256":
                                             hashlib.sha256(self.token.encode()).hexdigest()}},
            "spec": {"clusterIP": "None",
                     "ports": [{"name": "imex", "port": PORT, "protocol": "TCP"}]}})

    def create(self, slot: Slot) -> None:
        self.cluster.api.create(self.vmis, {
            "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": slot.name, "namespace": self.namespace,
                         "labels": {ENSEMBLE_LABEL: SERVICE, INDEX_LABEL: str(slot.index)}},
            "spec": {"domain": {"cpu": {"cores": 2}, "memory": {"guest": "1Gi"},
                                "resources": {"requests": {"memory": "1Gi"}},
                                "devices": {"interfaces": [{"name": "default", "bridge": {}}]}},
                     "networks": [{"name": "default", "pod": {}}]}})

    def write_running(self, slot: Slot) -> str:
        """As KubeVirt reports a running VMI with its address: a merge patch of status."""
        ua = self.tag("running", slot)
        body = {"status": {
            "phase": "Running", "nodeName": self.node_name(slot),
            "conditions": [{"type": "Ready", "status": "True",
                            "lastTransitionTime": now_rfc3339()}],
            "interfaces": [{"name": "default", "ipAddress": slot.ip, "ipAddresses": [slot.ip],
                            "mac": f"02:00:00:00:{slot.index // 256:02x}:{slot.index % 256:02x}",
                            "infoSource": "domain, guest-agent"}]}}
        self._send("PATCH", f"{self.vmis}/{slot.name}/status", body, ua,
                   "application/merge-patch+json")
        return ua

    def delete(self, slot: Slot) -> str:
        ua = self.tag("delete", slot)
        self._send("DELETE", f"{self.vmis}/{slot.name}", {"gracePeriodSeconds": 0}, ua)
        return ua

    def _send(self, method: str, path: str, body: Any, ua: str,
              content_type: str = "application/json") -> None:
        resp = self.cluster.api.client.request(
            method, path, content=json.dumps(body),
            headers={"Content-Type": content_type, "User-Agent": ua})
        if resp.status_code >= 300:
            raise RuntimeError(f"{method} {path}: {resp.status_code} {resp.text[:300]}")

    def status_file(self, slot: Slot) -> Path:
        return slot.dir / "status.json"

    def boot(self, slot: Slot) -> None:
        from tests.sandbox.ensemble import toml_value

        imex = slot.dir / "imex"
        slot.imex_cfg = write_standin_files(imex, [], server_port=PORT)
        slot.state_file = imex / "state.json"
        slot.attempt_log = imex / "attempts.jsonl"
        token = slot.dir / "token"
        token.write_text(self.token + "\n")
        token.chmod(0o600)
        values: dict[str, object] = {
            "ensemble": SERVICE, "namespace": self.namespace,
            "max_members": len(self.fleet), "port": PORT,
            "nameservers": [f"{self.cluster.dns_ip}:53"],
            "nodes_config": str(imex / "nodes_config.cfg"),
            "status_file": str(self.status_file(slot)),
            "imex_control": "process",
            "imex_command": [str(standin_daemon()), "-c", str(slot.imex_cfg), "--state-file",
                             str(slot.state_file), "--attempt-log", str(slot.attempt_log)],
            "imex_ctl": [str(standin_ctl()), "-c", str(slot.imex_cfg)],  # native (issue 27)
        }
        if self.own_slot is not None:
            values["own_slot"] = self.own_slot
        if self.registry:
            values["registry_url"] = self.cluster.registry_url
            values["token_file"] = str(token)
        cfg = slot.dir / "config.toml"
        cfg.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
        self.fleet.popen(slot, [self.guest_python, "-m", "guest_agent.cli", "run", "--config",
                                str(cfg), "--json"], "agent.log")

    def wait_booted(self, slot: Slot, timeout: float = 180) -> None:
        _wait(f"{slot.name}'s guest agent to start", lambda: self.status_file(slot).exists(),
              timeout)


class FloorSide(OursSide):
    """The VMIs and host agent of ours, the floor probe in each VM."""

    has_imex = False

    def __init__(self, fleet: Fleet, *, guest_python: str = "") -> None:
        super().__init__(fleet, registry=True, guest_python=guest_python)
        self.name = "floor"
        self.workdir = fleet.workdir / self.name
        self.workdir.mkdir(parents=True, exist_ok=True)

    def boot(self, slot: Slot) -> None:
        url = self.cluster.registry_url.removeprefix("http://")
        host, port = url.rsplit(":", 1)
        self.fleet.popen(slot, [self.guest_python, FLOOR_PROBE, host, port, self.namespace,
                                SERVICE, "/etc/hosts"], "probe.log")

    def wait_booted(self, slot: Slot, timeout: float = 180) -> None:
        marker = f"# BEGIN imex-ensemble {self.namespace}/{SERVICE}"
        _wait(f"{slot.name}'s probe to write its first answer",
              lambda: marker in slot.node.read_hosts(), timeout)


def _wait(what: str, probe: Callable[[], bool], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not probe():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)
