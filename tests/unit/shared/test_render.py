"""nodes_config and the hosts block, byte for byte against golden files."""

from __future__ import annotations

from pathlib import Path

import pytest

from imex_shared.model import EnsembleId, InvalidIndex, UnusableAddress
from imex_shared.render import render_hosts_block, render_nodes_config

GOLDEN = Path(__file__).parents[2] / "golden"
ENS = EnsembleId("gpu", "gb200")


def test_names_mode_is_the_golden_file_and_ignores_pins() -> None:
    golden = (GOLDEN / "nodes_config" / "names_18.cfg").read_bytes()
    assert render_nodes_config(ENS, 18, "names") == golden
    assert render_nodes_config(ENS, 18, "names", {0: "10.0.0.9"}) == golden
    assert golden.count(b"\n") == 18 and golden.endswith(b"imex-93a7a316-17\n")


def test_ips_mode_is_the_golden_file() -> None:
    golden = (GOLDEN / "nodes_config" / "ips_4.cfg").read_bytes()
    assert render_nodes_config(ENS, 4, "ips", {0: "10.0.0.1", 2: "fd00::3/64"}) == golden


def test_hosts_block_pins_absent_slots_to_127_0_0_2() -> None:
    assert render_hosts_block(ENS, 2, {1: "10.0.0.2"}) == (
        b"# BEGIN imex-ensemble gpu/gb200\n"
        b"127.0.0.2\timex-93a7a316-0\n"
        b"10.0.0.2\timex-93a7a316-1\n"
        b"# END imex-ensemble gpu/gb200\n"
    )


def test_renderers_refuse_out_of_range_and_garbage() -> None:
    with pytest.raises(InvalidIndex, match="out of range"):
        render_hosts_block(ENS, 4, {4: "10.0.0.1"})
    with pytest.raises(UnusableAddress):
        render_hosts_block(ENS, 4, {0: "10.0.0.1\n6.6.6.6 evil"})
    with pytest.raises(InvalidIndex, match="at least 1"):
        render_nodes_config(ENS, 0, "names")
    with pytest.raises(ValueError, match="mode"):
        render_nodes_config(ENS, 4, "hostnames")  # type: ignore[arg-type]
