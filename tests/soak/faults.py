"""Injecting and undoing each kind of fault of the schedule on the soak's rack.

TEST CODE. :class:`Injector` has, per kind, ``inject`` (at the fault's time), an optional
``tick`` (every loop turn while it is held: the 410 storm's repeated compaction, the DNS
fault's switch from SERVFAIL to timeouts) and ``undo`` (at the end of the hold, or when
the runner quiesces). What each does is the kind's ``what`` in schedule.py; the notes
below are only where the sandbox makes a choice:

- guest faults that need the virt-controller's API writes (crash, rejoin, migration)
  wait while an API fault is held, as a real virt-controller's writes would;
- ``agent-kill``: the agent's IMEX child dies with it (PR_SET_PDEATHSIG); "systemd"
  starts the agent again 2 s later (``RESTART_SEC``), once the old IMEX is gone;
- ``hosts-clobber`` rewrites the file in one ``pwrite`` padded to the old length with a
  comment, so the clobber itself is never a torn read;
- ``enospc`` fills both tmpfs (rack.py) with a file of zeros; the undo deletes it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from dataclasses import dataclass

from tests.sandbox.ensemble import REPO_ROOT, Vm, _pdeathsig, child_env
from tests.sandbox.netns import netns_pids
from tests.soak.rack import REPLICAS, SoakRack
from tests.soak.schedule import Fault, Slot

RESTART_SEC = 2.0
FILLER = ".soak-filler"
NEEDS_API = frozenset({"vm-crash", "migration"})


@dataclass
class Active:
    fault: Fault
    injected_at: float  # monotonic
    undo_at: float
    #: what inject chose (the leader's identity, the IPs of a block)
    detail: str = ""
    undone_at: float | None = None


def _nft(netns: str, script: str) -> None:
    subprocess.run(["ip", "netns", "exec", netns, "nft", "-f", "-"], input=script.encode(),
                   capture_output=True, check=False, timeout=20)


def _cmdline(pid: int) -> str:
    try:
        return open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def imex_pids(vm: Vm, daemons: bool = False) -> list[int]:
    """The IMEX stand-in's processes in ``vm``'s network namespace. With ``daemons``,
    only the daemons: not the preflight's ``nvidia-imex --version``, and not a child
    between its fork and its exec, which carries its parent's command line for a moment
    (the ``nvidia-imex`` wrapper's ``$(...)`` subshells, the stand-in's own commands)."""
    pids = [p for p in netns_pids(vm.node.name) if _is_imex(c := _cmdline(p))
            and not (daemons and "--version" in c.split())]
    if daemons:
        tree = set(pids)
        pids = [p for p in pids if _ppid(p) not in tree]
    return pids


def _ppid(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[-1].split()[1])
    except (OSError, IndexError, ValueError):
        return None


def _is_imex(cmdline: str) -> bool:
    """The IMEX stand-in (bin/nvidia-imex execs ``python -m tests.sandbox.imex_standin``)."""
    return "tests.sandbox.imex_standin" in cmdline or (
        "nvidia-imex" in cmdline and "nvidia-imex-ctl" not in cmdline)


def restart_agent(vm: Vm) -> None:
    """systemd's restart of the guest agent: the same config, the VM's files as they are
    (``Vm.start`` is a boot: it writes the image's files, the empty nodes file included)."""
    if vm.running():
        return
    cfg = vm.dir / "config.toml"
    with open(vm.log_file, "ab") as logf:
        logf.write(f"---- agent restart at {time.strftime('%H:%M:%S')}\n".encode())
        logf.flush()
        vm.agent = subprocess.Popen(
            vm.node.argv([vm.sandbox.settings.guest_python, "-m", "guest_agent.cli", "run",
                          "--config", str(cfg), "--json"]),
            stdout=logf, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO_ROOT,
            preexec_fn=_pdeathsig)
    vm.node.procs.append(vm.agent)


class Injector:
    def __init__(self, rack: SoakRack) -> None:
        self.rack = rack
        #: guest agents killed on purpose and not yet restarted: slot -> restart time
        self.agent_restarts: dict[Slot, float] = {}
        #: slots whose VM is down on purpose (crash held)
        self.down: set[Slot] = set()

    # ---- dispatch
    def inject(self, a: Active) -> None:
        getattr(self, "_inject_" + a.fault.kind.replace("-", "_"))(a)

    def tick(self, a: Active) -> None:
        fn = getattr(self, "_tick_" + a.fault.kind.replace("-", "_"), None)
        if fn is not None:
            fn(a)

    def undo(self, a: Active) -> None:
        fn = getattr(self, "_undo_" + a.fault.kind.replace("-", "_"), None)
        if fn is not None:
            fn(a)

    def pending_restarts(self) -> None:
        """Start the agents whose RestartSec has passed (called every loop turn)."""
        now = time.monotonic()
        for slot, at in list(self.agent_restarts.items()):
            vm = self.rack.vm(slot)
            if now < at or any(_is_imex(_cmdline(p)) for p in netns_pids(vm.node.name)):
                continue
            del self.agent_restarts[slot]
            if slot not in self.down:
                restart_agent(vm)

    # ---- guests
    def _inject_vm_crash(self, a: Active) -> None:
        e, i = a.fault.targets[0]
        self.down.add((e, i))
        self.agent_restarts.pop((e, i), None)
        self.rack.pools[e].crash(i)

    def _undo_vm_crash(self, a: Active) -> None:
        e, i = slot = a.fault.targets[0]
        self.rack.mark_boot(slot)
        self._free_space(slot)  # a new VM: its disk is not the old one's
        # the new VM's image has the empty nodes file (Vm.start writes it again later);
        # emptied right after the announcement, so the reader's last read of the old
        # VM's file cannot end the allowance before the new VM's empty one appears
        (self.rack.vm(slot).dir / "imex" / "nodes_config.cfg").write_bytes(b"")
        self.rack.pools[e].restore(i)
        self.down.discard(slot)
        a.detail = f"rejoined at {self.rack.vm(slot).ip}"

    def _inject_migration(self, a: Active) -> None:
        e, i = a.fault.targets[0]
        a.detail = f"-> {self.rack.pools[e].migrate(i)}"

    def _inject_agent_kill(self, a: Active) -> None:
        slot = a.fault.targets[0]
        vm = self.rack.vm(slot)
        if vm.agent is not None and vm.agent.poll() is None:
            vm.agent.send_signal(signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                vm.agent.wait(5)
        self.agent_restarts[slot] = time.monotonic() + RESTART_SEC

    def _inject_imex_crash(self, a: Active) -> None:
        vm = self.rack.vm(a.fault.targets[0])
        pids = imex_pids(vm)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        a.detail = f"pid {' '.join(map(str, pids))}" if pids else "no IMEX was running"

    def _inject_hosts_clobber(self, a: Active) -> None:
        vm = self.rack.vm(a.fault.targets[0])
        path = vm.hosts_path
        fabric = self.rack.sbx.fabric
        assert fabric is not None
        text = fabric.hosts_lines({}).encode()
        fd = os.open(path, os.O_RDWR)
        try:
            old = os.fstat(fd).st_size
            if old > len(text) + 2:
                text += b"#" + b" " * (old - len(text) - 2) + b"\n"
            os.pwrite(fd, text, 0)
            os.ftruncate(fd, len(text))
        finally:
            os.close(fd)

    def _inject_enospc(self, a: Active) -> None:
        slot = a.fault.targets[0]
        vm = self.rack.vm(slot)
        for d in (vm.node.etc_dir, vm.dir / "imex"):
            try:
                with open(d / FILLER, "wb") as f:
                    while True:
                        f.write(b"\0" * 65536)
            except OSError:
                pass

    def _undo_enospc(self, a: Active) -> None:
        self._free_space(a.fault.targets[0])

    def _free_space(self, slot: Slot) -> None:
        vm = self.rack.vm(slot)
        for d in (vm.node.etc_dir, vm.dir / "imex"):
            (d / FILLER).unlink(missing_ok=True)

    # ---- host agents
    def _inject_leader_kill(self, a: Active) -> None:
        ident = self.rack.leader()
        r = self.rack.replicas[ident]
        r.expected_exit = True
        assert r.proc is not None
        r.proc.send_signal(signal.SIGKILL)
        r.proc.wait(10)
        a.detail = ident

    def _undo_leader_kill(self, a: Active) -> None:
        self.rack.start_replica(a.detail)

    def _inject_leader_stop(self, a: Active) -> None:
        ident = self.rack.leader()
        r = self.rack.replicas[ident]
        assert r.proc is not None
        r.stopped = True
        os.kill(r.proc.pid, signal.SIGSTOP)
        a.detail = ident

    def _undo_leader_stop(self, a: Active) -> None:
        r = self.rack.replicas[a.detail]
        if r.proc is not None and r.proc.poll() is None:
            os.kill(r.proc.pid, signal.SIGCONT)
        r.stopped = False

    def _inject_rolling_restart(self, a: Active) -> None:
        from tests.sandbox.ensemble import wait_for

        for ident in REPLICAS:
            r = self.rack.replicas[ident]
            if r.proc is not None and r.proc.poll() is None:
                r.expected_exit = True
                r.proc.send_signal(signal.SIGTERM)
                try:
                    r.proc.wait(20)
                except subprocess.TimeoutExpired:
                    r.proc.kill()
                    r.proc.wait(5)
                    a.detail += f" {ident} ignored SIGTERM;"
            self.rack.start_replica(ident)
            wait_for(f"{ident} ready again", lambda i=ident: self.rack.replica_ready(i)
                     or None, 60, 0.2)

    # ---- the API
    def _inject_api_outage(self, a: Active) -> None:
        assert self.rack.sbx.api is not None
        self.rack.sbx.api.outage("refuse")

    def _undo_api_outage(self, a: Active) -> None:
        assert self.rack.sbx.api is not None
        self.rack.sbx.api.recover()

    def _inject_api_410(self, a: Active) -> None:
        a.detail = "0"
        self._tick_api_410(a)

    def _tick_api_410(self, a: Active) -> None:
        api = self.rack.sbx.api
        assert api is not None
        last = getattr(a, "_last410", 0.0)
        if time.monotonic() - last >= 2.0:
            api.compact()
            api.drop_watches()
            a._last410 = time.monotonic()  # type: ignore[attr-defined]
            a.detail = str(int(a.detail or "0") + 1)

    def _inject_api_slow(self, a: Active) -> None:
        assert self.rack.sbx.api is not None
        self.rack.sbx.api.delay(a.fault.param)

    def _undo_api_slow(self, a: Active) -> None:
        assert self.rack.sbx.api is not None
        self.rack.sbx.api.clear_faults()

    # ---- the network
    def _inject_registry_block(self, a: Active) -> None:
        reg = self.rack.sbx.registry_ip
        for slot in a.fault.targets:
            name = self.rack.vm(slot).node.name
            _nft(name, "table ip soakreg {\n"
                 " chain o { type filter hook output priority 0; ip daddr " + reg + " drop; }\n"
                 " chain i { type filter hook input priority 0; ip saddr " + reg + " drop; }\n"
                 "}\n")
            subprocess.run(["ip", "netns", "exec", name, "ss", "-K", "-t", "dst", reg],
                           capture_output=True, check=False, timeout=10)

    def _undo_registry_block(self, a: Active) -> None:
        for slot in a.fault.targets:
            _nft(self.rack.vm(slot).node.name, "table ip soakreg {}\ndelete table ip soakreg\n")

    def _inject_dns_fail(self, a: Active) -> None:
        assert self.rack.sbx.dns is not None
        self.rack.sbx.dns.set_fail_mode("servfail")
        a.detail = "servfail"

    def _tick_dns_fail(self, a: Active) -> None:
        dns = self.rack.sbx.dns
        assert dns is not None
        if a.detail == "servfail" and time.monotonic() >= a.injected_at + a.fault.hold / 2:
            dns.set_fail_mode("timeout")
            a.detail = "servfail, then timeout"

    def _undo_dns_fail(self, a: Active) -> None:
        assert self.rack.sbx.dns is not None
        self.rack.sbx.dns.set_fail_mode(None)

    def _inject_imex_oneway(self, a: Active) -> None:
        src, dst = (self.rack.vm(s) for s in a.fault.targets)
        port = src.spec.port
        _nft(src.node.name, "table ip soakimex {\n chain o { type filter hook output "
             f"priority 0; ip daddr {dst.ip} tcp dport {port} drop; }}\n}}\n")
        a.detail = f"{src.ip} -/-> {dst.ip}:{port}"

    def _undo_imex_oneway(self, a: Active) -> None:
        src = self.rack.vm(a.fault.targets[0])
        _nft(src.node.name, "table ip soakimex {}\ndelete table ip soakimex\n")
