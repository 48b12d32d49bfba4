"""Profile the host agent's first sync alone: 10,000 VMIs in 1,000 ensembles.

``python -m tests.bench.sync_profile [--plain] [--steady] [--out PATH]``

The ``host`` benchmark's ``--profile cpu`` covers its whole run (sync, 20,000
updates, restarts), in which the sync is a small part. This starts the same API
double and agent, stops at the moment the last slice holds its members, and
writes the top lines by own and by cumulative CPU time (cProfile with a CPU-time
clock, ``cpu_profile``). ``--plain`` runs the agent without the profiler and
prints only the sync's wall and CPU seconds, which the profiler would inflate.

``--timeline`` (with ``--plain``) samples the agent's and the API double's CPU every
0.25 s through the sync and prints them as a table: where the wall time goes, and
which of the two processes the sync waited on in each phase (issue 27).

``--steady`` profiles the phase after the sync instead: the ``host`` benchmark's
10,000 steady updates (the profile is cleared with SIGUSR2 once the sync is done),
and prints the CPU per update and the writes per update.
"""

from __future__ import annotations

import argparse
import io
import os
import pstats
import signal
import tempfile
import threading
import time
from pathlib import Path

from tests.bench import host_writes
from tests.bench.common import PY, REPO_ROOT, cpu_seconds, free_port, spawn, stop
from tests.bench.host_scale import ApiTarget, _send, _updates, api_double, expected_pins
from tests.bench.kube_proc import NAMESPACE, member_ip
from tests.bench.slicewatch import SliceWatch

ENSEMBLES, PER = 1000, 10


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", action="store_true", help="no profiler: wall and CPU only")
    p.add_argument("--timeline", action="store_true",
                   help="sample the agent's and the double's CPU every 0.25 s (with --plain)")
    p.add_argument("--steady", action="store_true",
                   help="profile the steady updates after the sync, not the sync")
    p.add_argument("--out", type=Path, default=None,
                   help="default: bench-profile-sync.txt (bench-profile-steady.txt)")
    args = p.parse_args(argv)
    out = args.out or REPO_ROOT / ("bench-profile-steady.txt" if args.steady
                                   else "bench-profile-sync.txt")
    with tempfile.TemporaryDirectory(prefix="bench-sync-") as tmp:
        work = Path(tmp)
        with api_double(work, ENSEMBLES, PER, work / "api.log") as target:
            watch = SliceWatch(target.url, target.token, NAMESPACE, target.ca).start()
            try:
                ips = {(e, i): member_ip(e, i) for e in range(ENSEMBLES) for i in range(PER)}
                watch.expect(expected_pins(ENSEMBLES, PER, ips))
                pstats_path = work / "sync.pstats"
                flags = ["--kubeconfig", str(target.kubeconfig),
                         "--listen", f"127.0.0.1:{free_port()}", "--log-level", "WARNING"]
                argv_ = [PY, "-m", "host_agent.cli", *flags] if args.plain else \
                    [PY, "-m", "tests.bench.cpu_profile", str(pstats_path), *flags]
                double0 = cpu_seconds(target.pid) if target.pid is not None else 0.0
                started = time.monotonic()
                agent = spawn(argv_, log=work / "agent.log")
                sampler = CpuTimeline(started, {"agent": agent.pid, "double": target.pid},
                                      {"double": double0}) if args.timeline else None
                try:
                    wall = watch.wait(f"{ENSEMBLES} slices", timeout=600) - started
                    cpu = cpu_seconds(agent.pid)
                    timeline = sampler.stop() if sampler is not None else ""
                    if args.steady:
                        what = _steady(work, target, watch, agent.pid, ips, args.plain)
                finally:
                    stop(agent, timeout=60)
            finally:
                watch.close()
        print(f"sync of {ENSEMBLES * PER} VMIs: {wall:.2f} s wall, {cpu:.2f} s agent CPU"
              + ("" if args.plain else " (under cProfile)"))
        if args.timeline:
            print(timeline)
        if args.steady:
            print(what)
        if not args.plain:
            text = io.StringIO()
            stats = pstats.Stats(str(pstats_path), stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
            # who calls the builtins at the top of the own-time list (isinstance, dict.get)
            stats.sort_stats("tottime").print_callers(4)
            out.write_text(text.getvalue())
            print(f"profile written to {out}")
    return 0


class CpuTimeline:
    """Each process's CPU seconds since ``started``, sampled every ``step`` s in a thread
    until ``stop``, which returns the table (time, then one column per process)."""

    def __init__(self, started: float, pids: dict[str, int | None],
                 base: dict[str, float], step: float = 0.25) -> None:
        self._started, self._step = started, step
        self._pids = {k: v for k, v in pids.items() if v is not None}
        self._base = base
        self._rows: list[tuple[float, list[float]]] = []
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(self._step):
            try:
                cpu = [cpu_seconds(pid) - self._base.get(name, 0.0)
                       for name, pid in self._pids.items()]
            except OSError:  # a process ended
                return
            self._rows.append((time.monotonic() - self._started, cpu))

    def stop(self) -> str:
        self._done.set()
        self._thread.join(timeout=5)
        head = "     s  " + "  ".join(f"{name + ' CPU s':>12}" for name in self._pids)
        lines = [head] + [f"{t:6.2f}  " + "  ".join(f"{c:12.2f}" for c in cpu)
                          for t, cpu in self._rows]
        return "\n".join(lines)


def _steady(work: Path, target: ApiTarget, watch: SliceWatch, pid: int,
            ips: dict[tuple[int, int], str], plain: bool) -> str:
    """The ``host`` benchmark's steady phase, with the profile restarted at its start."""
    if not plain:
        os.kill(pid, signal.SIGUSR2)
    before = host_writes.writes_now(target.url, target.token)
    cpu0 = cpu_seconds(pid)
    sent = _send(work, target, _updates(ENSEMBLES, PER, 10_000, 0), 30.0, ips,
                 work / "load.log")
    watch.expect(expected_pins(ENSEMBLES, PER, ips))
    done = watch.wait("slices after updates", timeout=600)
    n = sent["sent"]
    agent_writes, _ = host_writes.split(
        host_writes.diff(host_writes.writes_now(target.url, target.token), before))
    return (f"steady: {n} updates, {(cpu_seconds(pid) - cpu0) / n * 1000:.2f} ms agent CPU "
            f"per update, {agent_writes / n:.2f} writes per update, last slice "
            f"{done - sent['last']:.1f} s after the last update"
            + ("" if plain else " (under cProfile)"))


if __name__ == "__main__":
    raise SystemExit(main())
