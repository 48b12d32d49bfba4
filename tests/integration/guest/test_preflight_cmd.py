"""``imex-guest-agent preflight``, the real command against the sandbox's stand-ins.

nvidia-smi and nvidia-imex are tests/sandbox's stand-ins (nvidia_smi.py, imex_standin.py
``--version``), IMEX's config is a real file, a "second IMEX" is a real process whose
argv[0] is ``nvidia-imex`` (``sleep`` under that name) in this test's own cgroup, and DNS
is asked of a loopback port where nothing answers. The runtime the command prints is
the figure docs/benchmarks.md quotes.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
BIN = ROOT / "tests" / "sandbox" / "bin"
AGENT = str(Path(sys.executable).with_name("imex-guest-agent"))


@pytest.fixture
def second_imex() -> Iterator[int]:
    proc = subprocess.Popen(["nvidia-imex", "60"], executable="/bin/sleep")
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def config(tmp_path: Path, port: int = 50000, driver: str = "580.82.07") -> Path:
    cfg = tmp_path / "config.cfg"
    cfg.write_text(f"SERVER_PORT={port}\nIMEX_NODE_CONFIG_FILE={tmp_path}/nodes\n"
                   "IMEX_CMD_ENABLED=1\nIMEX_CMD_PORT=1\n")
    smi = tmp_path / "smi"
    smi.write_text(f"#!/bin/sh\nexec {BIN}/nvidia-smi \"$@\" --driver {driver} "
                   f"--fabric-file {tmp_path}/fabric.json\n")
    smi.chmod(0o755)
    (tmp_path / "fabric.json").write_text(json.dumps(
        {"cluster_uuid": "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10", "clique_id": 3}))
    toml = tmp_path / "agent.toml"
    toml.write_text(
        'ensemble = "e"\nnamespace = "ns"\nimex_channels = []\ndns_timeout = 0.3\n'
        'nameservers = ["127.0.0.1:9"]\n'
        f'imex_command = ["{BIN}/nvidia-imex", "-c", "{cfg}"]\nimex_config = "{cfg}"\n'
        f'imex_ctl = ["{BIN}/nvidia-imex-ctl", "-c", "{cfg}"]\nnvidia_smi = ["{smi}"]\n'
        f'nodes_config = "{tmp_path}/nodes"\nhosts_file = "{tmp_path}/hosts"\n'
        f'status_file = "{tmp_path}/status.json"\n')
    return toml


def preflight(toml: Path) -> tuple[int, dict[str, object]]:
    proc = subprocess.run([AGENT, "--config", str(toml), "preflight", "--json"],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, json.loads(proc.stdout)


def results(doc: dict[str, object]) -> dict[str, tuple[str, str]]:
    checks = doc["checks"]
    assert isinstance(checks, list)
    return {c["name"]: (c["result"], c["message"]) for c in checks}


def test_preflight_names_each_check_and_fails_on_dns(tmp_path: Path) -> None:
    rc, doc = preflight(config(tmp_path))
    got = results(doc)
    assert rc == 1 and doc["result"] == "FAIL"
    assert got["driver_version"][0] == "PASS" and "580.82.07" in got["driver_version"][1]
    assert got["imex_installed"] == ("PASS", f"{BIN}/nvidia-imex 580.82.07")
    assert got["fabric"][0] == "PASS" and got["imex_config"][0] == "PASS"
    assert got["imex_channels"] == ("PASS", "off (imex_channels = [])")
    assert got["dns"][0] == "FAIL" and "127.0.0.1:9" in got["dns"][1]
    assert isinstance(doc["seconds"], float) and doc["seconds"] < 30
    print(f"preflight_seconds {doc['seconds']}")


def test_preflight_finds_a_second_imex_and_an_old_driver(tmp_path: Path,
                                                         second_imex: int) -> None:
    rc, doc = preflight(config(tmp_path, port=50001, driver="570.148.08"))
    got = results(doc)
    assert rc == 1
    result, message = got["second_imex"]
    # the check names four; tests running beside this one may have stand-ins of their own
    # (pytest -n): then ours may be among the ones it only counts
    assert result == "FAIL"
    assert f"pid {second_imex}" in message or " more (only " in message, message
    assert got["driver_version"][0] == "FAIL"
    assert got["imex_config"][0] == "FAIL" and "SERVER_PORT is '50001'" in got["imex_config"][1]
