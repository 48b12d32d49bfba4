"""The agent's systemd unit: the ordering the design needs, and systemd accepts it."""

from __future__ import annotations

import configparser
import shutil
import subprocess
from importlib import resources
from pathlib import Path

import pytest

UNIT = resources.files("guest_agent").joinpath("data/imex-guest-agent.service").read_text()


def _parsed() -> configparser.ConfigParser:
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.optionxform = str  # type: ignore[assignment,method-assign]
    cp.read_string(UNIT)
    return cp


def test_ordering_and_restart_policy() -> None:
    cp = _parsed()
    unit, service = cp["Unit"], cp["Service"]
    assert set(unit["After"].split()) >= {"network-online.target", "cloud-init.service",
                                        "cloud-init-network.service"}  # 24.3 renamed it
    assert "network-online.target" in unit["Wants"].split()
    assert "nvidia-imex.service" in unit["Before"].split()
    assert service["Restart"] == "always"
    assert service["Type"] == "notify" and service["NotifyAccess"] == "main"
    assert service["KillMode"] == "mixed"  # SIGTERM to the agent only: it stops its child
    exec_start = service["ExecStart"].split()
    assert exec_start[0].endswith("/imex-guest-agent") and exec_start[1:] == ["run"]
    assert exec_start[0].startswith("/")  # systemd wants an absolute path
    assert cp["Install"]["WantedBy"] == "multi-user.target"


def test_systemd_accepts_the_unit(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed here")
    # verify also checks that ExecStart exists; point it at a binary that does.
    unit = tmp_path / "imex-guest-agent.service"
    unit.write_text("\n".join(
        "ExecStart=/bin/true run" if line.startswith("ExecStart=") else line
        for line in UNIT.splitlines()) + "\n")
    out = subprocess.run([analyze, "verify", str(unit)], capture_output=True, text=True,
                         timeout=60, check=False)
    problems = [ln for ln in (out.stdout + out.stderr).splitlines()
                if "imex-guest-agent.service" in ln]
    assert out.returncode == 0 and not problems, out.stdout + out.stderr
