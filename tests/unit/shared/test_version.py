"""``--version`` on both command lines: the installed console scripts print their name and
pyproject.toml's version, exit 0, and need no config, cluster or subcommand."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from imex_shared.version import package_version

REPO = Path(__file__).resolve().parents[3]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_installed_version_is_pyprojects() -> None:
    assert package_version() == VERSION


@pytest.mark.parametrize("script", ["imex-host-agent", "imex-guest-agent"])
def test_console_script_prints_its_version(script: str, tmp_path: Path) -> None:
    exe = Path(sys.executable).with_name(script)
    # no config file, no kubeconfig, no subcommand: --version needs none of them
    proc = subprocess.run([str(exe), "--config", str(tmp_path / "absent.toml"), "--version"]
                          if script == "imex-guest-agent" else [str(exe), "--version"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin", "KUBECONFIG": str(tmp_path / "none")},
                          check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"{script} {VERSION}\n", "")
