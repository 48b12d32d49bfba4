"""``python -m tests.bench [NAME ...] [--quick] [--profile] [--out PATH]``.

Runs the named benchmarks (default: all, in the order below), prints each
figure beside its goal with PASS/MISS, and writes the results JSON (default
``bench-results.json`` at the repository root; never committed). Every goal
key is always in the file: ``null`` where this run did not measure it.
``--quick`` is a smoke mode (small sizes, seconds not minutes): its figures
say the harness works, not how fast anything is, and are stored under
``*_quick`` keys where they would otherwise be mistaken for the real ones.

The file is rewritten after every figure, so an interrupted run keeps what it
measured. A benchmark that fails is reported (its error in ``_meta.errors``) and the
others still run; the exit status is 1 then, else 0. A missed goal is not a
failure of the harness: the exit status stays 0 and the table says MISS.
The load average before and after each benchmark is recorded, because this
is often a shared machine.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import sys
import time
import traceback
from pathlib import Path

from tests.bench.common import REPO_ROOT, Results, commit, loadavg, machine, table
from tests.machine_speed import loop_seconds

#: name -> (module, what it measures). Order: cheapest / least disruptive first.
BENCHMARKS: dict[str, tuple[str, str]] = {
    "host": ("tests.bench.host_scale", "host agent: 10,000 VMIs sync, updates/s, RSS"),
    "host-real": ("tests.bench.host_scale:run_real",
                  "host agent: the same against a real kube-apiserver and etcd"),
    "fleet": ("tests.bench.fleet_scale", "host agent: 25,200 VMIs in 1,400 ensembles of 18"),
    "fleet-real": ("tests.bench.fleet_scale:run_real",
                   "host agent: the same fleet against a real kube-apiserver and etcd"),
    "registry": ("tests.bench.registry_load", "registry GET/s and 5,000 long-polls"),
    "registry-tls": ("tests.bench.tls_bench", "registry GET/s and long-poll wake-up, HTTP and "
                     "HTTPS side by side in one agent"),
    "standins": ("tests.bench.standin_cost", "IMEX stand-ins alone, 18 on loopback: idle CPU "
                 "and CPU per SIGUSR1"),
    "guest": ("tests.bench.sandbox_bench", "guest agent RSS and CPU, idle and under churn"),
    "convergence": ("tests.bench.sandbox_bench", "18-VM sandbox: change -> every /etc/hosts"),
    "storm": ("tests.bench.sandbox_bench", "18-VM sandbox: IMEX signals/restarts per member"),
    "ha": ("tests.bench.ha_bench", "electing replicas: takeover, handover, rolling upgrade, "
           "API load 3 vs 1, RSS per replica"),
    "ha-memory": ("tests.bench.ha_bench:run_memory", "only the ha part's RSS per replica "
                  "(10,000 VMIs, 3 electing replicas against the API double)"),
    "idle-logs": ("tests.bench.idle_logs", "host agent: INFO lines an idle leader writes per "
                  "hour, over a 10-minute window"),
    "domain": ("tests.bench.domain_bench", "IMEX domain view: aggregation CPU for 1,000 x 18 "
               "reports/10 s, report writes/s, /ui p50 on 32 connections, link drop -> DEGRADED"),
}
#: These share one sandbox (one boot of 18 VMs serves them all): run together.
SANDBOX_PARTS = ("guest", "convergence", "storm")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tests.bench",
        description="Run the benchmarks and compare each figure with its goal.",
        epilog="benchmarks:\n" + "\n".join(f"  {n:<12} {w}" for n, (_, w) in BENCHMARKS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", metavar="NAME", help="benchmarks to run (default: all)")
    p.add_argument("--quick", action="store_true", help="smoke mode: small sizes, few seconds")
    p.add_argument("--profile", choices=("wall", "cpu"), default=None,
                   help="host, registry: profile the agent, wall-clock (pyinstrument, host "
                   "only) or CPU time (cProfile); report in bench-profile-<name>.txt")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench-results.json",
                   help="results file (default: bench-results.json at the repo root)")
    args = p.parse_args(argv)
    unknown = [n for n in args.names if n not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {', '.join(unknown)}; choose from {', '.join(BENCHMARKS)}")
    names = args.names or list(BENCHMARKS)
    parts = {n for n in names if n in SANDBOX_PARTS}
    # The sandbox parts run once, at the place of the first of them.
    runs = [n for n in names if n not in SANDBOX_PARTS or n == min(
        parts, key=names.index, default=n)]

    results = Results(quick=args.quick)
    errors: dict[str, str] = {}
    loads: dict[str, list[float]] = {}
    started = datetime.datetime.now(datetime.UTC)
    tree = commit()
    speed = loop_seconds()  # the figures mean little without it (tests/machine_speed.py)

    def save() -> None:
        meta = {"date": started.isoformat(timespec="seconds"), "quick": args.quick,
                "commit": tree,
                "benchmarks": names, "machine": machine(), "machine_speed_s": speed,
                "loadavg_1min": loads,
                "errors": errors}
        args.out.write_text(json.dumps(results.as_json(meta), indent=2) + "\n")

    results.on_change = save
    for name in runs:
        module_name, what = BENCHMARKS[name]
        if name in SANDBOX_PARTS:
            name = "+".join(n for n in names if n in SANDBOX_PARTS)
            what = "18-VM sandbox: " + ", ".join(BENCHMARKS[n][1].split(": ")[-1]
                                                 for n in names if n in SANDBOX_PARTS)
        print(f"== {name}: {what}{' (quick)' if args.quick else ''}", flush=True)
        before = loadavg()[0]
        t0 = time.monotonic()
        try:
            module_name, _, func = module_name.partition(":")
            module = importlib.import_module(module_name)
            kwargs: dict[str, object] = {"quick": args.quick}
            if name in ("host", "host-real", "registry"):
                kwargs["profile"] = args.profile
            if module_name.endswith("sandbox_bench"):
                kwargs["parts"] = parts
            getattr(module, func or "run")(results, **kwargs)
        except Exception as exc:
            errors[name] = f"{type(exc).__name__}: {exc}"
            traceback.print_exc()
            print(f"!! {name} failed: {errors[name]}", file=sys.stderr, flush=True)
        loads[name] = [before, loadavg()[0]]
        print(f"   {name} took {time.monotonic() - t0:.1f} s; load average "
              f"{before:.1f} -> {loads[name][1]:.1f}", flush=True)

    save()
    print()
    print(table(results))
    for key, text in results.notes.items():
        print(f"note {key}: {text}")
    print(f"\nresults written to {args.out}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
