"""The test tiers under load: each run beside ``stress-ng`` (``make stress-check``).

    python -m tests.stress_check [--runs N] [--jobs test,realk8s] [--once vmtest,...]

A test that passes on a quiet machine and fails on a loaded one is a defect (its timing
assumption was wrong), so CI's tiers are run here on purpose next to
``stress-ng --cpu 2 --vm 1 --vm-bytes 2G`` (Debian's package), the method
tests/README.md "Under load" describes. ``--jobs`` run ``--runs`` times each (default:
make test and the realk8s tier, three times), ``--once`` jobs once (default: vmtest, the
two smokes side by side as CI runs them, chroottest). Every run is one row of
``test-artifacts/stress-check.md``: date, commit, job, result, counts and seconds. The
load is started before and stopped after each run, its whole process group killed.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "test-artifacts" / "stress-check.md"
LOAD = ["stress-ng", "--cpu", "2", "--vm", "1", "--vm-bytes", "2G", "--quiet"]

#: job -> (command, the tier summaries it writes)
JOBS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "test": (["make", "test"], ("test",)),
    "realk8s": (["make", "realk8s"], ("realk8s",)),
    "vmtest": (["make", "vmtest"], ("vmtest",)),
    "vm-smokes": (["bash", "-c",
                   'IMEX_TIER_LABEL=arm64 IMEX_VM_GUESTS=debian-12-arm64 IMEX_VM_MEMORY=1024 '
                   'make vmtest-matrix VMTEST_ARGS="-k one_peer" & a=$!; '
                   'IMEX_TIER_LABEL=trixie IMEX_VM_GUESTS=debian-13-amd64 make vmtest-matrix '
                   'VMTEST_ARGS="-k one_peer" & t=$!; '
                   'wait $a; ra=$?; wait $t; rt=$?; [ $ra -eq 0 ] && [ $rt -eq 0 ]'],
                  # labelled as in .ci/run: one summary each (tests/skips.py)
                  ("vmtest-matrix-arm64", "vmtest-matrix-trixie")),
    "chroottest": (["make", "chroottest"], ("chroottest",)),
}


def commit() -> str:
    out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                         capture_output=True, text=True, check=False)
    return out.stdout.strip() or "unknown"


def counts(tiers: tuple[str, ...]) -> str:
    parts = []
    for tier in tiers:
        path = ROOT / "test-artifacts" / "tiers" / f"{tier}.json"
        try:
            doc = json.loads(path.read_text())
            c = doc["counts"]
        except (OSError, ValueError, KeyError):
            parts.append(f"{tier}: no summary")
            continue
        failed = "".join(f" ({f['when']}) {f['test']}" for f in doc.get("failures", []))
        parts.append(f"{tier}: {c['passed']} passed, {c['failed'] + c['error']} failed"
                     f"{':' + failed if failed else ''}, {c['skipped']} skipped")
    return "; ".join(parts)


def run_loaded(job: str) -> tuple[int, float]:
    command, tiers = JOBS[job]
    for tier in tiers:  # a summary from an earlier run must not pass for this one
        (ROOT / "test-artifacts" / "tiers" / f"{tier}.json").unlink(missing_ok=True)
    load = subprocess.Popen(LOAD, start_new_session=True, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    t0 = time.monotonic()
    try:
        code = subprocess.run(command, cwd=ROOT, check=False).returncode
    finally:
        os.killpg(load.pid, signal.SIGKILL)
        load.wait()
    return code, time.monotonic() - t0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.stress_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--jobs", default="test,realk8s")
    parser.add_argument("--once", default="vmtest,vm-smokes,chroottest")
    args = parser.parse_args(argv)
    if shutil.which("stress-ng") is None:
        print("stress-check: stress-ng is not installed (apt-get install stress-ng)",
              file=sys.stderr)
        return 2
    plan = [j for j in args.jobs.split(",") if j for _ in range(args.runs)]
    plan += [j for j in args.once.split(",") if j]
    unknown = sorted(set(plan) - set(JOBS))
    if unknown:
        print(f"stress-check: unknown jobs {unknown}; known: {', '.join(JOBS)}",
              file=sys.stderr)
        return 2
    OUT.parent.mkdir(parents=True, exist_ok=True)
    if not OUT.exists():
        OUT.write_text("| date | commit | job | result | counts | seconds |\n"
                       "|---|---|---|---|---|---|\n")
    failed = 0
    for job in plan:
        code, took = run_loaded(job)
        failed += code != 0
        row = (f"| {dt.date.today().isoformat()} | {commit()} | {job} | "
               f"{'pass' if code == 0 else f'FAIL (exit {code})'} | "
               f"{counts(JOBS[job][1])} | {took:.0f} |")
        with OUT.open("a") as f:
            f.write(row + "\n")
        print(f"stress-check: {row}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
