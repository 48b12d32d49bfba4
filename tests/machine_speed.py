"""How fast this machine is right now, for CI's log: ``python3 -m tests.machine_speed``.

A stage time means little without the machine's speed beside it. On this 2-core machine
kind the same tree's guests once booted 1.7 times slower than the day before (``make
vmtest`` 817 s, then 1,496 s: same image, same commit, nothing else running), and the same
tree's CI runs have taken 3,475 s and 4,277 s. The kernel shows no cause (``st`` in top
stayed near 0 through the slow run), so .ci/run prints this at its start and at its end:
the best of three runs of a fixed pure-Python loop on one core, and the load.
Standard library only: CI runs it with the ``python3`` on PATH, outside any venv.
"""

from __future__ import annotations

import os
import sys
import time

#: integer additions per run: 0.34-0.40 s on an idle core of this machine kind (pyenv's
#: 3.11.7), long enough that a timer's resolution does not matter
STEPS = 5_000_000


def loop_seconds(steps: int = STEPS, runs: int = 3) -> float:
    """The fastest of ``runs`` timings of ``steps`` additions (the least disturbed one)."""
    best = float("inf")
    for _ in range(runs):
        t0 = time.perf_counter()
        total = 0
        for i in range(steps):
            total += i
        best = min(best, time.perf_counter() - t0)
    return best


def describe(seconds: float, load: tuple[float, float, float], steps: int = STEPS) -> str:
    """The line CI prints."""
    return (f"machine speed: {seconds:.2f} s for {steps:,} Python additions on one core "
            f"(best of 3, lower is faster); load average {load[0]:.2f} {load[1]:.2f} "
            f"{load[2]:.2f}")


def main(argv: list[str]) -> int:
    prefix = argv[0] if argv else ""
    print(prefix + describe(loop_seconds(), os.getloadavg()), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
