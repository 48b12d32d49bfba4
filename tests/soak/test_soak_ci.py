"""The CI-size soak (issue 30): 6 VMs, the commit's seed then every seed of seeds.txt.

Runs ``python -m tests.soak`` as a child (it needs the main thread for its signal
handling and builds its own sandbox), with a schedule short and dense enough to fit
about 90 s a seed on 2 shared cores: :data:`DURATION` seconds per seed at
:data:`RATE_SCALE` times the hourly rates. Fails with the soak's table, violations and
replay commands when any run finds a violation.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.ensemble import REPO_ROOT
from tests.soak.__main__ import LOGS_BEGIN, LOGS_END
from tests.soak.schedule import read_seed_list

SEEDS_FILE = REPO_ROOT / "tests" / "soak" / "seeds.txt"
#: the commit's seed and the listed ones; each takes about 90 s here (rack up, 75 s, the
#: quiesces), and a run under CI load is given 150
RUNS = 1 + len(read_seed_list(SEEDS_FILE.read_text()))
RUN_TIMEOUT = 150 * RUNS

pytestmark = [pytest.mark.soak, pytest.mark.root, pytest.mark.timeout(RUN_TIMEOUT + 60)]

VMS = 6
DURATION = 75
RATE_SCALE = 20
CHECK_EVERY = 40
QUIESCE = 45


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=REPO_ROOT, check=True).stdout.strip()


def split_output(out: str) -> tuple[str, str]:
    """(the soak's tables and violations without its timestamped log lines, the log
    tails it printed at each run's first violation)."""
    summary: list[str] = []
    logs: list[str] = []
    inside = False
    for ln in out.splitlines():
        if ln == LOGS_BEGIN:
            inside = True
        if inside:
            logs.append(ln)
        elif not ln[:2].isdigit() or "VIOLATION" in ln:
            summary.append(ln)
        if ln == LOGS_END:
            inside = False
    return "\n".join(summary), "\n".join(logs)


def test_the_soaks_output_is_split_into_the_summary_and_the_logs() -> None:
    out = "\n".join(["soak: seed 1", "09:00:01 soak inject #1", "violations: 1",
                     "09:00:02 soak VIOLATION of invariant 8", LOGS_BEGIN, "--- h-a ---",
                     "12:00 a replica's line", LOGS_END, "results: x"])
    summary, logs = split_output(out)
    assert summary.splitlines() == ["soak: seed 1", "violations: 1",
                                    "09:00:02 soak VIOLATION of invariant 8", "results: x"]
    assert logs.splitlines() == [LOGS_BEGIN, "--- h-a ---", "12:00 a replica's line",
                                 LOGS_END]


def test_the_ci_soak_finds_no_violation(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("needs root and nftables (namespaces, tmpfs, the kube-proxy stand-in)")
    results = tmp_path / "soak-results.json"
    argv = [sys.executable, "-m", "tests.soak", "--commit", _commit(),
            "--seeds-file", str(SEEDS_FILE),
            "--duration", str(DURATION), "--vms", str(VMS), "--rate-scale", str(RATE_SCALE),
            "--check-every", str(CHECK_EVERY), "--quiesce", str(QUIESCE),
            "--results", str(results)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT,
                          timeout=RUN_TIMEOUT, check=False)
    out = proc.stdout + proc.stderr
    summary, logs = split_output(out)
    print(summary)
    assert proc.returncode == 0, summary[-6000:] + "\n" + logs[:10_000]
    doc = json.loads(results.read_text())
    assert doc["violations"] == []
    assert sum(k["injected"] for k in doc["faults"].values()) > 0
