"""The CI-size soak (issue 30): 6 VMs, the commit's seed then every seed of seeds.txt.

Runs ``python -m tests.soak`` as a child (it needs the main thread for its signal
handling and builds its own sandbox), with a schedule short and dense enough to fit
the tier in 5 minutes on 2 shared cores: :data:`DURATION` seconds per seed at
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

pytestmark = [pytest.mark.soak, pytest.mark.root, pytest.mark.timeout(420)]

VMS = 6
DURATION = 75
RATE_SCALE = 20
CHECK_EVERY = 40
QUIESCE = 45


def _commit() -> str:
    return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                          cwd=REPO_ROOT, check=True).stdout.strip()


def test_the_ci_soak_finds_no_violation(tmp_path: Path) -> None:
    if os.geteuid() != 0 or shutil.which("nft") is None:
        pytest.skip("needs root and nftables (namespaces, tmpfs, the kube-proxy stand-in)")
    results = tmp_path / "soak-results.json"
    argv = [sys.executable, "-m", "tests.soak", "--commit", _commit(),
            "--seeds-file", str(REPO_ROOT / "tests" / "soak" / "seeds.txt"),
            "--duration", str(DURATION), "--vms", str(VMS), "--rate-scale", str(RATE_SCALE),
            "--check-every", str(CHECK_EVERY), "--quiesce", str(QUIESCE),
            "--results", str(results)]
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT, timeout=400,
                          check=False)
    out = proc.stdout + proc.stderr
    summary = "\n".join(ln for ln in out.splitlines()
                        if not ln[:2].isdigit() or "VIOLATION" in ln)
    print(summary)
    assert proc.returncode == 0, summary[-8000:]
    doc = json.loads(results.read_text())
    assert doc["violations"] == []
    assert sum(k["injected"] for k in doc["faults"].values()) > 0
