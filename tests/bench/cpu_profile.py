"""Run the host agent under cProfile with a CPU-time clock; write pstats on exit.

``python -m tests.bench.cpu_profile OUT.pstats <imex-host-agent flags>``

Why besides pyinstrument: pyinstrument samples wall-clock time, and on a
shared, overloaded machine a process spends most of its wall time waiting for
a core, so time lands on whatever frame was running when it was descheduled.
Counting ``time.process_time`` per function shows where the agent's own CPU
goes (deterministic tracing inflates many tiny calls, so read it as a ranking).

SIGUSR2 (which the agent does not use) clears what was counted so far, so a
caller can profile one phase: ``sync_profile --steady`` sends it after the sync.
"""

from __future__ import annotations

import cProfile
import signal
import sys
import time


def main() -> int:
    out, argv = sys.argv[1], sys.argv[2:]
    from host_agent.cli import main as agent_main

    profiler = cProfile.Profile(time.process_time)
    signal.signal(signal.SIGUSR2, lambda _sig, _frame: profiler.clear())
    profiler.enable()
    try:
        code = agent_main(argv)
    finally:
        profiler.disable()
        profiler.dump_stats(out)
    return code


if __name__ == "__main__":
    sys.exit(main())
