"""``imex-host-agent --version``: the installed console script prints its name and
pyproject.toml's version, exits 0, and needs no config, cluster or kubeconfig."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_host_console_script_prints_its_version(tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name("imex-host-agent")
    proc = subprocess.run([str(exe), "--version"], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")},
                          check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"imex-host-agent {VERSION}\n", "")
