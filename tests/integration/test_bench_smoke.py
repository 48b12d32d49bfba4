"""Smoke run of the benchmark harness (``python -m tests.bench registry --quick``).

Not a measurement: it keeps the harness from rotting. The registry benchmark is
the cheapest one that still goes through every layer the others use (the API
double process, the real host agent process, the load generator process, the
results file and the table).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.bench.common import GOAL_KEYS, REPO_ROOT, child_env


def test_quick_registry_run_writes_every_key_and_prints_the_table(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench", "registry", "--quick", "--out", str(out)],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(GOAL_KEYS) <= set(doc)
    assert all(doc[k] is None for k in GOAL_KEYS)  # quick figures never pose as real ones
    assert doc["registry_get_per_s_quick"] > 0
    assert 0 < doc["longpoll_first_answer_ms_quick"] <= doc["longpoll_5000_last_answer_ms_quick"]
    assert doc["_meta"]["quick"] is True and doc["_meta"]["errors"] == {}
    assert "registry_get_per_s" in proc.stdout and ">= 3,000 /s" in proc.stdout


def test_unknown_benchmark_is_refused() -> None:
    proc = subprocess.run([sys.executable, "-m", "tests.bench", "nosuch"], cwd=REPO_ROOT,
                          env=child_env(), capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "unknown benchmark(s) nosuch" in proc.stderr


@pytest.mark.root
def test_the_guest_change_tool_counts_the_guests_cpu_over_its_changes(tmp_path: Path) -> None:
    """``python -m tests.bench.guest_changes --quick``: 6 VMs, 2 spaced changes."""
    out = tmp_path / "changes.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tests.bench.guest_changes", "--quick", "--changes", "2",
         "--out", str(out)],
        cwd=REPO_ROOT, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert (doc["changes"], doc["vms"]) == (2, 6)
    user, system = doc["guest_ticks_user_system"]
    assert user > 0 and system >= 0  # six agents applied two changes: never zero
    figures = doc["figures"]
    assert figures["guest_churn_cpu_pct"] > 0 and figures["guest_change_cpu_ms"] >= 0
    assert "guest_churn_cpu_pct" in proc.stdout and str(out) in proc.stdout
