"""Convergence, IMEX disruption and guest footprint in one 18-VM sandbox.

Uses the sandbox orchestrator (``tests.sandbox.ensemble.Sandbox`` +
``tests.sandbox.virt_controller``): the API double, the DNS stand-in fed from
EndpointSlices, the real host agent, and 18 network-namespace VMs each running
the real guest agent with an IMEX stand-in child. Guest settings are the
production defaults (``poll_interval`` 2 s, ``longpoll_timeout`` 30 s,
``dns_timeout`` 2 s, ``signal_interval`` 5 s), not the sandbox's test-sized ones.

One sandbox serves every part asked for, in this order:

1. **Boot storm, names mode**: the pool scales 0 -> 18 (all VMIs created and
   scheduled, all VMs booted, all reported Running; the time it takes is
   recorded and must be under 10 s). Once converged and quiet for one signal
   window, each member's IMEX stand-in state file gives SIGUSR1s received and
   restarts (starts - 1).
2. **Idle** (``guest``): 30 s without changes; each guest agent's RSS and CPU
   (its own process, not IMEX) from /proc.
3. **Registry path** (``convergence``): single changes, one at a time: a
   member's published IP flips between its own address and a second address
   on the same VM (so every guest, itself included, must pin the new one).
   Latency = from sending the status patch to the API double until the last
   guest's /etc/hosts holds it, as a real-time watcher process reads it (inotify,
   ``hostswatch``); ``convergence_registry_written_*`` beside it is the last
   guest's write by the files' mtimes. With ``storm`` the
   changes are spaced one signal window + 1 s apart so each is a settled change
   whose signals and restarts are counted; else 0.3 s after convergence.
   Guest CPU during this phase is the "under churn" figure.
4. **DNS-only path** (``convergence``): the registry is made unreachable from
   every VM (a prohibit route); once every guest reports DNS as its source
   (the registry silent for ``poll_interval + longpoll_timeout``), changes every
   second, round-robin over the members, each timed to the last guest as above.
5. **ips mode** (``storm``): the pool scales to 0, the guests are configured
   with ``mode = "ips"``, and a second boot storm and single changes (spaced
   until every member has restarted and a further settle time has passed)
   count restarts per member.

Figures per member are the worst member's, per settled change. For ips mode
the goal figure comes from the single changes (the member furthest from one
restart per change); the boot storm's restarts (``storm_boot_restarts_*_ips``,
IMEX's first start is held until the members settle, so 0 is expected) are
reported beside it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from tests.bench.common import (
    BenchError,
    Results,
    cpu_seconds,
    peak_rss_mb,
    percentile,
    rss_mb,
    tree_pids,
    wait_for,
)
from tests.bench.hostswatch import HostsWatch
from tests.bench.sandbox_cpu import (
    Ledger,
    ReconnectTally,
    guest_cpu,
    imex_counts,
    imex_views,
)

PREFIX = "bch"
NAMESPACE = "bench"
POLL_INTERVAL = 2.0
SIGNAL_INTERVAL = 5.0
LONGPOLL = 30.0
#: a change not in every guest's /etc/hosts by then is counted as missed
MISS_AFTER = 120.0
SETTLE_TIME = 2.0  # guest_agent.config default: ips-mode debounce
#: the idle phase that guest_change_cpu_ms and the stand-ins' figures are net of (s)
IDLE_WINDOW_S = 65.0


def _guest_pid(vm: Any) -> int | None:
    """The guest agent's python process (not the ``ip netns exec`` wrapper, not IMEX)."""
    if vm.agent is None or vm.agent.poll() is not None:
        return None
    for pid in tree_pids(vm.agent.pid):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"guest_agent.cli" in cmd and b"run" in cmd:
            return pid
    return None


@contextlib.contextmanager
def _guest_mode(mode: str) -> Iterator[None]:
    """Guests written from now on get ``mode = "<mode>"`` in their config.toml.

    The sandbox's Vm.write_config has no mode knob (yet); appending the key to
    the file it wrote keeps this benchmark off the orchestrator's code.
    """
    from tests.sandbox.ensemble import Vm

    original = Vm.write_config

    def write_config(self: Any) -> Path:
        path: Path = original(self)
        if mode != "names":
            text = path.read_text()
            if "\nmode = " not in "\n" + text:
                path.write_text(text + f'mode = "{mode}"\n')
        return path

    Vm.write_config = write_config  # type: ignore[method-assign]
    try:
        yield
    finally:
        Vm.write_config = original  # type: ignore[method-assign]


class Bench:
    def __init__(self, results: Results, quick: bool, parts: set[str]) -> None:
        self.results = results
        self.quick = quick
        self.parts = parts
        self.n_vms = 6 if quick else 18
        self.changes = 5 if quick else 100
        self.peak_rss: dict[str, float] = {}
        self.missed: list[str] = []
        self.written_ms: list[float] = []  # registry path: change -> last guest's write
        self.keep = False  # keep the sandbox's work directory (logs) for a reader
        #: one idle guest's (own, children) and one idle IMEX stand-in's CPU-seconds per
        #: second, once measured
        self.idle_rate: tuple[float, float, float] | None = None

    # ------------------------------------------------------------- readings

    def counters(self) -> dict[str, tuple[int, int]]:
        """vm -> (IMEX starts, SIGUSR1 received) from the stand-ins' state files."""
        out = {}
        for vm in self.sbx.vms_of(self.spec):
            st = vm.imex_state()
            out[vm.vmi] = (int(st.get("starts", 0)), int(st.get("signals_received", 0)))
        return out

    def guest_pids(self) -> dict[str, int]:
        out = {}
        for vm in self.sbx.vms_of(self.spec):
            pid = _guest_pid(vm)
            if pid is not None:
                out[vm.vmi] = pid
        return out

    def sample_rss(self) -> None:
        for vm, pid in self.guest_pids().items():
            with contextlib.suppress(OSError):
                self.peak_rss[vm] = max(self.peak_rss.get(vm, 0.0), peak_rss_mb(pid))

    def cpu(self) -> dict[str, float]:
        out = {}
        for vm, pid in self.guest_pids().items():
            with contextlib.suppress(OSError):
                out[vm] = cpu_seconds(pid)
        return out

    def cpu_pct(self, before: dict[str, float], after: dict[str, float],
                seconds: float) -> list[float]:
        return [(after[v] - before[v]) / seconds * 100 for v in before if v in after]

    # ------------------------------------------------------------- actions

    def boot_storm(self, label: str) -> tuple[float, float]:
        """Scale 0 -> n; returns (seconds to boot the storm, seconds to converge)."""
        t0 = time.monotonic()
        self.pool.scale(self.n_vms)
        booted = time.monotonic() - t0
        self.sbx.wait_converged(self.spec, timeout=300)
        converged = time.monotonic() - t0
        self.results.set(f"storm_boot_s_{label}", booted)
        self.results.set(f"storm_converge_s_{label}", converged)
        self.add_aliases()
        self.watch.set_vms({vm.vmi: vm.hosts_path for vm in self.sbx.vms_of(self.spec)})
        return booted, converged

    def add_aliases(self) -> None:
        """A second address on every VM, for IP changes the VM itself can follow."""
        assert self.sbx.fabric is not None
        for vm in self.sbx.vms_of(self.spec):
            alias = self.alias.get(vm.vmi)
            if alias is None:
                alias = self.alias[vm.vmi] = self.sbx.fabric.allocate()
            if alias not in vm.node.addresses():
                vm.node.add_address(alias)
            self.current[vm.vmi] = vm.ip

    def change(self, vm: Any) -> tuple[Any, float]:
        """Flip ``vm``'s published IP; returns (the pending expectation, send time)."""
        from tests.sandbox.virt_controller import running_status

        new = self.alias[vm.vmi] if self.current[vm.vmi] == vm.ip else vm.ip
        member = self.pool.members[vm.index]
        started = time.monotonic()
        pending = self.watch.expect(vm.index, new, started)
        status = running_status(new, member.node, member.mac)
        # Both addresses are the VM's: ipAddress (published) first, the other after it,
        # so the registry also accepts the guest's reports sent from the other one.
        other = vm.ip if new != vm.ip else self.alias[vm.vmi]
        status["interfaces"][0]["ipAddresses"] = [new, other]
        self.ctl.set_status(self.spec, vm.vmi, status)
        self.current[vm.vmi] = new
        return pending, started

    def latency_ms(self, pending: Any, what: str) -> float:
        """Milliseconds until every guest pinned it; a miss counts as MISS_AFTER and is noted.

        A change that never reaches some guest is a finding, not a harness failure:
        it is counted (``*_missed``), the guests' logs are kept, and the run goes on.
        """
        if pending.done.wait(max(0.1, pending.started + MISS_AFTER - time.monotonic())):
            return float((pending.finished - pending.started) * 1000)
        self.missed.append(f"{what}: slot {pending.slot} -> {pending.ip} not in the /etc/hosts "
                           f"of {sorted(pending.waiting)} after {MISS_AFTER:.0f} s")
        self.keep = True
        print(f"!! {self.missed[-1]}", flush=True)
        return MISS_AFTER * 1000

    def quiet(self, seconds: float, check: Callable[[], bool] | None = None) -> None:
        """Wait ``seconds`` after ``check`` holds (signals/restarts settle)."""
        if check is not None:
            wait_for("members to settle", check, timeout=120, interval=0.1)
        time.sleep(seconds)

    # ------------------------------------------------------------- phases

    def storm_counts(self, label: str, base: dict[str, tuple[int, int]]) -> tuple[float, float]:
        now = self.counters()
        restarts = [now[v][0] - base.get(v, (0, 0))[0] - 1 for v in now]
        # The signal counter starts again with each daemon (starts is kept across them):
        # after a start since ``base`` the whole count is this storm's.
        signals = [now[v][1] - (base[v][1] if v in base and now[v][0] == base[v][0] else 0)
                   for v in now]
        self.results.set(f"storm_boot_restarts_max_{label}", max(restarts))
        self.results.set(f"storm_boot_restarts_mean_{label}", statistics.fmean(restarts))
        self.results.set(f"storm_boot_signals_max_{label}", max(signals))
        self.results.set(f"storm_boot_signals_mean_{label}", statistics.fmean(signals))
        return max(restarts), max(signals)

    def registry_changes(self, spaced: bool) -> tuple[list[float], float, float]:
        """Sequential single changes; (latencies ms, max restarts/change, max signals/change).

        The changed member's own IMEX restart is not counted against the goal: its own
        address moved, and IMEX bound its server socket to the old one, so the guest
        agent restarts it by design (guest_agent.imex.supervisor_io); in a real cluster a
        VMI whose IP changes is a new pod whose IMEX starts anyway. It is counted apart
        (``storm_single_own_move_restarts``). Signal counters restart with the daemon,
        so after a restart the new daemon's count is the change's.
        """
        vms = self.sbx.vms_of(self.spec)
        prev = self.counters()
        restarts = dict.fromkeys(prev, 0)
        signals = dict.fromkeys(prev, 0)
        own_moves = 0
        cpu0, t0 = self.cpu(), time.monotonic()
        ledger = Ledger(self)
        ledger.sample()
        tally = ReconnectTally(imex_counts(self))
        lat = []
        for n in range(self.changes):
            vm = vms[n % len(vms)]
            pending, _ = self.change(vm)
            lat.append(self.latency_ms(pending, f"registry-path change {n}"))
            if pending.done.is_set():
                self.written_ms.append((pending.written - pending.started) * 1000)
            self.sample_rss()
            time.sleep(SIGNAL_INTERVAL + 1.0 if spaced else 0.3)
            ledger.sample()
            tally.sample(imex_counts(self))
            now = self.counters()
            for v, (starts, sigs) in now.items():
                if v not in prev:
                    continue
                d_starts = starts - prev[v][0]
                d_sigs = sigs - prev[v][1] if d_starts == 0 else sigs
                if v == vm.vmi and d_starts >= 1:
                    own_moves += 1
                    d_starts -= 1
                restarts[v] = restarts.get(v, 0) + d_starts
                signals[v] = signals.get(v, 0) + d_sigs
            prev = now
        self.charge(ledger, time.monotonic() - t0)
        with contextlib.suppress(Exception):
            self.results.note("imex_standins", imex_views(self, tally))
        churn = self.cpu_pct(cpu0, self.cpu(), time.monotonic() - t0)
        self.results.set("guest_churn_cpu_pct", statistics.fmean(churn) if churn else None)
        self.results.set("guest_churn_cpu_pct_max", max(churn) if churn else None)
        self.results.set("storm_single_own_move_restarts", own_moves)
        return (lat, max(r / self.changes for r in restarts.values()),
                max(s / self.changes for s in signals.values()))

    def charge(self, ledger: Ledger, seconds: float) -> None:
        """CPU per change by kind of process (sandbox_cpu.py), and what the stand-ins do."""
        figures = ledger.per_change(self.changes, self.n_vms, seconds, self.idle_rate)
        breakdown = []
        for key, value in figures.items():
            if key.endswith(("_ms", "_change", "_ratio", "_gross")):
                self.results.set(key, value)
            else:
                breakdown.append(f"{key} {value * 1000:.0f} ms")
        total = figures["guest_change_cpu_ms"] + figures["guest_ctl_cpu_ms_per_change"] + \
            figures["standin_cpu_ms_per_change"]
        self.results.note("sandbox_cpu_per_change", (
            f"CPU per change over {self.changes} changes, all {self.n_vms} members: guest "
            f"agents {figures['guest_change_cpu_ms'] * self.n_vms:.0f} ms, their "
            f"nvidia-imex-ctl children {figures['guest_ctl_cpu_ms_per_change'] * self.n_vms:.0f}"
            f" ms, IMEX stand-ins {figures['standin_cpu_ms_per_change'] * self.n_vms:.0f} ms "
            f"({total * self.n_vms:.0f} ms in the VMs); " + ", ".join(breakdown)
            + (" (net of the idle rates; the stand-ins' gross "
               f"{figures['standin_cpu_ms_per_change_gross'] * self.n_vms:.0f} ms)"
               if self.idle_rate else "")))

    def dns_changes(self) -> list[float]:
        vms = self.sbx.vms_of(self.spec)
        self.sbx.block_registry(True)
        try:
            # A parked long-poll on the blocked route only fails when it times out: the
            # guests publish DNS views once the registry has been silent for
            # poll_interval + longpoll_timeout (guest_agent.peers.discovery_io). Measure from then.
            blocked = time.monotonic()
            with contextlib.suppress(BenchError):
                wait_for("every guest on DNS", lambda: all(
                    vm.status().get("source") == "dns" for vm in vms), timeout=LONGPOLL + 10,
                    interval=0.5)
            self.results.set("dns_failover_s", time.monotonic() - blocked)
            pendings = []
            for n in range(self.changes):
                pendings.append(self.change(vms[n % len(vms)])[0])
                time.sleep(1.0)
            return [self.latency_ms(p, f"DNS-only change {n}") for n, p in enumerate(pendings)]
        finally:
            self.sbx.block_registry(False)

    def ips_changes(self) -> tuple[float, float]:
        """Single changes in ips mode; (max, min) restarts per member per change."""
        vms = self.sbx.vms_of(self.spec)
        n_changes = 3 if self.quick else self.changes
        base = self.counters()
        for n in range(n_changes):
            before = self.counters()

            def all_restarted(before: dict[str, tuple[int, int]] = before) -> bool:
                return all(c[0] > before[v][0] for v, c in self.counters().items() if v in before)

            pending, _ = self.change(vms[n % len(vms)])
            self.latency_ms(pending, f"ips change {n}")
            self.quiet(SETTLE_TIME + 1.0, all_restarted)
        now = self.counters()
        per = [(now[v][0] - base[v][0]) / n_changes for v in now if v in base]
        return max(per), min(per)

    # ------------------------------------------------------------- driver

    def guest_python(self) -> str:
        """The guest agents' interpreter: a venv with only the guest extra (guest_venv.py)."""
        import sys

        from tests.bench.guest_venv import guest_python

        try:
            python = guest_python()
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            self.results.note("guest_python", f"guest-only venv not built ({exc}); guest figures "
                              "include the development venv's extra imports")
            return sys.executable
        self.results.note("guest_python", python)
        return python

    def run(self) -> None:
        from tests.sandbox.ensemble import Sandbox, SandboxSettings
        from tests.sandbox.virt_controller import VirtController

        r = self.results
        python = self.guest_python()
        settings = SandboxSettings(prefix=PREFIX, poll_interval=POLL_INTERVAL, dns_timeout=2.0,
                                   longpoll_timeout=LONGPOLL, signal_interval=SIGNAL_INTERVAL,
                                   ready_grace=120.0, keep_workdir=True, guest_python=python,
                                   # a small native IMEX stand-in, as a rack runs a C++
                                   # daemon: the figures are the product's (issue 27)
                                   imex_daemon="c")
        self.alias: dict[str, str] = {}
        self.current: dict[str, str] = {}
        failed = True
        with Sandbox(settings) as sbx:
            self.sbx = sbx
            self.ctl = VirtController(sbx)
            self.spec = self.ctl.create_ensemble(NAMESPACE, "gb200")
            self.watch = HostsWatch(self.spec.id)
            try:
                self.pool = self.ctl.pool(self.spec)
                booted, _ = self.boot_storm("names")
                if booted > 10:
                    r.note("storm", f"the names boot storm took {booted:.1f} s to boot "
                                    "(goal: 18 VMs within 10 s): machine too loaded")
                self.quiet(SIGNAL_INTERVAL + 1.0)
                storm_restarts, storm_signals = self.storm_counts("names", {})
                self.sample_rss()

                if "guest" in self.parts:
                    # 65 s: a whole cycle of the guests' once-a-minute work (the full
                    # report with the view, the nvidia-smi fabric check), which starts at
                    # boot. A 30 s window right after the boot storm held none of it, so
                    # all of it landed in the change phase as cost per change.
                    window = 5.0 if self.quick else IDLE_WINDOW_S
                    cpu0, t0 = self.cpu(), time.monotonic()
                    kids0 = guest_cpu(self)
                    standins = Ledger(self)
                    standins.sample()
                    time.sleep(window)
                    standins.sample()
                    took = time.monotonic() - t0
                    idle = self.cpu_pct(cpu0, self.cpu(), took)
                    kids = guest_cpu(self)
                    both = [(sum(kids[v]) - sum(kids0[v])) / took * 100
                            for v in kids0 if v in kids]
                    own = [(kids[v][0] - kids0[v][0]) / took for v in kids0 if v in kids]
                    ctl = [(kids[v][1] - kids0[v][1]) / took for v in kids0 if v in kids]
                    self.idle_rate = (statistics.fmean(own), statistics.fmean(ctl),
                                      standins.standin_rate(took))
                    r.set("guest_idle_cpu_pct_with_children", max(both))
                    rss_now = [rss_mb(p) for p in self.guest_pids().values()]
                    r.set("guest_idle_cpu_pct", max(idle))
                    r.set("guest_idle_cpu_pct_mean", statistics.fmean(idle))
                    r.set("guest_rss_now_mb_mean", statistics.fmean(rss_now))

                spaced = "storm" in self.parts
                if self.parts & {"convergence", "storm", "guest"}:
                    lat, restarts, signals = self.registry_changes(spaced)
                    if "convergence" in self.parts:
                        r.set("convergence_registry_p50_ms", percentile(lat, 50))
                        r.set("convergence_registry_p95_ms", percentile(lat, 95))
                        r.set("convergence_registry_p99_ms", percentile(lat, 99))
                        r.set("convergence_registry_max_ms", max(lat))
                        r.note("hosts_watch", "the hosts files' watcher ran SCHED_FIFO"
                               if self.watch.realtime else "the hosts files' watcher ran "
                               "without real-time priority: its run-queue waits are in "
                               "the convergence figures")
                        if self.written_ms:  # the last guest's write, by mtime (hostswatch)
                            r.set("convergence_registry_written_p50_ms",
                                  percentile(self.written_ms, 50))
                            r.set("convergence_registry_written_p99_ms",
                                  percentile(self.written_ms, 99))
                    if spaced:
                        r.set("storm_single_restarts_per_member_names", restarts)
                        r.set("storm_single_signals_per_member_names", signals)
                        r.set("storm_restarts_per_member_names", max(storm_restarts, restarts))
                        r.set("storm_signals_per_member_names", max(storm_signals, signals))
                self.sample_rss()
                if "guest" in self.parts:
                    r.set("guest_rss_mb", max(self.peak_rss.values()))
                    r.set("guest_rss_mb_mean", statistics.fmean(self.peak_rss.values()))

                if "convergence" in self.parts:
                    lat = self.dns_changes()
                    r.set("convergence_dns_p50_ms", percentile(lat, 50))
                    r.set("convergence_dns_p95_ms", percentile(lat, 95))
                    r.set("convergence_dns_p99_ms", percentile(lat, 99))
                    r.set("convergence_dns_max_ms", max(lat))

                if "storm" in self.parts:
                    state_files = {vm.vmi: vm.imex_state_file
                                   for vm in self.sbx.vms_of(self.spec)}
                    self.pool.scale(0)
                    wait_for("every VM down", lambda: not self.sbx.vms_of(self.spec), 60)
                    base = _read_counters(state_files)
                    with _guest_mode("ips"):
                        self.boot_storm("ips")
                        self.quiet(SETTLE_TIME + 3.0)
                        self.storm_counts("ips", base)
                        high, low = self.ips_changes()
                        r.set("storm_single_restarts_per_member_ips_max", high)
                        r.set("storm_single_restarts_per_member_ips_min", low)
                        # "1 restart per settled change": the figure furthest from 1.
                        r.set("storm_restarts_per_member_ips",
                              high if abs(high - 1) >= abs(low - 1) else low)
                r.note("sandbox", f"{self.n_vms} VMs, {self.changes} changes per path")
                failed = False
            finally:
                self.watch.close()
                self.ctl.close()
                r.set("convergence_missed", len(self.missed))
                if self.missed:
                    r.note("convergence_missed", "; ".join(self.missed[:5]))
        if failed or self.keep:
            r.note("sandbox_workdir", f"kept for its logs: {sbx.workdir}")
        else:
            shutil.rmtree(sbx.workdir, ignore_errors=True)


def _read_counters(files: dict[str, Path]) -> dict[str, tuple[int, int]]:
    """(starts, SIGUSR1 received) from IMEX stand-in state files (VMs may be down)."""
    out = {}
    for vmi, path in files.items():
        try:
            st = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        out[vmi] = (int(st.get("starts", 0)), int(st.get("signals_received", 0)))
    return out


def run(results: Results, *, quick: bool = False, parts: set[str] | None = None) -> None:
    Bench(results, quick, parts or {"convergence", "storm", "guest"}).run()
