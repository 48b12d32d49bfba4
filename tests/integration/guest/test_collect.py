"""DomainCollector against real processes: the ctl stand-in, nvidia-smi stand-in, bad tools."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest

from guest_agent.config import settings_from_mapping
from guest_agent.report.collect import DomainCollector, run_bounded
from imex_shared.imex_domain import DomainError, Fabric

REPO = Path(__file__).resolve().parents[3]
SMI = REPO / "tests" / "sandbox" / "bin" / "nvidia-smi"
UUID = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10"


def script(path: Path, body: str) -> Path:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def collector(tmp_path: Path, ctl: Path, smi: list[str], clock: list[float] | None = None,
              timeout: float = 2.0) -> DomainCollector:
    settings = settings_from_mapping({
        "ensemble": "gb200", "namespace": "gpu", "max_members": 4,
        "imex_ctl": [str(ctl)], "nvidia_smi": smi,
        "report_interval": 0.5,
    })
    now = clock if clock is not None else [1000.0]
    present = tmp_path / "present"  # the channel keeper's answer, as a test sets it
    return DomainCollector(settings, lambda _: None,
                           lambda: [int(n) for n in present.read_text().split()]
                           if present.exists() else [],
                           ctl_timeout=timeout, clock=lambda: now[0])


def gone(pid: int) -> bool:
    """No such process: killed *and* reaped (a zombie still has a /proc entry)."""
    return not os.path.exists(f"/proc/{pid}")


DOC = {"nodes": {"0": {"status": "READY", "host": "10.0.0.1",
                       "connections": {"1": {"status": "CONNECTED", "changed": 1},
                                       "2": {"status": "NEVER_CONNECTED", "changed": 0}}},
                 "1": {"status": "READY", "connections": {"0": {"status": "CONNECTED"}}}},
       "timestamp": 5, "status": "DEGRADED"}


async def test_a_valid_view_the_fabric_and_the_channel(tmp_path: Path) -> None:
    (tmp_path / "doc.json").write_text(json.dumps(DOC))
    ctl = script(tmp_path / "ctl", f'[ "$1 $2" = "-N -j" ] && exec cat {tmp_path}/doc.json')
    (tmp_path / "fabric.json").write_text(json.dumps({"cluster_uuid": UUID, "clique_id": 7}))
    (tmp_path / "present").write_text("0 4")
    c = collector(tmp_path, ctl, [str(SMI), "--fabric-file", str(tmp_path / "fabric.json")])
    r = await c.collect()
    assert r.imex_domain == DOC
    assert r.fabric == Fabric(UUID, 7) and r.fabric_known
    assert r.channels == [0, 4]
    assert r.errors == 0 and r.last_error is None
    (tmp_path / "present").unlink()
    assert (await c.collect()).channels == []


async def test_garbage_is_dropped_and_counted_never_forwarded(tmp_path: Path) -> None:
    ctl = script(tmp_path / "ctl", 'echo \'{"nodes": {"0": {"status": "<script>"}}}\'')
    smi = script(tmp_path / "smi", "exit 0")
    c = collector(tmp_path, ctl, [str(smi)])
    r = await c.collect()
    assert r.imex_domain is None
    assert r.errors == 1 and "is not a state word" in (r.last_error or "")
    # the ctl exiting non-zero (IMEX not running) is no view, not garbage
    script(tmp_path / "ctl", "echo 'cannot connect' >&2; exit 1")
    r = await c.collect()
    assert r.imex_domain is None and r.errors == 1


async def test_a_hanging_ctl_is_killed_and_reaped(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    ctl = script(tmp_path / "ctl", f"echo $$ > {pidfile}; exec sleep 60")
    c = collector(tmp_path, ctl, [str(tmp_path / "no-such-smi")], timeout=0.5)
    r = await c.collect()
    assert r.imex_domain is None and r.errors == 0  # no answer is not bad output
    assert gone(int(pidfile.read_text()))
    assert r.fabric is None and r.fabric_known  # no nvidia-smi at all: no fabric


async def test_a_flood_of_output_is_cut_off_and_the_child_killed(tmp_path: Path) -> None:
    pidfile = tmp_path / "pid"
    ctl = script(tmp_path / "ctl", f"echo $$ > {pidfile}; exec yes '{{\"nodes\":'")
    with pytest.raises(DomainError, match="printed over 65536 bytes"):
        await run_bounded([str(ctl)], 10.0, limit=65536)
    assert gone(int(pidfile.read_text()))
    c = collector(tmp_path, ctl, [str(tmp_path / "none")])
    r = await c.collect()
    assert r.imex_domain is None and r.errors == 1 and "printed over" in (r.last_error or "")


async def test_nvidia_smi_at_most_once_a_minute_and_last_good_kept(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps({"cluster_uuid": UUID, "clique_id": 3}))
    smi = script(tmp_path / "smi",
                 f'echo x >> {calls}; [ -e {tmp_path}/garbage ] && exec {SMI} -q --garbage\n'
                 f'exec {SMI} "$@" --fabric-file {fabric}')
    ctl = script(tmp_path / "ctl", "exit 1")
    clock = [1000.0]
    c = collector(tmp_path, ctl, [str(smi)], clock)
    assert (await c.collect()).fabric == Fabric(UUID, 3)
    clock[0] += 59
    await c.collect()
    assert len(calls.read_text().split()) == 1  # not asked again within the minute
    (tmp_path / "garbage").touch()
    clock[0] += 2
    r = await c.collect()
    assert len(calls.read_text().split()) == 2
    assert r.errors == 1 and "CliqueId 'banana' is not a number" in (r.last_error or "")
    assert r.fabric == Fabric(UUID, 3)  # the last good answer stands
