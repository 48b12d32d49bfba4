"""Merging our block into /etc/hosts: golden cases and properties."""

from __future__ import annotations

import ipaddress
import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from imex_shared.hostsfile import merge_hosts, read_block
from imex_shared.model import ABSENT_IP, EnsembleId
from imex_shared.render import render_hosts_block

GOLDEN = Path(__file__).parents[2] / "golden" / "hosts"
ENS = EnsembleId("gpu", "gb200")
OTHER = EnsembleId("gpu", "other")
CASES = json.loads((GOLDEN / "cases.json").read_text())


def _pins(case: str) -> dict[int, str]:
    return {int(k): v for k, v in CASES[case]["pins"].items()}


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_merge(case: str) -> None:
    merged = merge_hosts((GOLDEN / f"{case}.in").read_bytes(), ENS, 4, _pins(case))
    assert merged == (GOLDEN / f"{case}.out").read_bytes()


@pytest.mark.parametrize("case", sorted(CASES))
def test_golden_merge_is_idempotent_and_readable(case: str) -> None:
    out = (GOLDEN / f"{case}.out").read_bytes()
    assert merge_hosts(out, ENS, 4, _pins(case)) == out
    expected = {i: str(ipaddress.ip_address(_pins(case).get(i, ABSENT_IP))) for i in range(4)}
    assert read_block(out, ENS) == expected


def test_read_block_absent() -> None:
    assert read_block(b"127.0.0.1 localhost\n", ENS) is None


def test_second_block_of_ours_is_dropped_first_position_kept() -> None:
    block = (
        b"# BEGIN imex-ensemble gpu/gb200\n10.0.0.1\timex-93a7a316-0\n"
        b"# END imex-ensemble gpu/gb200\n"
    )
    merged = merge_hosts(b"a 1\n" + block + b"b 2\n" + block + b"c 3\n", ENS, 1, {0: "10.0.0.7"})
    assert merged == (
        b"a 1\n# BEGIN imex-ensemble gpu/gb200\n10.0.0.7\timex-93a7a316-0\n"
        b"# END imex-ensemble gpu/gb200\nb 2\nc 3\n"
    )


# -- properties -----------------------------------------------------------

_ip = st.one_of(
    st.ip_addresses(v=4).filter(lambda a: not a.is_loopback).map(str),
    st.ip_addresses(v=6).map(str),
)
_pins_st = st.dictionaries(st.integers(0, 5), _ip, max_size=6)
_name = st.from_regex(r"[a-z][a-z0-9.-]{0,20}", fullmatch=True)
_foreign_line = st.one_of(
    st.builds(
        lambda ip, names: f"{ip}\t{' '.join(names)}", _ip, st.lists(_name, min_size=1, max_size=3)
    ),
    st.from_regex(r"#[ -~]{0,30}", fullmatch=True),
    st.just(""),
    st.just("   \t "),
    st.builds(lambda ip, n: f"{ip} {n}  # trailing", _ip, _name),
)
_ending = st.sampled_from(["\n", "\r\n"])


@st.composite
def _foreign_file(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(st.tuples(_foreign_line, _ending), max_size=12))
    text = "".join(line + end for line, end in lines)
    if text and draw(st.booleans()):
        text = text.rstrip("\r\n")  # no final newline
    return text.encode()


def _without_block(data: bytes, ens: EnsembleId) -> bytes:
    lines = data.split(b"\n")
    out, inside = [], False
    for line in lines:
        if line == ens.block_begin.encode():
            inside = True
        elif line == ens.block_end.encode():
            inside = False
        elif not inside:
            out.append(line)
    return b"\n".join(out)


@settings(max_examples=300, deadline=None)
@given(_foreign_file(), _pins_st)
def test_foreign_bytes_preserved(foreign: bytes, pins: dict[int, str]) -> None:
    merged = merge_hosts(foreign, ENS, 6, pins)
    # Every foreign byte kept, plus only the one newline a final line without one needs.
    prefix = foreign if foreign.endswith(b"\n") or not foreign else foreign + b"\n"
    assert merged == prefix + render_hosts_block(ENS, 6, pins)


@settings(max_examples=300, deadline=None)
@given(_foreign_file(), _pins_st, _pins_st)
def test_idempotent_and_last_merge_wins(
    foreign: bytes, first: dict[int, str], second: dict[int, str]
) -> None:
    once = merge_hosts(foreign, ENS, 6, first)
    assert merge_hosts(once, ENS, 6, first) == once
    again = merge_hosts(once, ENS, 6, second)
    assert again == merge_hosts(foreign, ENS, 6, second)


@settings(max_examples=200, deadline=None)
@given(_foreign_file(), _pins_st, st.lists(st.tuples(_ip, st.integers(0, 9)), max_size=5))
def test_no_slot_line_outside_block(
    foreign: bytes, pins: dict[int, str], strays: list[tuple[str, int]]
) -> None:
    dirty = foreign + b"".join(f"\n{ip}\tkeep-me {ENS.slot(i)}\n".encode() for ip, i in strays)
    merged = merge_hosts(dirty, ENS, 6, pins)
    outside = _without_block(merged, ENS)
    for line in outside.split(b"\n"):
        names = line.split(b"#")[0].split()[1:]
        assert not any(ENS.slot_index(n.decode()) is not None for n in names), line
    assert outside.count(b"keep-me") == len(strays)


@settings(max_examples=200, deadline=None)
@given(_foreign_file(), _pins_st, _pins_st)
def test_two_ensembles_blocks_are_independent(
    foreign: bytes, a: dict[int, str], b: dict[int, str]
) -> None:
    both = merge_hosts(merge_hosts(foreign, ENS, 6, a), OTHER, 6, b)
    assert read_block(both, ENS) == read_block(merge_hosts(foreign, ENS, 6, a), ENS)
    assert read_block(both, OTHER) == read_block(merge_hosts(foreign, OTHER, 6, b), OTHER)
    # Re-merging one ensemble never touches the other's block.
    changed = merge_hosts(both, ENS, 6, b)
    assert read_block(changed, OTHER) == read_block(both, OTHER)
