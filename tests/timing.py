"""Wall-clock bounds in tests: record what they measure, and measure their slack.

    python -m tests.timing measure --runs 20 [--stress] --log FILE -- PYTEST ARGS...
    python -m tests.timing summary FILE...

A test that keeps a wall-clock upper bound (tests/README.md "Timing in tests") passes the
value it compares through :func:`measured`, which returns it unchanged and, when
``IMEX_TIMING_LOG`` names a file, appends it there as one JSON line. ``measure`` runs a
pytest selection ``--runs`` times in a row, quiet or beside the load ``make stress-check``
uses (``stress-ng --cpu 2 --vm 1 --vm-bytes 2G``, its process group killed at the end),
logging every value and every run's exit status (each run's output kept beside the log).
``summary`` prints, per bound and load, the count, minimum, median, 95th percentile and
maximum, and the runs that failed with the tests that failed in them: the figures a
bound's comment quotes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from tests.stress_check import LOAD, ROOT


def measured(name: str, seconds: float) -> float:
    """``seconds`` unchanged; logged under ``name`` when ``IMEX_TIMING_LOG`` is set."""
    path = os.environ.get("IMEX_TIMING_LOG")
    if path:
        line = {"bound": name, "s": round(seconds, 4),
                "load": os.environ.get("IMEX_TIMING_LOAD", "quiet")}
        with open(path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
    return seconds


def _failed_tests(output: str) -> list[str]:
    return sorted(set(re.findall(r"^(?:FAILED|ERROR) (\S+)", output, re.MULTILINE)))


def measure(runs: int, stress: bool, log: Path, pytest_args: list[str]) -> int:
    load_name = "stress" if stress else "quiet"
    env = {**os.environ, "IMEX_TIMING_LOG": str(log.resolve()), "IMEX_TIMING_LOAD": load_name}
    load = None
    if stress:
        if shutil.which(LOAD[0]) is None:
            print("timing: stress-ng is not installed (apt-get install stress-ng)",
                  file=sys.stderr)
            return 2
        load = subprocess.Popen(LOAD, start_new_session=True, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
    failures = 0
    try:
        for run in range(1, runs + 1):
            t0 = time.monotonic()
            proc = subprocess.run(
                [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE",
                 *pytest_args], cwd=ROOT, env=env, capture_output=True, text=True, check=False)
            took = time.monotonic() - t0
            out = log.with_name(f"{log.name}.{load_name}-{run}.out")
            out.write_text(proc.stdout + proc.stderr, encoding="utf-8")
            failed = _failed_tests(proc.stdout)
            failures += proc.returncode != 0
            with log.open("a", encoding="utf-8") as f:
                f.write(json.dumps({"run": run, "load": load_name, "exit": proc.returncode,
                                    "failed": failed, "seconds": round(took, 1),
                                    "loadavg": os.getloadavg()[0]}) + "\n")
            tail = proc.stdout.strip().splitlines()[-1:] or ["(no output)"]
            print(f"timing: run {run}/{runs} ({load_name}): exit {proc.returncode} "
                  f"in {took:.0f} s: {tail[0]}", flush=True)
            if proc.returncode != 0:
                print(f"timing: failed: {', '.join(failed)} (output in {out})", flush=True)
    finally:
        if load is not None:
            os.killpg(load.pid, signal.SIGKILL)
            load.wait()
    return 1 if failures else 0


def summary(paths: list[Path]) -> int:
    values: dict[tuple[str, str], list[float]] = {}
    runs: dict[str, list[dict[str, object]]] = {}
    for path in paths:
        for line in path.read_text(encoding="utf-8").splitlines():
            rec = json.loads(line)
            if "bound" in rec:
                values.setdefault((rec["bound"], rec["load"]), []).append(float(rec["s"]))
            else:
                runs.setdefault(str(rec["load"]), []).append(rec)
    print(f"{'bound':<44} {'load':<7} {'n':>4} {'min':>8} {'median':>8} {'p95':>8} "
          f"{'max':>8}")
    for (name, load), vs in sorted(values.items()):
        vs.sort()
        p95 = vs[min(len(vs) - 1, round(0.95 * (len(vs) - 1)))]
        print(f"{name:<44} {load:<7} {len(vs):>4} {vs[0]:>8.3f} {statistics.median(vs):>8.3f} "
              f"{p95:>8.3f} {vs[-1]:>8.3f}")
    for load, rs in sorted(runs.items()):
        bad = [r for r in rs if r["exit"] != 0]
        print(f"runs ({load}): {len(rs)}, failed {len(bad)}")
        for r in bad:
            print(f"  run {r['run']}: exit {r['exit']}: {', '.join(r['failed'])}")  # type: ignore[arg-type]
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.timing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    m = sub.add_parser("measure", help="run a pytest selection N times, quiet or loaded")
    m.add_argument("--runs", type=int, default=20)
    m.add_argument("--stress", action="store_true", help="beside make stress-check's load")
    m.add_argument("--log", type=Path, required=True, help="JSON lines appended here")
    m.add_argument("pytest_args", nargs="+", help="after --: what pytest runs")
    s = sub.add_parser("summary", help="median, p95 and max per bound and load")
    s.add_argument("logs", type=Path, nargs="+")
    args = parser.parse_args(argv)
    if args.command == "measure":
        return measure(args.runs, args.stress, args.log, args.pytest_args)
    return summary(args.logs)


if __name__ == "__main__":
    raise SystemExit(main())
