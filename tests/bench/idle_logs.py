"""INFO lines an idle leader writes per hour (issue 29): ``host_idle_info_lines_per_h``.

The real ``imex-host-agent`` (``--json --leader-elect``, its own logging set-up) against
the API double in this process, one Service-declared ensemble of 18 Running VMIs. Once
it has synced (it leads, its slice is written, its start-up checks held), nothing
changes for the window (600 s, the issue's 10 minutes; 60 s with ``--quick``) while it
renews its Lease every 2 s, and every INFO (or louder) line it writes is counted and
scaled to an hour. At INFO a line is an event a person would want, and an idle leader
has none: the goal is 0. Before issue 29 the HTTP client's per-request lines alone were
about 3,600 an hour (a Lease GET and PUT every 2 s).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from tests.bench.common import REPO_ROOT, BenchError, Results
from tests.host_support.kubevirt import service, vmi
from tests.sandbox.kube_api.server import ThreadedKubeApi

NS = "idle"
MEMBERS = 18
#: what the agent logs once it has done everything a start does (not idle until then)
STARTED = ("became the leader", "applied EndpointSlice gb200-imex", "start-up checks hold")
LOUD = ("info", "warning", "error", "critical")


def _reader(stream: Any, out: queue.Queue[dict[str, Any] | None]) -> None:
    for raw in stream:
        try:
            out.put(json.loads(raw))
        except ValueError:
            out.put({"level": "error", "logger": "?", "msg": f"not JSON: {raw[:200]!r}"})
    out.put(None)


def measure(window: float) -> tuple[float, list[str]]:
    """(INFO-or-louder lines per hour over ``window`` idle seconds, those lines)."""
    with ThreadedKubeApi() as api, tempfile.TemporaryDirectory() as tmp:
        kubeconfig = api.write_kubeconfig(Path(tmp) / "kubeconfig")
        api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        api.put(service("gb200", namespace=NS))
        for i in range(MEMBERS):
            api.put(vmi(f"gb200-{i}", namespace=NS, ip=f"10.244.0.{i + 1}"))
        env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "IMEX_HOST_AGENT_JSON": "1"}
        proc = subprocess.Popen(
            [sys.executable, "-m", "host_agent.cli", "--kubeconfig", str(kubeconfig),
             "--listen", "127.0.0.1:0", "--agent-namespace", NS, "--leader-elect",
             "--namespace", NS], env=env, cwd=REPO_ROOT, text=True,
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        lines: queue.Queue[dict[str, Any] | None] = queue.Queue()
        threading.Thread(target=_reader, args=(proc.stderr, lines), daemon=True).start()
        try:
            seen: set[str] = set()
            deadline = time.monotonic() + 60
            while len(seen) < len(STARTED):
                left = deadline - time.monotonic()
                d = lines.get(timeout=max(left, 0.01)) if left > 0 else None
                if d is None:
                    raise BenchError(f"the agent did not settle within 60 s (saw {seen})")
                seen |= {m for m in STARTED if m in str(d.get("msg"))}
            loud: list[str] = []
            end = time.monotonic() + window
            while (left := end - time.monotonic()) > 0:
                try:
                    d = lines.get(timeout=left)
                except queue.Empty:
                    break
                if d is None:
                    raise BenchError("the agent exited during the idle window")
                if d.get("level") in LOUD:
                    loud.append(f"{d.get('level')} {d.get('logger')}: {d.get('msg')}")
            return len(loud) * 3600.0 / window, loud
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run(results: Results, *, quick: bool = False) -> None:
    window = 60.0 if quick else 600.0
    per_h, loud = measure(window)
    results.figures["host_idle_info_lines_per_h"] = round(per_h, 1)
    results.figures["host_idle_window_s"] = window
    if loud:
        results.notes["host_idle_info_lines_per_h"] = "; ".join(loud[:5])
    print(f"   idle leader: {len(loud)} INFO-or-louder lines in {window:.0f} s "
          f"({per_h:.1f} per hour)", flush=True)
