"""Shared pieces of the benchmarks: goals, results, processes, /proc readings.

Why here: every benchmark reports figures against the same goal table
(issue 7), measures other processes from outside (RSS and CPU from
``/proc/<pid>``, never from inside the process measured), and starts its
helpers as child processes that die with the harness (``PR_SET_PDEATHSIG``),
so an interrupted run leaves nothing behind.

Goals are data, compared in one place (``Goal.passed``); a benchmark never
adjusts them. A figure that could not be measured is ``None`` and shows as
"n/a" (neither PASS nor MISS).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

REPO_ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
PR_SET_PDEATHSIG = 1
CLK_TCK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")

T = TypeVar("T")


class BenchError(Exception):
    """A benchmark could not run to the end (a helper died, a deadline passed)."""


@dataclass(frozen=True)
class Goal:
    key: str
    what: str
    op: str  # "<=", ">=", "<", "=="
    target: float
    unit: str

    def passed(self, value: float | None) -> bool | None:
        if value is None:
            return None
        return {
            "<=": value <= self.target,
            ">=": value >= self.target,
            "<": value < self.target,
            "==": abs(value - self.target) < 1e-9,
        }[self.op]


#: The goals of issue 7 (and those later issues added: 27), in the order the table prints
#: them. Never weakened here.
GOALS: tuple[Goal, ...] = (
    Goal("convergence_registry_p50_ms", "convergence, registry path, p50", "<=", 100, "ms"),
    Goal("convergence_registry_p99_ms", "convergence, registry path, p99", "<=", 300, "ms"),
    Goal("convergence_dns_p99_ms", "convergence, DNS-only path, p99", "<=", 7000, "ms"),
    Goal("storm_restarts_per_member_names", "IMEX restarts per member per settled change, names",
         "==", 0, ""),
    Goal("storm_signals_per_member_names", "SIGUSR1 per member per settled change, names",
         "<=", 1, ""),
    Goal("storm_restarts_per_member_ips", "IMEX restarts per member per settled change, ips",
         "==", 1, ""),
    Goal("host_sync_10k_s", "host agent: start -> 1,000 slices for 10,000 VMIs", "<=", 5, "s"),
    Goal("host_updates_per_s", "host agent: steady VMI updates applied", ">=", 2000, "/s"),
    Goal("host_rss_mb", "host agent RSS with 10,000 VMIs", "<=", 150, "MB"),
    Goal("registry_get_per_s", "registry GET of one ensemble (separate load process)",
         ">=", 3000, "/s"),
    Goal("longpoll_5000_last_answer_ms", "5,000 long-polls: change -> last answer",
         "<=", 1000, "ms"),
    Goal("guest_rss_mb", "guest agent RSS", "<=", 40, "MB"),
    Goal("guest_idle_cpu_pct", "guest agent CPU when idle", "<", 1, "%"),
    Goal("ha_rolling_failed_requests", "failed guest requests, rolling upgrade of 3 replicas",
         "==", 0, ""),
    Goal("ha_rss_mb_max", "peak RSS per electing replica, 10,000 VMIs", "<=", 150, "MB"),
    # issue 27
    Goal("host_sync_writes_per_ensemble", "host agent: API writes per ensemble, first sync "
         "(Events apart)", "<=", 2.0, ""),
    Goal("host_restart_writes", "host agent: API writes restarting over a published fleet",
         "==", 0, ""),
    Goal("host_takeover_writes", "host agent: API writes of a follower taking over", "==", 0,
         ""),
    Goal("host_update_cpu_ms", "host agent: CPU per steady VMI update", "<=", 0.5, "ms"),
    Goal("host_sync_25k_s", "host agent: start -> 1,400 slices for 25,200 VMIs", "<=", 12,
         "s"),
    Goal("host_rss_25k_mb", "host agent RSS with 25,200 VMIs", "<=", 300, "MB"),
    Goal("host_status_storm_answer_p99_s", "boot storm, 20 x 18 reports: answer p99", "<=", 1,
         "s"),
    Goal("host_status_writes_per_ensemble_storm", "boot storm: status writes per ensemble",
         "<=", 2, ""),
    Goal("guest_change_cpu_ms", "guest agent's own CPU per applied change", "<=", 10, "ms"),
    Goal("standin_to_guest_cpu_ratio", "IMEX stand-ins' CPU / guest agents' CPU per change",
         "<", 1, ""),
    # issue 29
    Goal("host_idle_info_lines_per_h", "host agent: INFO lines per hour of an idle leader",
         "==", 0, ""),
    # issue 27, judged on bench-peers.json (make bench-peers; peers/report.goal_figures)
    Goal("peers_replace_speedup_p50", "bench-peers: replacement p50, recipe / ours", ">=", 10,
         "x"),
    Goal("peers_hosts_vs_floor_p50", "bench-peers: hosts-file p50, ours / the floor", "<=", 3,
         "x"),
    Goal("peers_absent_dns_fewer", "bench-peers: absent-slot DNS queries, recipe / ours",
         ">=", 10, "x"),
)
GOAL_KEYS = tuple(g.key for g in GOALS)


@dataclass
class Results:
    """Figures by key (the goal keys plus any extras), and notes for the reader."""

    figures: dict[str, float | None] = field(default_factory=dict)
    notes: dict[str, str] = field(default_factory=dict)
    #: Smoke mode: every key gets a ``_quick`` suffix, so a small-size figure
    #: never stands in for the real one in the table or the JSON.
    quick: bool = False
    #: Called after every figure (the harness rewrites the results file), so a run
    #: interrupted in a long benchmark still leaves what it measured.
    on_change: Callable[[], None] | None = None

    def set(self, key: str, value: float | None) -> None:
        if self.quick:
            key += "_quick"
        self.figures[key] = None if value is None else round(float(value), 3)
        if self.on_change is not None:
            self.on_change()

    def note(self, key: str, text: str) -> None:
        self.notes[key] = text

    def as_json(self, meta: dict[str, Any]) -> dict[str, Any]:
        out: dict[str, Any] = {k: self.figures.get(k) for k in GOAL_KEYS}
        for k, v in self.figures.items():
            if k not in out:
                out[k] = v
        out["_meta"] = {**meta, "notes": self.notes}
        return out


def fmt(value: float | None, unit: str) -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}".strip()


def table(results: Results) -> str:
    rows = [("figure", "value", "goal", "")]
    for g in GOALS:
        value = results.figures.get(g.key)
        verdict = {True: "PASS", False: "MISS", None: "n/a"}[g.passed(value)]
        rows.append((g.key, fmt(value, g.unit), f"{g.op} {fmt(g.target, g.unit)}", verdict))
    extras = [k for k in results.figures if k not in GOAL_KEYS]
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    if extras:
        lines.append("")
        lines.append("other figures:")
        for k in extras:
            lines.append(f"  {k} = {fmt(results.figures[k], '')}")
    return "\n".join(lines)


# ------------------------------------------------------------------ machine


def loadavg() -> tuple[float, float, float]:
    one, five, fifteen = Path("/proc/loadavg").read_text().split()[:3]
    return float(one), float(five), float(fifteen)


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_kb = 0
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    return {"cpus": os.cpu_count(), "cpu_model": model, "mem_gb": round(mem_kb / 2**20, 1),
            "kernel": os.uname().release, "python": sys.version.split()[0]}


def commit() -> str:
    """The tree measured: ``git describe --always --dirty`` of the repository ("" outside
    a git checkout)."""
    try:
        out = subprocess.run(["git", "-C", str(REPO_ROOT), "describe", "--always", "--dirty",
                              "--abbrev=12"], capture_output=True, text=True, timeout=10,
                             check=False)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


# ------------------------------------------------------------------ processes


def rss_mb(pid: int) -> float:
    """Resident set size of ``pid`` in MiB (from /proc/<pid>/statm)."""
    pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    return pages * PAGE / 2**20


def peak_rss_mb(pid: int) -> float:
    """Peak resident set size of ``pid`` in MiB (VmHWM), or its RSS where none is shown."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return rss_mb(pid)


def rss_by_mapping(pid: int, top: int = 6) -> list[tuple[str, float]]:
    """The ``top`` largest parts of ``pid``'s resident memory in MiB, from
    /proc/<pid>/smaps: each file by path (a library's pages), and ``[anon]``/``[heap]``
    (the interpreter's objects)."""
    sizes: dict[str, int] = {}
    name = "[anon]"
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        head, _, rest = line.partition(" ")
        if "-" in head and not head.endswith(":"):  # a mapping's first line
            fields = rest.split()
            name = fields[4] if len(fields) > 4 else "[anon]"
        elif head == "Rss:":
            sizes[name] = sizes.get(name, 0) + int(rest.split()[0])
    ranked = sorted(sizes.items(), key=lambda kv: -kv[1])[:top]
    return [(n, kb / 1024) for n, kb in ranked]


def cpu_ticks(pid: int) -> tuple[int, int]:
    """(user, system) clock ticks ``pid`` has used (children not included)."""
    raw = Path(f"/proc/{pid}/stat").read_text()
    fields = raw[raw.rindex(")") + 2:].split()
    return int(fields[11]), int(fields[12])


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds ``pid`` has used (children not included)."""
    return sum(cpu_ticks(pid)) / CLK_TCK


def tree_pids(pid: int) -> list[int]:
    """``pid`` and every live descendant (via /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        with contextlib.suppress(OSError):
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in (task / "children").read_text().split())
    return out


def _pdeathsig() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + (
        os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.update(extra)
    return env


def spawn(argv: Sequence[str], *, log: Path | None = None, stdout_pipe: bool = False,
          env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """A child process that is killed if the harness dies."""
    out: Any = subprocess.PIPE if stdout_pipe else (
        log.open("ab") if log is not None else subprocess.DEVNULL)
    err: Any = log.open("ab") if log is not None else subprocess.DEVNULL
    return subprocess.Popen(list(argv), stdout=out, stderr=err, cwd=REPO_ROOT,
                            env=env or child_env(), preexec_fn=_pdeathsig)


def read_line(proc: subprocess.Popen[bytes], prefix: str, timeout: float) -> str:
    """The first stdout line of ``proc`` starting with ``prefix`` (bounded wait)."""
    assert proc.stdout is not None
    deadline = time.monotonic() + timeout
    os.set_blocking(proc.stdout.fileno(), False)
    buf = b""
    while time.monotonic() < deadline:
        chunk = proc.stdout.read()
        if chunk:
            buf += chunk
            for line in buf.decode(errors="replace").splitlines():
                if line.startswith(prefix):
                    return line
        elif proc.poll() is not None:
            raise BenchError(f"{proc.args!r} exited with {proc.returncode} before "
                             f"printing {prefix!r}; output: {buf[-2000:]!r}")
        time.sleep(0.01)
    raise BenchError(f"{proc.args!r} printed no {prefix!r} line in {timeout} s")


def stop(proc: subprocess.Popen[bytes], timeout: float = 10.0,
         sig: int = signal.SIGTERM) -> None:
    """``sig`` (SIGTERM; py-spy writes its samples on SIGINT), then SIGKILL after
    ``timeout``; always reaps."""
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()


def get_load(url: str, *, connections: int, seconds: float, log: Path,
             what: str = "GETs", extra: Sequence[str] = ()) -> dict[str, Any]:
    """Keep-alive GETs of ``url`` from ``connections`` connections for ``seconds``, in its
    own process (tests/bench/loadgen.py), so the load generator never shares the measured
    process's CPU; its JSON summary (``per_s``, ``p50_ms``, ``p99_ms``, ...). Any failed
    request fails the figure."""
    gen = spawn([PY, "-m", "tests.bench.loadgen", "get", "--url", url,
                 "--connections", str(connections), "--seconds", str(seconds), *extra],
                log=log, stdout_pipe=True)
    try:
        out: dict[str, Any] = json.loads(read_line(gen, "{", timeout=seconds + 60))
    finally:
        stop(gen)
    if out["errors"]:
        raise BenchError(f"{out['errors']} of {out['requests']} {what} failed")
    return out


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             interval: float = 0.01) -> T:
    """Poll ``probe`` until it returns something truthy; BenchError past ``timeout``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    raise BenchError(f"timed out after {timeout} s waiting for {what} (last: {last!r})")


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100) of a non-empty sample."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, min(len(ordered), math.ceil(q / 100 * len(ordered))))
    return ordered[rank - 1]


def http_json(url: str, *, method: str = "GET", body: Any = None, token: str | None = None,
              timeout: float = 10.0) -> Any:
    """A small blocking JSON request (urllib; the harness's own control calls)."""
    import urllib.request

    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if data is not None:
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(req, timeout=timeout) as resp:
        return json.loads(resp.read() or b"null")


@contextlib.contextmanager
def running(*procs: subprocess.Popen[bytes]) -> Iterator[None]:
    try:
        yield
    finally:
        for p in procs:
            stop(p)
