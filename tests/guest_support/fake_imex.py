"""A minimal IMEX-like child for supervision tests in the root namespace.

It does not resolve names (the full stand-in, tests/sandbox/imex_standin.py, would ask the
machine's resolver for slot names outside a network namespace). It logs one JSON line per
event to ``--log``: ``start`` (with argv), ``usr1``, ``term``; ``--die-after S`` exits 3
after S seconds (a crash), ``--ignore-term`` ignores SIGTERM (to exercise SIGKILL).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--log", required=True)
    p.add_argument("--die-after", type=float, default=0.0)
    p.add_argument("--ignore-term", action="store_true")
    args = p.parse_args()

    def note(event: str) -> None:
        with open(args.log, "a", encoding="utf-8") as f:
            f.write(json.dumps({"event": event, "pid": os.getpid(), "t": time.time()}) + "\n")

    def on_usr1(_signo: int, _frame: object) -> None:
        note("usr1")

    def on_term(_signo: int, _frame: object) -> None:
        note("term")
        if not args.ignore_term:
            sys.exit(0)

    signal.signal(signal.SIGUSR1, on_usr1)
    signal.signal(signal.SIGTERM, on_term)
    note("start")
    deadline = time.monotonic() + args.die_after if args.die_after else None
    while True:
        if deadline is not None and time.monotonic() >= deadline:
            note("crash")
            return 3
        time.sleep(0.05)


if __name__ == "__main__":
    sys.exit(main())
