"""Reserving IMEX's port: the sysctl's list kept, the port added once, bad text refused."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from guest_agent.net.portreserve import ReservedPortsError, parse_reserved, reserve_port, with_port


def test_parse_ports_and_ranges() -> None:
    assert parse_reserved("") == []
    assert parse_reserved("\n") == []
    assert parse_reserved("8080,50000-50010\n") == [(8080, 8080), (50000, 50010)]


@pytest.mark.parametrize("text", ["x", "80-", "-80", "0", "70000", "90-80", "1,,a"])
def test_bad_sysctl_text_is_refused_by_name(text: str) -> None:
    with pytest.raises(ReservedPortsError, match="not a port or a range"):
        parse_reserved(text)


def test_the_port_is_added_keeping_what_is_there() -> None:
    assert with_port("", 50000) == "50000"
    assert with_port("8080\n", 50000) == "8080,50000"
    assert with_port("8080,9000-9100", 50000) == "8080,9000-9100,50000"


def test_a_port_already_covered_changes_nothing() -> None:
    assert with_port("50000", 50000) is None
    assert with_port("49000-51000,8080", 50000) is None


def test_reserve_writes_once(tmp_path: Path) -> None:
    sysctl = tmp_path / "ip_local_reserved_ports"
    sysctl.write_text("8080\n")
    assert reserve_port(50000, sysctl) is True
    assert sysctl.read_text() == "8080,50000\n"
    sysctl.write_text("8080,50000\n")  # as the kernel would print it back
    mtime = sysctl.stat().st_mtime_ns
    assert reserve_port(50000, sysctl) is True
    assert sysctl.stat().st_mtime_ns == mtime


def test_cannot_reserve_is_one_warning_not_a_crash(tmp_path: Path,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING)
    assert reserve_port(50000, tmp_path / "absent") is False
    bad = tmp_path / "garbled"
    bad.write_text("eighty\n")
    assert reserve_port(50000, bad) is False
    assert bad.read_text() == "eighty\n"  # never overwritten with a guess
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "cannot keep IMEX's port 50000 out of the ephemeral range"] * 2
