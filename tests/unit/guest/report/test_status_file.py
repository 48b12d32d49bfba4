"""Status file: atomic write, load, table; ``imex-guest-agent status [--json]`` as a process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from guest_agent.report.status_file import (
    Status,
    StatusError,
    format_table,
    load_status,
    write_status,
)

ROOT = Path(__file__).resolve().parents[4]


def _status(**kw: object) -> Status:
    s = Status(ensemble="rack-a", namespace="gpu", domain_id="1a2b3c4d", mode="names",
               agent_version="0.1.0")
    for k, v in kw.items():
        setattr(s, k, v)
    return s


def test_write_is_atomic_and_skips_unchanged(tmp_path: Path) -> None:
    path = str(tmp_path / "run" / "status.json")
    s = _status(own_index=2, signals=3)
    assert write_status(path, s)
    assert not write_status(path, s)
    data = load_status(path)
    assert data["own_index"] == 2 and data["signals"] == 3
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["status.json"]  # no temp left
    # one line with sorted keys (json's C encoder; an indented dump is pure Python)
    lines = Path(path).read_text().splitlines()
    assert len(lines) == 1 and list(json.loads(lines[0])) == sorted(data)


def test_the_status_file_is_runtime_state_and_never_fsynced(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """/run is a tmpfs: an fsync there buys nothing, and it was a third of a status
    write's CPU. The managed files (hosts, nodes) keep both of theirs."""
    from guest_agent.files.safewrite import write_file

    synced: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(fd), real(fd))[1])
    path = str(tmp_path / "run" / "status.json")
    for signals in range(3):
        assert write_status(path, _status(signals=signals))
    assert load_status(path)["signals"] == 2 and synced == []
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["status.json"]
    assert write_file(str(tmp_path / "nodes_config.cfg"), b"a\nb\n")
    assert len(synced) == 2  # the file, then its directory


def test_load_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(StatusError, match="no status file"):
        load_status(str(tmp_path / "missing.json"))
    (tmp_path / "bad.json").write_text("{")
    with pytest.raises(StatusError, match=r"bad\.json: not valid JSON"):
        load_status(str(tmp_path / "bad.json"))


def test_table_marks_own_member_and_masquerade_note() -> None:
    s = _status(
        own_index=1, own_slot="imex-1a2b3c4d-1", own_ip="10.0.2.2", own_slot_how="hostname",
        own_slot_note="the published IP 10.244.0.6 is not a local address (masquerade binding)",
        members=[{"index": 0, "slot": "imex-1a2b3c4d-0", "ip": "10.244.0.5"},
                 {"index": 1, "slot": "imex-1a2b3c4d-1", "ip": "10.244.0.6"}],
        imex_state="READY", signals=4, restarts=1, reasserts=2, generation_applied=17,
        source="registry",
    )
    table = format_table(s.to_json(), now=s.updated_at)
    assert "masquerade binding" in table
    assert "10.244.0.6 *" in table and "10.244.0.5 *" not in table
    assert "READY via systemd" in table
    assert "re-asserts  2" in table
    assert "generation 17" in table


def _cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    cfg = tmp_path / "config.toml"
    cfg.write_text(
        'ensemble = "rack-a"\nnamespace = "gpu"\nimex_control = "none"\n'
        f'status_file = "{tmp_path / "status.json"}"\n'
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, "-m", "guest_agent.cli", "status", "--config", str(cfg), *args],
        capture_output=True, text=True, env=env, timeout=30, check=False,
    )


def test_status_command_json_and_table(tmp_path: Path) -> None:
    missing = _cli(tmp_path, "--json")
    assert missing.returncode == 1 and "no status file" in missing.stderr
    gone = subprocess.Popen(["true"])
    gone.wait()
    write_status(str(tmp_path / "status.json"),
                 _status(own_index=0, imex_state="READY", restarts=2, pid=gone.pid))
    out = _cli(tmp_path, "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["own_index"] == 0 and data["restarts"] == 2 and data["imex_state"] == "READY"
    assert data["agent_running"] is False
    table = _cli(tmp_path)
    assert table.returncode == 0 and "READY via systemd" in table.stdout
    assert "may be stale" in table.stdout
    write_status(str(tmp_path / "status.json"), _status(pid=os.getpid()))
    assert json.loads(_cli(tmp_path, "--json").stdout)["agent_running"] is True


def test_table_shows_the_own_matrix_row_and_the_clique() -> None:
    s = Status(ensemble="gb200", namespace="gpu", domain_id="93a7a316", mode="names",
               agent_version="t", own_index=10, updated_at=100.0)
    s.imex_row = {str(i): "CONNECTED" for i in range(12) if i != 10} | {"3": "DISCONNECTED"}
    s.imex_domain_status, s.domain_at = "DEGRADED", 97.0
    s.clique = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10.7"
    s.imex_channels, s.domain_errors = [0, 1], 2
    s.imex_channels_note = "present: 0, 1 of 0, 1"
    s.preflight = [{"name": "dns", "result": "PASS", "message": "ok"},
                   {"name": "fabric", "result": "WARN", "message": "In Progress"}]
    s.preflight_at = 40.0
    table = format_table(s.to_json(), now=100.0)
    assert "clique      0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10.7\n" in table
    assert "channels    0, 1 (present: 0, 1 of 0, 1)\n" in table
    assert "preflight   2 checks, fabric WARN (60s ago)\n" in table
    assert "imex view   DEGRADED (nvidia-imex-ctl -N -j, 3s ago), 2 dropped\n" in table
    assert ("Nodes From\\To  0  1  2  3  4  5  6  7  8  9 10 11\n"
            "           10  C  C  C  D  C  C  C  C  C  C  .  C\n") in table
    s.clique, s.imex_row = None, None
    table = format_table(s.to_json(), now=100.0)
    assert "clique      none (no NVLink fabric reported by nvidia-smi)" in table
    assert "Nodes From" not in table


def test_prometheus_text_carries_the_build_info_of_the_running_daemon() -> None:
    from guest_agent.report.status_file import prometheus_text

    text = prometheus_text({"namespace": "gpu", "ensemble": "gb200", "agent_version": "0.2.0",
                            "imex_state": "READY", "signals": 3, "restarts": 1,
                            "generation_applied": 17, "agent_running": True})
    assert 'imex_build_info{version="0.2.0"} 1\n' in text
    assert 'imex_guest_imex_signals_total{namespace="gpu",ensemble="gb200"} 3\n' in text
    assert 'imex_guest_imex_ready{namespace="gpu",ensemble="gb200"} 1\n' in text
    assert "# TYPE imex_build_info gauge" in text
    odd = prometheus_text({"namespace": 'a"b', "ensemble": "c\\d", "agent_version": None})
    assert 'namespace="a\\"b",ensemble="c\\\\d"' in odd


def test_the_status_command_prints_prometheus_text(tmp_path: Path) -> None:
    status = tmp_path / "status.json"
    status.write_text(json.dumps({"namespace": "gpu", "ensemble": "gb200", "pid": 2**22 + 7,
                                  "agent_version": "0.2.0", "imex_state": "READY"}))
    cfg = tmp_path / "config.toml"
    cfg.write_text(f'ensemble = "gb200"\nnamespace = "gpu"\nstatus_file = "{status}"\n')
    out = subprocess.run([sys.executable, "-m", "guest_agent.cli", "--config", str(cfg),
                          "status", "--prometheus"], capture_output=True, text=True,
                         timeout=60, check=False, cwd=Path(__file__).resolve().parents[4])
    assert out.returncode == 0, out.stderr
    assert 'imex_build_info{version="0.2.0"} 1' in out.stdout
    assert 'imex_guest_agent_running{namespace="gpu",ensemble="gb200"} 0' in out.stdout
