"""The soak's rack: the namespace sandbox with three electing host agents, two ensembles,
size-limited file systems under every VM's two managed files, and a reader per VM.

TEST CODE. Built on :class:`tests.sandbox.ensemble.Sandbox` as tests/e2e/test_ha.py
builds its HA rack: the sandbox's single agent makes way for three replicas with
``--leader-elect`` (test-sized Lease: 4 s / 3 s / 0.5 s) behind the kube-proxy stand-in
(tests/sandbox/balancer.py) on the registry's address. Ensemble ``a`` is declared by a
hand-made Service, ``b`` by an ImexEnsemble (schedule.layout gives their sizes).

Every VM's ``/etc/netns/<vm>`` (its ``/etc/hosts``) and the directory of its nodes file
get a tmpfs of :data:`TMPFS_SIZE` before its agent starts, named ``imex-soak-<pid>`` so a
later run unmounts what a killed one left (:func:`cleanup_dead_mounts`). :meth:`close`
undoes everything in order, each step even when an earlier one failed: readers, replicas
(SIGCONT first: one may be stopped), balancer, guests, mounts, then the sandbox.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import subprocess
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.sandbox.balancer import Backend, Balancer
from tests.sandbox.ensemble import (
    AGENT_NAMESPACE,
    PY,
    REPO_ROOT,
    EnsembleSpec,
    Sandbox,
    SandboxSettings,
    Vm,
    _pdeathsig,
    child_env,
    free_port,
    wait_for,
)
from tests.sandbox.virt_controller import Pool, VirtController
from tests.soak.schedule import Layout, Slot

log = logging.getLogger("soak.rack")

REPLICAS = ("h-a", "h-b", "h-c")
LEASE_NAME = "imex-host-agent"
LEASE_S = 4.0
TMPFS_SIZE = "2m"
MOUNT_TAG = "imex-soak"
NAMESPACE = "soak"
ENSEMBLE_NAMES = {"a": "gb200", "b": "gb300"}


def _mounts() -> list[tuple[str, str]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            src, target, *_ = line.split()
            out.append((src, target.replace("\\040", " ")))
    return out


def umount(target: str) -> None:
    subprocess.run(["umount", "-l", target], capture_output=True, check=False, timeout=20)


def cleanup_dead_mounts() -> list[str]:
    """Unmount the tmpfs of soak runs whose process is gone; returns their targets."""
    gone = []
    for src, target in _mounts():
        m = re.fullmatch(rf"{MOUNT_TAG}-(\d+)", src)
        if m and not Path(f"/proc/{m.group(1)}").exists():
            umount(target)
            gone.append(target)
    return gone


@dataclass
class Replica:
    identity: str
    port: int
    proc: subprocess.Popen[bytes] | None = None
    stopped: bool = False  # SIGSTOPped by a fault
    #: exits the schedule caused (SIGKILL, SIGTERM of a rolling restart)
    expected_exit: bool = False


@dataclass
class SoakRack:
    lay: Layout
    settings: SandboxSettings
    sbx: Sandbox = field(init=False)
    ctl: VirtController | None = None
    lb: Balancer | None = None
    specs: dict[str, EnsembleSpec] = field(default_factory=dict)
    pools: dict[str, Pool] = field(default_factory=dict)
    replicas: dict[str, Replica] = field(default_factory=dict)
    readers: dict[Slot, subprocess.Popen[bytes]] = field(default_factory=dict)
    mounts: list[str] = field(default_factory=list)
    out_dir: Path = Path("/nonexistent")

    def __post_init__(self) -> None:
        self.sbx = Sandbox(self.settings)

    # ---- naming
    def vm(self, slot: Slot) -> Vm:
        e, i = slot
        return self.sbx.vm(self.specs[e], self.pools[e].vmi_name(i))

    def slots(self) -> list[Slot]:
        return self.lay.slots()

    def boot_file(self, slot: Slot) -> Path:
        return self.out_dir / f"boot-{slot[0]}{slot[1]}"

    def reader_out(self, slot: Slot) -> Path:
        return self.out_dir / f"reader-{slot[0]}{slot[1]}.jsonl"

    # ---- lifecycle
    def start(self, out_dir: Path) -> None:
        self.out_dir = out_dir
        out_dir.mkdir(parents=True, exist_ok=True)
        for t in cleanup_dead_mounts():
            log.info("unmounted %s of a dead soak run", t)
        sbx = self.sbx
        sbx.start()
        sbx.stop_host_agent()
        assert sbx.api is not None
        sbx.api.start_audit((AGENT_NAMESPACE, LEASE_NAME),
                            keep=("endpointslices", "services", "imexensembles", "secrets"))
        self.lb = Balancer.over(sbx.registry_ip, sbx.registry_port, [], period=0.2,
                                timeout=0.5)
        for ident in REPLICAS:
            r = Replica(ident, free_port(sbx.registry_ip))
            self.replicas[ident] = r
            self.lb.backends.append(Backend(sbx.registry_ip, r.port))
            self.start_replica(ident)
        self.lb.start()
        wait_for("three replicas behind the address",
                 lambda: len(self.lb.ready()) == 3 or None if self.lb else None, 90)
        self.ctl = VirtController(sbx)
        for key, form in (("a", "service"), ("b", "cr")):
            n = self.lay.sizes[key]
            spec = self.ctl.create_ensemble(NAMESPACE, ENSEMBLE_NAMES[key],
                                            max_members=n + 2, form=form)
            self.specs[key] = spec
            self.pools[key] = self.ctl.pool(spec)
        wait_for("the ImexEnsemble's Service", lambda: sbx.registry_json(self.specs["b"]),
                 60, 0.2)
        for slot in self.slots():
            self._prepare_vm(slot)
        for key, pool in self.pools.items():
            pool.scale(self.lay.sizes[key])
        for slot in self.slots():
            self._start_reader(slot)

    def _prepare_vm(self, slot: Slot) -> None:
        """Create the VM powered off, mount its two file systems, as the image would have."""
        e, i = slot
        spec = self.specs[e]
        vm = self.sbx.create_vm(spec, self.pools[e].vmi_name(i))
        vm.write_config()
        for target in (vm.node.etc_dir, vm.dir / "imex"):
            saved = {p.name: p.read_bytes() for p in target.iterdir() if p.is_file()}
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE},mode=0755",
                            f"{MOUNT_TAG}-{os.getpid()}", str(target)], check=True,
                           capture_output=True, timeout=20)
            self.mounts.append(str(target))
            for name, data in saved.items():
                (target / name).write_bytes(data)
        self.boot_file(slot).write_text("0")

    def _start_reader(self, slot: Slot) -> None:
        vm = self.vm(slot)
        spec = self.specs[slot[0]]
        argv = [PY, "-m", "tests.soak.reader", "--hosts", str(vm.hosts_path),
                "--nodes", str(vm.dir / "imex" / "nodes_config.cfg"),
                "--namespace", spec.namespace, "--name", spec.name,
                "--max-members", str(spec.max_members), "--boot-file",
                str(self.boot_file(slot)), "--out", str(self.reader_out(slot))]
        self.readers[slot] = subprocess.Popen(argv, env=child_env(), cwd=REPO_ROOT,
                                              preexec_fn=_pdeathsig)

    def mark_boot(self, slot: Slot) -> None:
        """Tell the slot's reader a boot is coming (the image's empty nodes file is fine)."""
        f = self.boot_file(slot)
        f.write_text(str(int(f.read_text() or "0") + 1))

    def start_replica(self, identity: str) -> None:
        r = self.replicas[identity]
        sbx = self.sbx
        argv = [PY, "-m", "tests.sandbox.host_agent_proc", "--tune", "backoff_initial=0.1",
                "--tune", "backoff_max=1.0", "--tune", "shutdown_drain=1.0",
                "--kubeconfig", str(sbx.kubeconfig),
                "--listen", f"{sbx.registry_ip}:{r.port}", "--json",
                "--report-stale-after", str(self.settings.report_stale_after),
                "--leader-elect", "--identity", identity,
                "--agent-namespace", AGENT_NAMESPACE,
                "--leader-elect-lease-duration", str(LEASE_S),
                "--leader-elect-renew-deadline", "3", "--leader-elect-retry-period", "0.5"]
        with open(self.replica_log(identity), "ab") as out:
            out.write(f"---- start at {time.time():.3f}\n".encode())
            out.flush()
            r.proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                      env=child_env(), cwd=REPO_ROOT, preexec_fn=_pdeathsig)
        r.expected_exit = False
        r.stopped = False

    def replica_log(self, identity: str) -> Path:
        return self.out_dir / f"{identity}.log"

    def replica_url(self, identity: str) -> str:
        return f"http://{self.sbx.registry_ip}:{self.replicas[identity].port}"

    def replica_ready(self, identity: str) -> bool:
        try:
            with urllib.request.urlopen(f"{self.replica_url(identity)}/readyz",
                                        timeout=1) as resp:
                return bool(resp.status == 200)
        except Exception:
            return False

    def lease_holder(self) -> str | None:
        assert self.sbx.api is not None
        try:
            obj: dict[str, Any] = self.sbx.api.get("coordination.k8s.io/v1", "Lease",
                                                   LEASE_NAME, AGENT_NAMESPACE)
        except Exception:
            return None
        holder = (obj.get("spec") or {}).get("holderIdentity")
        return str(holder) if holder else None

    def leader(self, timeout: float = 30.0) -> str:
        """The live, running replica holding the Lease."""
        def probe() -> str | None:
            h = self.lease_holder()
            r = self.replicas.get(h or "")
            ok = r is not None and r.proc is not None and r.proc.poll() is None \
                and not r.stopped
            return h if ok else None
        return wait_for("a live leader", probe, timeout, 0.1)

    def close(self) -> None:
        steps = [("readers", self._stop_readers), ("replicas", self._stop_replicas),
                 ("controller", self._close_ctl), ("balancer", self._close_lb),
                 ("guests", self.sbx._stop_all_vms), ("mounts", self._unmount),
                 ("sandbox", self.sbx.close)]
        for what, step in steps:
            try:
                step()
            except BaseException as e:  # every step runs, even after Ctrl-C in one
                log.warning("soak teardown of %s failed: %s", what, e)

    def _stop_readers(self) -> None:
        for p in self.readers.values():
            with contextlib.suppress(ProcessLookupError):
                p.terminate()
        for p in self.readers.values():
            try:
                p.wait(5)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)

    def _stop_replicas(self) -> None:
        for r in self.replicas.values():
            if r.proc is not None and r.proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(r.proc.pid, signal.SIGCONT)
                    r.proc.send_signal(signal.SIGTERM)
        for r in self.replicas.values():
            if r.proc is not None:
                try:
                    r.proc.wait(10)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait(5)

    def _close_ctl(self) -> None:
        if self.ctl is not None:
            self.ctl.close()

    def _close_lb(self) -> None:
        if self.lb is not None:
            self.lb.close()

    def _unmount(self) -> None:
        for target in reversed(self.mounts):
            umount(target)
        self.mounts.clear()
