"""The IMEX stand-ins alone: what a node of 18 costs idle, and per SIGUSR1 (issue 27).

``python -m tests.bench standins`` (no root: the stand-ins listen on 127.0.1.x, which
is all loopback). 18 stand-ins, one nodes file, every link up; then an idle window,
then rounds in which every stand-in gets one SIGUSR1 at once and redials its 17 peers,
as after a change in the sandbox.

Why apart from the sandbox: there, a stand-in's CPU per change is its gross CPU in the
change's window less its idle rate, which is most of the gross (its keepalive), so the
net figure moves by half from run to run. Here nothing else runs, so the idle rate
itself is a figure (``standin_idle_cpu_ms_per_s``: the keepalive, which a C++ daemon
spends next to nothing on), and so is a round's gross CPU (``standin_usr1_cpu_ms``).
``standin_reconnects_per_usr1`` says each round did the whole work (17: one redial per
peer), so a stand-in that does less cannot pass for a cheaper one.

Both daemons are measured in one run, side by side (``IMPLS``): the native one
(imex_standin.c), which the sandbox benchmarks run, and the Python one (imex_standin.py),
which the tests run, with ``_python`` figures.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

from tests.bench.common import BenchError, Results, wait_for
from tests.bench.sandbox_cpu import stat
from tests.sandbox.imex_standin import StandinProcess, write_standin_files

#: /proc/<pid>/task/<tid>/schedstat: time on a CPU in ns (CONFIG_SCHED_INFO)
SCHEDSTAT = Path("/proc/self/schedstat").exists()

#: SIGUSR1 acted on at most once per this many seconds (the daemon's 5 s, shortened so
#: that rounds follow each other quickly; each round waits for the last one's redials)
USR1_WINDOW_S = 1.0


def _connects(procs: list[StandinProcess]) -> tuple[int, int]:
    """(outgoing connects ever made, links CONNECTED now), summed over ``procs``."""
    made = up = 0
    for p in procs:
        for peer in (p.state().get("peers") or {}).values():
            made += int(peer.get("connects", 0))
            up += peer.get("status") == "CONNECTED"
    return made, up


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds of ``pids``, every thread's, from the scheduler's nanosecond account.

    Why not ``/proc/<pid>/stat``: it counts 10 ms ticks, and 4 idle stand-ins over the
    quick run's 3 s use a few ms each, so its difference read 0 in a cold CI run. A
    thread that exited between the reads is lost (the stand-ins keep theirs). A kernel
    without schedstat gets the ticks.
    """
    if not SCHEDSTAT:
        return sum(got[0] for pid in pids if (got := stat(pid)) is not None)
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


#: the daemons measured, side by side in one run: (IMEX_STANDIN_IMPL, figure suffix).
#: The native one is what the sandbox benchmarks run (unsuffixed figures); the Python
#: one, which the tests run, is printed beside it with ``_python``.
IMPLS = (("c", ""), ("python", "_python"))


def run(results: Results, *, quick: bool = False) -> None:
    notes = []
    for impl, suffix in IMPLS:
        got = _measure(impl, quick)
        for name, value in got.items():
            if isinstance(value, float):
                results.set(f"standin_{name}{suffix}", value)
        notes.append(str(got["note"]))
    results.note("standins", "; ".join(notes))


def _measure(impl: str, quick: bool) -> dict[str, float | str]:
    """One daemon's figures (``impl``: IMEX_STANDIN_IMPL), and a note saying what they are."""
    n = 4 if quick else 18
    idle_s = 3.0 if quick else 20.0
    rounds = 2 if quick else 10
    links = n * (n - 1)
    ips = [f"127.0.1.{i + 1}" for i in range(n)]
    base = Path(tempfile.mkdtemp(prefix="standin-cost-"))
    procs: list[StandinProcess] = []
    args = ["--usr1-window", str(USR1_WINDOW_S)]
    try:
        for i, ip in enumerate(ips):
            cfg = write_standin_files(base / str(i), ips, bind_ip=ip, cmd_ip=ip)
            procs.append(StandinProcess.start(cfg, args=args, impl=impl))
        pids = [p.pid() for p in procs]
        wait_for("every link up", lambda: _connects(procs)[1] == links, 60, interval=0.1)
        time.sleep(1.0)  # the last pongs carrying changed views
        cpu0, t0 = _cpu_s(pids), time.monotonic()
        time.sleep(idle_s)
        idle = (_cpu_s(pids) - cpu0) / (time.monotonic() - t0) / n
        made0 = _connects(procs)[0]
        cpu0, t0 = _cpu_s(pids), time.monotonic()
        for r in range(rounds):
            made = made0 + (r + 1) * links
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGUSR1)
            def redialled(made: int = made) -> bool:
                c = _connects(procs)
                return c[0] >= made and c[1] == links

            wait_for(f"round {r + 1}'s redials", redialled, 60, interval=0.1)
            time.sleep(USR1_WINDOW_S)  # the next signal must be acted on
        window = (time.monotonic() - t0) / rounds
        loops = sorted({str(p.state().get("event_loop")) for p in procs})
        gross = (_cpu_s(pids) - cpu0) / rounds / n
        reconnects = (_connects(procs)[0] - made0) / (rounds * n)
        net = max(0.0, gross - idle * window)
        # after the rounds: a restart resets that stand-in's counters
        restart, restart_peers = _restarts(procs, pids, links, idle, 2 if quick else 5,
                                           impl)
        query = _queries(procs[-1], pids[-1], idle, 5 if quick else 30)
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.proc.terminate()
        for p in procs:
            with contextlib.suppress(Exception):
                p.proc.wait(10)
        shutil.rmtree(base, ignore_errors=True)
    note = (
        f"{n} IMEX stand-ins ({impl}) on loopback: idle {idle * 1000:.1f} CPU-ms/s each (the "
        f"keepalive: {2 * (n - 1)} pings and pongs a second each way); per SIGUSR1 to "
        f"every one at once, {gross * 1000:.1f} CPU-ms each over a {window:.2f} s round "
        f"({net * 1000:.1f} net of the idle rate), "
        f"{reconnects:.1f} outgoing reconnects each (peers: {n - 1}); "
        f"event loop: {', '.join(loops)}; one restarted to READY with every link back "
        f"{restart * 1000:.0f} CPU-ms, its {n - 1} peers {restart_peers * 1000:.0f} CPU-ms "
        f"net between them; one `-N -j` {query * 1000:.2f} CPU-ms at the daemon")
    return {"idle_cpu_ms_per_s": idle * 1000, "usr1_cpu_ms": gross * 1000,
            "usr1_cpu_ms_net": net * 1000, "reconnects_per_usr1": reconnects,
            "restart_cpu_ms": restart * 1000, "restart_peers_cpu_ms": restart_peers * 1000,
            "ctl_query_cpu_ms": query * 1000, "note": note}


def _restarts(procs: list[StandinProcess], pids: list[int], links: int, idle: float,
              times: int, impl: str) -> tuple[float, float]:
    """Stop the first stand-in and start it again, ``times`` times, as a guest agent
    does when its own address moved: (the new process's CPU to READY with every link
    back, its peers' CPU in that window net of their idle rate, summed), each a mean.
    A C++ daemon's start is not an interpreter's: this says how much of a sandbox change
    is that start (``impl``: IMEX_STANDIN_IMPL)."""
    own = peers = 0.0
    for _ in range(times):
        procs[0].stop()
        cpu0, t0 = _cpu_s(pids[1:]), time.monotonic()
        procs[0] = StandinProcess.start(procs[0].config,
                                        args=["--usr1-window", str(USR1_WINDOW_S)], impl=impl)
        pids[0] = procs[0].proc.pid  # the wrapper execs the daemon: the same pid
        wait_for("the restarted stand-in's links", lambda: _connects(procs)[1] == links,
                 60, interval=0.05)
        time.sleep(1.0)  # the pongs carrying the changed views
        own += _cpu_s(pids[:1])
        dt = time.monotonic() - t0
        peers += _cpu_s(pids[1:]) - cpu0 - idle * dt * (len(pids) - 1)
    return own / times, max(0.0, peers / times)


def _queries(proc: StandinProcess, pid: int, idle: float, times: int) -> float:
    """The daemon's CPU per ``nvidia-imex-ctl -N -j`` (the whole domain's view, encoded),
    net of its idle rate: every guest asks once per change."""
    cpu0, t0 = _cpu_s([pid]), time.monotonic()
    for _ in range(times):
        if not proc.domain():
            raise BenchError("nvidia-imex-ctl -N -j got no answer")
    return max(0.0, (_cpu_s([pid]) - cpu0 - idle * (time.monotonic() - t0)) / times)
