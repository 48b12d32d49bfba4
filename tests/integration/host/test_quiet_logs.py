"""Logs a person can read: an idle leader writes no INFO line, and a membership change is
one INFO line naming the ensemble, the slot, the old and new address and the generation.

The real ``imex-host-agent`` process (its own logging set-up, ``--json``) against the API
double, electing a leader on a real Lease: the HTTP client's per-request lines (the
Lease's GET and PUT every 2 s) were most of the ~86,000 INFO lines a day an idle replica
wrote; they are DEBUG now.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]
#: the idle window the issue names: a minute, the Lease renewed ~30 times in it
IDLE_S = 60.0


async def lines_until(stream: asyncio.StreamReader, out: list[dict[str, Any]],
                      done: Any, timeout: float) -> None:
    async with asyncio.timeout(timeout):
        while not done():
            raw = await stream.readline()
            assert raw, f"the agent exited: {out[-5:]}"
            out.append(json.loads(raw))


async def test_an_idle_leader_writes_no_info_line(api: KubeApiHandle) -> None:
    api.put(service("gb200", namespace=NS))
    api.put(vmi("gb200-0", ip="10.244.0.1"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IMEX_HOST_AGENT_JSON": "1"}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host_agent.cli", "--kubeconfig", str(api.kubeconfig_path),
        "--listen", "127.0.0.1:0", "--agent-namespace", NS, "--leader-elect",
        "--namespace", NS, env=env, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
    assert proc.stderr is not None
    lines: list[dict[str, Any]] = []
    try:
        def published() -> bool:  # leader, slice written, start-up checks held: all events
            return all(any(m in str(d["msg"]) for d in lines) for m in (
                "became the leader", "applied EndpointSlice gb200-imex", "start-up checks hold"))

        await lines_until(proc.stderr, lines, published, 30)
        # The join is said once: as its own INFO line when the agent led only after its
        # initial reconcile, or inside "initial reconcile done" when it led before.
        joined = [d for d in lines if "joined at 10.244.0.1" in str(d["msg"])]
        in_initial = any("initial reconcile done: 1 ensembles published" in str(d["msg"])
                         for d in lines)
        assert (len(joined) == 1 and joined[0]["level"] == "info") or \
            (in_initial and not joined), lines
        idle: list[dict[str, Any]] = []
        t0 = time.monotonic()
        with pytest.raises(TimeoutError):  # nothing to read for the whole window
            await lines_until(proc.stderr, idle, lambda: False, IDLE_S)
        assert time.monotonic() - t0 >= IDLE_S - 1
        assert [(d["logger"], d["msg"]) for d in idle if d["level"] == "info"] == []
        assert api.writes("leases") >= 20  # it did renew all along (every 2 s)

        # one membership change: one INFO line with the structured fields
        moved = vmi("gb200-0", ip="10.244.0.9")
        api.put(moved)
        change: list[dict[str, Any]] = []
        await lines_until(proc.stderr, change,
                          lambda: any("moved from" in str(d["msg"]) for d in change), 20)
        (line,) = [d for d in change if "moved from" in str(d["msg"])]
        assert line["level"] == "info"
        assert line["ensemble"] == f"{NS}/gb200" and line["slot"] == 0
        assert (line["old_ip"], line["new_ip"]) == ("10.244.0.1", "10.244.0.9")
        assert isinstance(line["generation"], int)
        assert f"slot 0 (gb200-0) moved from 10.244.0.1 to 10.244.0.9, generation " \
            f"{line['generation']}" in line["msg"]
        assert line["time"].endswith("Z") and len(line["time"]) == len("2026-12-02T18:41:20.123Z")
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
