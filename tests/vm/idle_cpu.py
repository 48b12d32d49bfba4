"""Where an idle guest's CPU goes: ``.venv/bin/python -m tests.vm.idle_cpu`` (root, ~12 min).

Boots ``--vms`` guests with the VM harness (the generated user-data, our agent, the IMEX
stand-in), waits until each runs its agent, lets them settle, then reads over one window:

- each qemu process's CPU (``utime + stime`` of ``/proc/<pid>/stat``), as a share of one
  host core: what an idle TCG guest costs the machine the tests run on;
- inside each guest (through qemu-ga), ``/proc/stat``: how busy the guest was, and how
  many processes it started (``processes``), less the probe's own two reads.

It prints one line per guest and writes ``test-artifacts/idle-cpu.json``. The figures in
tests/vm/README.md ("Where an idle guest's CPU goes") come from it. The harness cleans up
its namespace, taps and processes on exit, as in the vm tier.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from tests.bench.sandbox_cpu import stat
from tests.vm.harness import HarnessSettings, harness
from tests.vm.observe import Guest

REPO = Path(__file__).resolve().parents[2]
OUT = REPO / "test-artifacts" / "idle-cpu.json"


def host_cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` in seconds (:func:`tests.bench.sandbox_cpu.stat`)."""
    got = stat(pid)
    if got is None:
        raise RuntimeError(f"process {pid} is gone")
    return got[0]


def parse_proc_stat(text: str) -> tuple[int, int, int]:
    """Pure: (busy jiffies, all jiffies, processes started) from a ``/proc/stat``."""
    busy = total = forks = 0
    for line in text.splitlines():
        words = line.split()
        if words and words[0] == "cpu":
            ticks = [int(w) for w in words[1:]]
            total = sum(ticks[:8])
            busy = total - ticks[3] - ticks[4]  # less idle and iowait
        elif words and words[0] == "processes":
            forks = int(words[1])
    return busy, total, forks


def guest_stat(g: Guest) -> tuple[int, int, int]:
    """:func:`parse_proc_stat` of the guest's ``/proc/stat``, read through qemu-ga."""
    return parse_proc_stat(g.machine.qga.read_file("/proc/stat", timeout=60).decode())


def measure(g: Guest, window: float) -> dict[str, float]:
    assert g.machine.proc is not None
    pid = g.machine.proc.pid
    g0, c0, t0 = guest_stat(g), host_cpu_s(pid), time.monotonic()
    time.sleep(window)
    g1, c1, t1 = guest_stat(g), host_cpu_s(pid), time.monotonic()
    seconds = t1 - t0
    minutes = seconds / 60
    return {"seconds": round(seconds, 1),
            "qemu_core_pct": round(100 * (c1 - c0) / seconds, 1),
            "guest_busy_pct": round(100 * (g1[0] - g0[0]) / max(1, g1[1] - g0[1]), 1),
            # the probe's second read of /proc/stat is one of them
            "guest_forks_per_min": round((g1[2] - g0[2] - 1) / minutes, 1)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.vm.idle_cpu", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--vms", type=int, default=1, help="guests to boot (default 1)")
    ap.add_argument("--settle", type=float, default=120.0,
                    help="seconds between the agents running and the window (default 120)")
    ap.add_argument("--window", type=float, default=60.0, help="seconds measured (default 60)")
    ap.add_argument("--guest", default="debian-12-amd64", help="guest OS (default %(default)s)")
    args = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("idle_cpu: needs root (network namespace, tap devices)", file=sys.stderr)
        return 2
    if not 1 <= args.vms <= 4 or args.settle < 0 or not 10 <= args.window <= 600:
        print("idle_cpu: --vms 1-4, --settle >= 0, --window 10-600", file=sys.stderr)
        return 2
    settings = HarnessSettings(vms=args.vms, boot_timeout=2400,
                               guests=(args.guest,) * args.vms)
    rows = []
    with harness(settings) as h:
        h.boot(list(range(args.vms)))
        time.sleep(args.settle)
        for i in range(args.vms):
            row = {"guest": i, "os": args.guest, **measure(h.guests[i], args.window)}
            rows.append(row)
            print(f"idle_cpu: guest {i} ({args.guest}): qemu {row['qemu_core_pct']} % of a "
                  f"host core; guest busy {row['guest_busy_pct']} %, "
                  f"{row['guest_forks_per_min']} processes started a minute", flush=True)
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"settle_s": args.settle, "window_s": args.window,
                               "guests": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
