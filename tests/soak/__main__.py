"""``python -m tests.soak --duration SECONDS --seed N [--vms N]``: the soak (issue 30).

Prints the seed and the schedule's size first, the per-kind table and the violations
last, and writes ``soak-results.json`` at the repository root (``--results``). Exit 0
only without a violation; 1 with one (the replay command is printed); 2 on bad
arguments or a rack that could not be built. ``--seeds-file`` with ``--commit`` runs the
CI's set one after another: the commit's seed (its first 8 hex digits), then every seed
of the list. Needs root (network namespaces, tmpfs, nftables).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.sandbox.ensemble import REPO_ROOT, SandboxSettings
from tests.soak import schedule as sch
from tests.soak.rack import SoakRack
from tests.soak.runner import Run, format_table, write_results

log = logging.getLogger("soak")


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tests.soak", description=__doc__.split("\n")[0])
    p.add_argument("--duration", type=float, default=3600.0, help="seconds (default 3600)")
    p.add_argument("--seed", help="decimal or 0x-hex (default: drawn and printed)")
    p.add_argument("--vms", type=int, default=18, help="VMs over the two ensembles")
    p.add_argument("--rate-scale", type=float, default=1.0,
                   help="multiplies every kind's rate (per hour, schedule.py)")
    p.add_argument("--kinds", help="comma-separated fault kinds (default: all)")
    p.add_argument("--check-every", type=float, default=120.0,
                   help="seconds of schedule between two quiesces (default 120)")
    p.add_argument("--quiesce", type=float, default=90.0,
                   help="the most seconds a quiesce waits for convergence (default 90)")
    p.add_argument("--results", type=Path, default=REPO_ROOT / "soak-results.json")
    p.add_argument("--commit", help="CI: a commit whose first 8 hex digits are a seed")
    p.add_argument("--seeds-file", type=Path, help="CI: then every seed of this list")
    p.add_argument("--keep", action="store_true", help="keep the work directory")
    return p


def replay_command(a: argparse.Namespace, seed: int) -> str:
    extra = f" --kinds {a.kinds}" if a.kinds else ""
    extra += f" --rate-scale {a.rate_scale:g}" if a.rate_scale != 1.0 else ""
    return (f"sudo .venv/bin/python -m tests.soak --seed {seed} --duration {a.duration:g} "
            f"--vms {a.vms} --check-every {a.check_every:g} --quiesce {a.quiesce:g}{extra}")


def run_one(a: argparse.Namespace, seed: int, kinds: list[str] | None) -> int:
    lay = sch.layout(a.vms)
    faults = sch.draw(seed, a.duration, lay, a.rate_scale, kinds)
    print(f"soak: seed {seed} (0x{seed:x}), {a.duration:g} s, {a.vms} VMs {lay.sizes}, "
          f"{len(faults)} faults scheduled, quiesce every {a.check_every:g} s "
          f"(at most {a.quiesce:g} s)", flush=True)
    workdir = Path(tempfile.mkdtemp(prefix="imex-soak-"))
    settings = SandboxSettings(prefix="soak", workdir=workdir / "sbx", keep_workdir=a.keep,
                               report_interval=5.0)
    rack = SoakRack(lay, settings)
    t0 = time.monotonic()
    run: Run | None = None
    try:
        try:
            rack.start(workdir / "soak")
        except Exception as e:
            print(f"soak: the rack did not come up: {e}", file=sys.stderr)
            return 2
        print(f"soak: rack up in {time.monotonic() - t0:.0f} s (work dir {workdir})",
              flush=True)
        run = Run(rack, seed, a.duration, faults, a.check_every, a.quiesce,
                  replay_command(a, seed))
        run.run()
    finally:
        rack.close()
        if run is not None:
            res = run.results(time.monotonic() - t0, a.vms)
            write_results(a.results, res)
            print(format_table(res))
            print(f"audit: {res['audit']}; reads checked: {res['reads']}; generations "
                  f"delivered {res['generations']['delivered']}, checked "
                  f"{res['generations']['checked']}; IMEX ends checked {res['imex_ends']}; "
                  f"pin changes resolved {res['signals']['met']}, lost "
                  f"{res['signals']['lost']}, unjudged {res['signals']['unjudged']}; "
                  f"quiesces: {res['quiesces']} (p50 {res['quiesce_p50_s']} s)"
                  + (f"; not checked: {', '.join(f'{k} ({v})' for k, v in nc.items())}"
                     if (nc := res['not_checked']) else ""))
            print(f"violations: {len(run.violations)}")
            for v in run.violations:
                print(f"  invariant {v.invariant} at {v.t} s: {v.what}")
            if run.violations:
                print(f"replay: {run.replay}")
                # what the replicas and guests last said, so a failed CI run can be read
                # without the work dir (gone by then); the test shows this block
                print(f"{LOGS_BEGIN}\n{run.violations[0].logs[-LOGS_MAX:]}\n{LOGS_END}")
            print(f"results: {a.results}; wall {res['wall_s']} s", flush=True)
        if not a.keep:
            shutil.rmtree(workdir, ignore_errors=True)
    return 1 if run is None or run.violations else 0


#: the first violation's log tails, printed between these lines (test_soak_ci.py)
LOGS_BEGIN = "--- logs at the first violation ---"
LOGS_END = "--- end of the logs ---"
LOGS_MAX = 12_000


def main(argv: list[str] | None = None) -> int:
    a = _parser().parse_args(argv)
    logging.basicConfig(level=logging.ERROR, format="%(asctime)s %(name)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("soak").setLevel(logging.INFO)
    if os.geteuid() != 0:
        print("soak: needs root (network namespaces, tmpfs, nftables)", file=sys.stderr)
        return 2
    try:
        kinds = [k.strip() for k in a.kinds.split(",")] if a.kinds else None
        bad = [k for k in kinds or () if k not in sch.BY_NAME]
        if bad:
            raise ValueError(f"--kinds: unknown {bad}; known: {', '.join(sch.KIND_NAMES)}")
        seeds: list[int] = []
        if a.commit:
            seeds.append(sch.commit_seed(a.commit))
        if a.seeds_file:
            seeds += sch.read_seed_list(a.seeds_file.read_text())
        if a.seed is not None:
            seeds.append(sch.parse_seed(a.seed))
        if not seeds:
            seeds.append(int.from_bytes(os.urandom(4), "big"))
        sch.layout(a.vms)
    except (ValueError, OSError) as e:
        print(f"soak: {e}", file=sys.stderr)
        return 2
    code = 0
    for seed in seeds:
        code = max(code, run_one(a, seed, kinds))
    return code


def head_commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=REPO_ROOT, check=True).stdout


if __name__ == "__main__":
    sys.exit(main())
