"""The guest agents' CPU over spaced single changes in the 18-VM sandbox, alone.

``python -m tests.bench.guest_changes [--changes N] [--py-spy PATH] [--out PATH]
[--quick]`` (root; ``--quick``: 6 VMs and 5 s idle, a smoke of the tool, not a figure).

The sandbox bench's ``guest`` phase, as ``make bench`` runs it with its ``storm`` part
(changes spaced one signal window + 1 s apart), without the other phases: 18 VMs boot,
65 s idle, then ``--changes`` single changes (40 by default, about 6 minutes in all,
where ``make bench`` makes 100 inside its 28-minute sandbox part). For comparing two
trees, run one after the other on one quiet machine.

Why: ``guest_change_cpu_ms`` subtracts an idle rate measured over 65 s in 10 ms
ticks, so its run-to-run spread (about +-1 ms) hides a change of the agent's own cost.
This prints the gross figures beside it, which need no subtraction: the guests' mean
CPU share over the change phase (``guest_churn_cpu_pct``), their user and system
ticks, and the idle share it was net of.

``--py-spy``: a py-spy binary (not a dependency: ``pip install py-spy`` into any
venv); two guests and their IMEX stand-ins are sampled at 200 Hz over the change phase
(``-spyN.txt``, ``-spy-standinN.txt``; a stand-in that restarts ends its sample) with
``--gil`` (only
while holding the GIL: Python's own CPU, not waits), raw stacks written beside
``--out``. A frame's share is then an upper bound on its CPU: a guest preempted
while it holds the GIL (after a fork, or a signal that wakes a stand-in) still counts.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.bench.common import REPO_ROOT, Results, commit, cpu_ticks, loadavg, stop, tree_pids
from tests.bench.sandbox_bench import Bench
from tests.bench.sandbox_cpu import is_standin

SHOWN = ("guest_change_cpu_ms", "guest_ctl_cpu_ms_per_change", "standin_cpu_ms_per_change",
         "guest_churn_cpu_pct", "guest_idle_cpu_pct_mean", "guest_rss_mb")


class ChangeBench(Bench):
    """Bench with spaced changes whatever the parts, and the phase's CPU ticks kept."""

    def __init__(self, results: Results, changes: int, spy: str | None, out: Path,
                 quick: bool = False) -> None:
        super().__init__(results, quick=quick, parts={"guest"})
        self.changes = changes
        self.spy = spy
        self.out = out
        self.ticks: tuple[int, int] = (0, 0)

    def guest_ticks(self) -> tuple[int, int]:
        """(user, system) clock ticks of every running guest agent, summed."""
        user = system = 0
        for pid in self.guest_pids().values():
            with contextlib.suppress(OSError):
                u, s = cpu_ticks(pid)
                user, system = user + u, system + s
        return user, system

    def registry_changes(self, spaced: bool) -> tuple[list[float], float, float]:
        spies: list[subprocess.Popen[bytes]] = []
        if self.spy is not None:
            guests = list(self.guest_pids().values())[:2]
            standins = [pid for g in guests for pid in tree_pids(g)[1:] if is_standin(pid)]
            for n, pid in enumerate(guests + standins):
                kind = "spy" if n < len(guests) else "spy-standin"
                raw = self.out.with_name(f"{self.out.stem}-{kind}{n}.txt")
                spies.append(subprocess.Popen(
                    [self.spy, "record", "-p", str(pid), "-r", "200", "-f", "raw", "--gil",
                     "--nonblocking", "-o", str(raw)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        before = self.guest_ticks()
        try:
            return super().registry_changes(True)
        finally:
            after = self.guest_ticks()
            self.ticks = (after[0] - before[0], after[1] - before[1])
            for spy in spies:
                stop(spy, 30, sig=signal.SIGINT)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.guest_changes")
    p.add_argument("--changes", type=int, default=40)
    p.add_argument("--py-spy", dest="spy", default=None, metavar="PATH")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "test-artifacts" / "guest-changes.json")
    p.add_argument("--quick", action="store_true")
    args = p.parse_args(argv)
    if args.changes < 1:
        p.error("--changes must be at least 1")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    results = Results()
    load = loadavg()[0]
    bench = ChangeBench(results, args.changes, args.spy, args.out, args.quick)
    bench.run()
    doc: dict[str, Any] = {
        "commit": commit(), "changes": args.changes, "vms": bench.n_vms,
        "loadavg_1min": [load, loadavg()[0]],
        "guest_ticks_user_system": list(bench.ticks),
        "figures": {k: results.figures.get(k) for k in SHOWN}, "notes": results.notes}
    args.out.write_text(json.dumps(doc, indent=2) + "\n")
    for key in SHOWN:
        print(f"{key:32s} {results.figures.get(key)}")
    print(f"{'guest ticks (user, system)':32s} {bench.ticks[0]}, {bench.ticks[1]}")
    for key in ("sandbox_cpu_per_change", "imex_standins"):
        print(f"{key}: {results.notes.get(key)}")
    print(f"written to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
