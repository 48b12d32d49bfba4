"""/etc/hosts as arbitrary bytes (issue 30): invalid UTF-8, NUL, lines of 1 MB, stray
BEGIN/END markers, another ensemble's markers nested inside ours, CRLF, no final newline.

Properties: the merge never raises; what the Applier leaves on disk is exactly the merged
bytes (never a partial file), pins exactly the wanted members and 127.0.0.2 for the rest,
holds one block of ours, and a second pass writes nothing.
"""

from __future__ import annotations

import ipaddress
from pathlib import Path

from hypothesis import example, given
from hypothesis import strategies as st

from guest_agent.config import settings_from_mapping
from guest_agent.files.apply import Applier
from imex_shared.hostsfile import merge_hosts, read_block
from imex_shared.model import ABSENT_IP, EnsembleId
from tests.fuzz.budget import count, fuzz

ENS = EnsembleId("gpu", "gb200")
OTHER = EnsembleId("gpu", "gb200-b")
N = 6

_ip = st.one_of(st.ip_addresses(v=4).filter(lambda a: not a.is_loopback).map(str),
                st.ip_addresses(v=6).filter(lambda a: not a.is_loopback).map(str))
_pins = st.dictionaries(st.integers(0, N - 1), _ip, max_size=N)
_marker = st.sampled_from([ENS.block_begin, ENS.block_end, OTHER.block_begin,
                           OTHER.block_end, " " + ENS.block_begin + " \t",
                           ENS.block_begin + "x", "# BEGIN imex-ensemble"]).map(str.encode)
_slot_line = st.builds(lambda ip, name, extra: f"{ip}\t{name}{extra}".encode(), _ip,
                       st.one_of(st.integers(0, 9).map(ENS.slot), st.sampled_from(
                           ["\u00b2", "\u0661", "01", "x", "-1"]).map(ENS.slot(0)[:-1].__add__)),
                       st.sampled_from(["", " other", " # c"]))
_chunk = st.one_of(
    _marker, _slot_line, st.binary(max_size=40),
    st.sampled_from([b"\xff\xfe\x80", b"\x00", b"\r", b"\r\n", b"\n", b"\t", b"#",
                     b"127.0.0.1 localhost", b"::1 ip6-localhost"]),
    st.text(max_size=20).map(lambda t: t.encode("utf-8", "surrogatepass")),
)
_ending = st.sampled_from([b"\n", b"\r\n", b"", b"\r"])


@st.composite
def hosts_bytes(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(st.tuples(st.lists(_chunk, max_size=4), _ending), max_size=14))
    data = b"".join(b"".join(parts) + end for parts, end in lines)
    if draw(st.integers(0, 24)) == 0:  # now and then a line of 1 MB
        data += b"10.1.1.1 " + b"a" * (1 << 20) + draw(_ending)
    return data


def _expected(pins: dict[int, str]) -> dict[int, str]:
    return {i: str(ipaddress.ip_address(pins.get(i, ABSENT_IP))) for i in range(N)}


NESTED = (f"{ENS.block_begin}\n10.0.0.1\t{ENS.slot(0)}\n{OTHER.block_begin}\n"
          f"10.9.9.9\t{OTHER.slot(1)}\n{ENS.block_end}\n{OTHER.block_end}\n").encode()


@fuzz
@given(hosts_bytes(), _pins)
@example(b"\xff\x00" + ENS.block_begin.encode() + b"\r\n" + ENS.block_end.encode(), {0: "10.0.0.2"})
@example(NESTED, {1: "10.0.0.3"})
@example(f"10.0.0.9\t{ENS.slot(0)[:-1]}\u00b2\n".encode(), {0: "10.0.0.2"})  # found: a crash
@example(ENS.block_begin.encode() + b"\n10.0.0.1 a\n", {})  # BEGIN with no END
@example(ENS.block_end.encode() + b"\n" + ENS.block_begin.encode(), {2: "fd00::2"})
def test_any_hosts_file_merges_and_is_written_whole(tmp_path_factory: object, data: bytes,
                                                     pins: dict[int, str]) -> None:
    count("hosts_bytes")
    merged = merge_hosts(data, ENS, N, pins)
    assert read_block(merged, ENS) == _expected(pins)
    assert merge_hosts(merged, ENS, N, pins) == merged  # idempotent
    lines = [line.rstrip(b"\r\n").strip() for line in merged.split(b"\n")]
    assert lines.count(ENS.block_begin.encode()) == 1
    assert read_block(merge_hosts(merged, OTHER, N, pins), ENS) == _expected(pins)

    root = Path(tmp_path_factory.mktemp("hosts"))  # type: ignore[attr-defined]
    hosts, nodes = root / "hosts", root / "nodes_config.cfg"
    hosts.write_bytes(data)
    settings = settings_from_mapping({"ensemble": ENS.name, "namespace": ENS.namespace,
                                      "max_members": N, "hosts_file": str(hosts),
                                      "nodes_config": str(nodes)})
    applier = Applier(settings)
    applier.apply(pins)
    assert hosts.read_bytes() == merged  # the whole file, never a part
    assert nodes.read_bytes() == applier.nodes_bytes(pins)
    again = applier.assert_files()
    assert again is not None and not again.hosts_written and not again.nodes_written
    assert sorted(p.name for p in root.iterdir()) == ["hosts", "nodes_config.cfg"]  # no temp
