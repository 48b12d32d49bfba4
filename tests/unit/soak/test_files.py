"""The soak's torn-file verdicts (tests/soak/files.py) on whole, torn and empty reads."""

from __future__ import annotations

from imex_shared.model import EnsembleId
from imex_shared.render import render_nodes_config
from tests.soak.files import check_hosts, check_nodes

ENS = EnsembleId("rack", "gb200")


def _block(ips: dict[int, str], n: int = 3) -> str:
    lines = [ENS.block_begin]
    lines += [f"{ips.get(i, '127.0.0.2')}\t{ENS.slot(i)}" for i in range(n)]
    return "\n".join([*lines, ENS.block_end]) + "\n"


def test_whole_hosts_files_pass_and_give_their_pins() -> None:
    head = "127.0.0.1\tlocalhost\n# comment\n\n::1 localhost ip6-localhost\n"
    got = check_hosts((head + _block({0: "10.0.0.5"})).encode(), ENS, 3)
    assert got.ok and got.block == {0: "10.0.0.5", 1: "127.0.0.2", 2: "127.0.0.2"}
    bare = check_hosts(head.encode(), ENS, 3)  # cloud-init's rewrite: no block yet
    assert bare.ok and bare.block is None


def test_torn_or_empty_hosts_files_are_named() -> None:
    whole = "127.0.0.1 localhost\n" + _block({0: "10.0.0.5"})
    assert check_hosts(b"", ENS, 3).why == "empty"
    cut = whole[: whole.index(ENS.block_end) - 3]
    assert not check_hosts(cut.encode(), ENS, 3).ok
    tail = whole + "0.0.5\tgb200"
    assert "not an entry" in check_hosts(tail.encode(), ENS, 3).why or \
        not check_hosts(tail.encode(), ENS, 3).ok
    assert "2 BEGIN" in check_hosts((whole + _block({})).encode(), ENS, 3).why
    assert "not 3" in check_hosts(_block({}, 2).encode(), ENS, 3).why
    assert "UTF-8" in check_hosts(b"\xff\n", ENS, 3).why
    outside = whole + f"10.0.0.9\t{ENS.slot(1)}\n"
    assert "outside the block" in check_hosts(outside.encode(), ENS, 3).why


def test_nodes_file_is_whole_or_named() -> None:
    want = render_nodes_config(ENS, 3, "names")
    assert check_nodes(want, ENS, 3, booting=False) == ""
    assert check_nodes(b"", ENS, 3, booting=True) == ""
    assert check_nodes(b"", ENS, 3, booting=False) == "empty"
    assert "not the" in check_nodes(want[:-4], ENS, 3, booting=False)
