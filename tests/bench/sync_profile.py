"""Profile the host agent's first sync alone: 10,000 VMIs in 1,000 ensembles.

``python -m tests.bench.sync_profile [--plain] [--out PATH]``

The ``host`` benchmark's ``--profile cpu`` covers its whole run (sync, 20,000
updates, restarts), in which the sync is a small part. This starts the same API
double and agent, stops at the moment the last slice holds its members, and
writes the top lines by own and by cumulative CPU time (cProfile with a CPU-time
clock, ``cpu_profile``). ``--plain`` runs the agent without the profiler and
prints only the sync's wall and CPU seconds, which the profiler would inflate.
"""

from __future__ import annotations

import argparse
import io
import pstats
import tempfile
import time
from pathlib import Path

from tests.bench.common import PY, REPO_ROOT, cpu_seconds, free_port, spawn, stop
from tests.bench.host_scale import api_double, expected_pins
from tests.bench.kube_proc import NAMESPACE, member_ip
from tests.bench.slicewatch import SliceWatch

ENSEMBLES, PER = 1000, 10


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--plain", action="store_true", help="no profiler: wall and CPU only")
    p.add_argument("--out", type=Path, default=REPO_ROOT / "bench-profile-sync.txt")
    args = p.parse_args(argv)
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
                started = time.monotonic()
                agent = spawn(argv_, log=work / "agent.log")
                try:
                    wall = watch.wait(f"{ENSEMBLES} slices", timeout=600) - started
                    cpu = cpu_seconds(agent.pid)
                finally:
                    stop(agent, timeout=60)
            finally:
                watch.close()
        print(f"sync of {ENSEMBLES * PER} VMIs: {wall:.2f} s wall, {cpu:.2f} s agent CPU"
              + ("" if args.plain else " (under cProfile)"))
        if not args.plain:
            text = io.StringIO()
            stats = pstats.Stats(str(pstats_path), stream=text)
            stats.sort_stats("tottime").print_stats(25)
            stats.sort_stats("cumulative").print_stats(40)
            args.out.write_text(text.getvalue())
            print(f"profile written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
