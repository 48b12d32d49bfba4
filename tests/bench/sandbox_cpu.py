"""CPU per change in the 18-VM sandbox, by process, read from ``/proc`` (issue 27).

Why: with 18 VMs on two cores a change's latency is mostly waiting for a core behind
other processes, and most of those are stand-ins (the IMEX daemon stand-ins, the
``nvidia-imex-ctl`` stand-in each guest runs), which a real rack does not share and
whose cost is not the product's. So each change is also charged in CPU, per kind of
process, and the guest agent's own share is a goal of its own
(``guest_change_cpu_ms``).

A ``Ledger`` is sampled at the start of a phase, after each change and at the end:

- the guest agent's own CPU (utime + stime) and its reaped children's (cutime +
  cstime: every ``nvidia-imex-ctl`` query it ran and waited for, and any IMEX stand-in
  it restarted and reaped);
- every IMEX stand-in process in each VM's tree (a process born in the window counts
  from 0; one that died counts up to its last sample, and its whole CPU, which then
  lands in the guest's cutime, is taken out of the ctl figure);
- the host agent, and this harness process (the API double, the DNS stand-in and the
  hosts-file watch run in its threads).

Errs low for a process that dies between samples (its CPU after the last sample), and
the guest figures include whatever else the guest did in the window (its heartbeat
reports, DNS standby polls), and the stand-ins' whatever theirs did (a ping to every
peer twice a second): ``idle`` (CPU-seconds per second per guest and per stand-in, from
the idle phase) is subtracted when it was measured; the stand-ins' gross figure is
printed beside (``standin_cpu_ms_per_change_gross``).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CLK_TCK = os.sysconf("SC_CLK_TCK")


def stat(pid: int) -> tuple[float, float] | None:
    """(own CPU s, reaped children's CPU s) of ``pid``; None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    f = raw[raw.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / CLK_TCK, (int(f[13]) + int(f[14])) / CLK_TCK


def is_standin(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return (b"imex_standin" in cmd or b"nvidia-imex\0" in cmd) and b"-ctl" not in cmd


@dataclass
class Ledger:
    """CPU by kind of process over a phase (module docstring)."""

    bench: Any
    #: pid -> (first own CPU, last own CPU, first children CPU, last children CPU)
    guests: dict[int, list[float]] = field(default_factory=dict)
    #: pid -> [first, last]
    standins: dict[int, list[float]] = field(default_factory=dict)
    others: dict[str, list[float]] = field(default_factory=dict)
    started: bool = False

    def sample(self) -> None:
        from tests.bench.common import tree_pids
        from tests.bench.sandbox_bench import _guest_pid

        first = not self.started
        self.started = True
        for vm in self.bench.sbx.vms_of(self.bench.spec):
            gpid = _guest_pid(vm)
            if gpid is None:
                continue
            got = stat(gpid)
            if got is not None:
                entry = self.guests.setdefault(gpid, [got[0], got[0], got[1], got[1]])
                entry[1], entry[3] = got
            for pid in tree_pids(gpid)[1:]:
                if pid in self.standins or is_standin(pid):
                    own = stat(pid)
                    if own is not None:
                        self.standins.setdefault(pid, [own[0] if first else 0.0, own[0]])
                        self.standins[pid][1] = own[0]
        host = self.bench.sbx.host_agent
        if host is not None:
            self._other("host agent", host.pid)
        self._other("harness (API double, DNS stand-in, watch)", os.getpid())

    def _other(self, name: str, pid: int) -> None:
        got = stat(pid)
        if got is not None:
            entry = self.others.setdefault(name, [got[0], got[0]])
            entry[1] = got[0]

    def standin_rate(self, seconds: float) -> float:
        """CPU-seconds per second of one stand-in over ``seconds`` (an idle window)."""
        n = max(1, len(self.standins))
        return sum(last - first for first, last in self.standins.values()) / seconds / n

    def per_change(self, changes: int, members: int, seconds: float,
                   idle: tuple[float, float, float] | None) -> dict[str, float]:
        """CPU ms per member per change: guest own, ctl children, stand-ins; and the
        whole sandbox's CPU seconds per change by kind (``*_s_per_change``).

        ``idle``: (own, children, stand-in) CPU-seconds per second of one idle guest and
        one idle stand-in (the stand-ins ping every peer twice a second, idle or not)."""
        live = {pid for pid in self.standins if stat(pid) is not None}
        dead_total = sum(last for pid, (_, last) in self.standins.items() if pid not in live)
        own = sum(e[1] - e[0] for e in self.guests.values())
        kids = sum(e[3] - e[2] for e in self.guests.values()) - dead_total
        standin = sum(last - first for first, last in self.standins.values())
        n = max(1, len(self.guests))
        gross_standin = standin
        if idle is not None:
            own -= idle[0] * seconds * n
            kids -= idle[1] * seconds * n
            standin -= idle[2] * seconds * max(1, len(live))
        per = 1000.0 / (changes * members)
        out = {"guest_change_cpu_ms": max(0.0, own) * per,
               "guest_ctl_cpu_ms_per_change": max(0.0, kids) * per,
               "standin_cpu_ms_per_change": max(0.0, standin) * per,
               "standin_cpu_ms_per_change_gross": gross_standin * per}
        with contextlib.suppress(ZeroDivisionError):
            out["standin_to_guest_cpu_ratio"] = out["standin_cpu_ms_per_change"] / \
                out["guest_change_cpu_ms"]
        for name, (first, last) in self.others.items():
            out[name] = (last - first) / changes
        return out


def guest_cpu(bench: Any) -> dict[str, tuple[float, float]]:
    """vm -> (own CPU s, reaped children's CPU s) of each running guest agent."""
    from tests.bench.sandbox_bench import _guest_pid

    out = {}
    for vm in bench.sbx.vms_of(bench.spec):
        pid = _guest_pid(vm)
        got = stat(pid) if pid is not None else None
        if got is not None:
            out[vm.vmi] = got
    return out


def imex_counts(bench: Any) -> dict[str, tuple[int, int, int]]:
    """vm -> (IMEX starts, outgoing connection attempts, SIGUSR1 acted) from the
    stand-ins' state files."""
    out = {}
    for vm in bench.sbx.vms_of(bench.spec):
        st = vm.imex_state()
        out[vm.vmi] = (int(st.get("starts", 0)),
                       sum(int(v) for v in (st.get("attempts_by_ip") or {}).values()),
                       int(st.get("signals_acted", 0)))
    return out


@dataclass
class ReconnectTally:
    """Outgoing connection attempts per SIGUSR1 acted, per VM, summed over the intervals
    between two samples (``imex_counts``) in which that VM's daemon did not restart.

    Why per interval: a phase of more changes than VMs restarts every VM's stand-in once
    (a changed member's guest restarts its own, by design), and a daemon's counters
    start again at 0; comparing the phase's ends only left no VM to count, and the
    figure read n/a. A restart's own first dials follow no signal, so an interval with a
    restart is left out rather than guessed at (pure: fed the samples)."""

    last: dict[str, tuple[int, int, int]]
    #: vm -> [attempts, signals acted] over its intervals without a restart
    sums: dict[str, list[int]] = field(default_factory=dict)

    def sample(self, now: dict[str, tuple[int, int, int]]) -> None:
        for vm, (starts, attempts, acted) in now.items():
            before = self.last.get(vm)
            if before is not None and before[0] == starts:
                got = self.sums.setdefault(vm, [0, 0])
                got[0] += attempts - before[1]
                got[1] += acted - before[2]
        self.last = now

    def per_signal(self) -> list[float]:
        """Each VM's attempts per signal acted (VMs that acted on none are left out)."""
        return [a / s for a, s in self.sums.values() if s > 0]


def imex_views(bench: Any, tally: ReconnectTally) -> str:
    """What the stand-ins did over the phase, so a cheaper one that does less shows:
    outgoing connection attempts per SIGUSR1 acted (``tally``, sampled over the phase),
    and each VM's ``nvidia-imex-ctl -N -j`` at its end."""
    per_signal = tally.per_signal()
    states: dict[str, int] = {}
    connected: list[int] = []
    loops: set[str] = set()
    for vm in bench.sbx.vms_of(bench.spec):
        loops.add(str(vm.imex_state().get("event_loop")))
        doc = vm.domain()
        states[str(doc.get("status"))] = states.get(str(doc.get("status")), 0) + 1
        own = (doc.get("nodes") or {}).get(str(vm.imex_state().get("node_id")))
        if isinstance(own, dict) and own.get("connections"):
            connected.append(sum(1 for c in own["connections"].values()
                                 if c.get("status") == "CONNECTED"))
    recon = (f"{min(per_signal):.1f}-{max(per_signal):.1f}" if per_signal else "n/a")
    links = f"{min(connected)}-{max(connected)}" if connected else "n/a"
    daemon = ", ".join("native (imex_standin.c)" if x == "c" else f"Python on {x}"
                       for x in sorted(loops))
    return (f"IMEX stand-ins ({daemon}): outgoing connection attempts per SIGUSR1 acted {recon} "
            f"(peers: {len(bench.sbx.vms_of(bench.spec)) - 1}); nvidia-imex-ctl -N -j "
            f"domain status {dict(sorted(states.items()))}, CONNECTED links per node {links}")
