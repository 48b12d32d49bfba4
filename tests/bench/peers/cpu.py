"""Where the CPU goes during a measured window, by component, read from ``/proc``.

Why: on this 2-core machine every VM's processes share the same cores, so a side's
latency includes waiting for CPU that a real rack (one tray per VM) would not share. A
replacement's window (t0 -> every peer CONNECTED) is therefore also charged in CPU
seconds per component: IMEX stand-ins, guest agents (with the ``nvidia-imex-ctl``
stand-ins they run and wait for: their ``cutime``/``cstime``), floor probes, the host
agent, kube-apiserver, etcd, the controller manager and CoreDNS. Sampling is from
outside (``/proc/<pid>/stat``), never from inside the process measured. A process that
exits inside the window loses the CPU it used there; the window is short and the
processes measured outlive it, so this errs low.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Mapping
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK")

#: (substring of the command line, component), first match wins
CATEGORIES: tuple[tuple[str, str], ...] = (
    ("guest_agent.cli", "guest agents (+ their imex-ctl)"),
    ("imex_ctl", "imex-ctl stand-ins"),
    ("nvidia-imex-ctl", "imex-ctl stand-ins"),  # the native ctl, before its daemon's name
    ("imex_standin", "IMEX stand-ins"),
    ("nvidia-imex", "IMEX stand-ins"),
    ("recipe_boot.py", "IMEX stand-ins"),  # it execs into IMEX
    ("floor_probe.py", "floor probes"),
    ("systemd-resolved", "systemd-resolved"),
    ("imex-host-agent", "host agent"),
    ("kube-apiserver", "kube-apiserver"),
    ("etcd", "etcd"),
    ("kube-controller-manager", "kube-controller-manager"),
    ("coredns", "CoreDNS"),
)


def classify(cmdline: str) -> str | None:
    for needle, name in CATEGORIES:
        if needle in cmdline:
            return name
    return None


def stat_seconds(stat: str, children: bool) -> float:
    """utime + stime (+ cutime + cstime) of a ``/proc/<pid>/stat`` line, in seconds."""
    fields = stat[stat.rindex(")") + 2:].split()
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / CLK_TCK


Snapshot = dict[int, tuple[str, float]]  # pid -> (component, cpu seconds so far)


def snapshot(pids: Iterable[int]) -> Snapshot:
    out: Snapshot = {}
    for pid in set(pids):
        with contextlib.suppress(OSError, ValueError, IndexError):
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(
                errors="replace")
            name = classify(cmd)
            if name is None or cmd.startswith(("ip netns exec", "unshare ", "sh -c")):
                continue  # wrappers: what they exec is counted under its own pid
            out[pid] = (name, stat_seconds(Path(f"/proc/{pid}/stat").read_text(),
                                           children=name.startswith("guest agents")))
    return out


def delta(before: Snapshot, after: Snapshot) -> dict[str, float]:
    """CPU seconds per component between two snapshots (new processes count whole)."""
    out: dict[str, float] = {}
    for pid, (name, cpu) in after.items():
        prev = before.get(pid)
        used = cpu - prev[1] if prev is not None and prev[0] == name else cpu
        out[name] = out.get(name, 0.0) + max(0.0, used)
    return out


def add(total: dict[str, float], part: Mapping[str, float]) -> None:
    for k, v in part.items():
        total[k] = total.get(k, 0.0) + v
