"""What a change costs the IMEX stand-in (issue 27): /etc/hosts is parsed once per change,
not once per peer, and never through a thread; the state file once per loop turn."""

from __future__ import annotations

import asyncio
import json
import os
import threading
from pathlib import Path

from tests.sandbox.imex_standin import HostsFile, ImexStandin, Options, parse_config, parse_hosts


def test_parse_hosts_reads_like_the_files_source() -> None:
    text = ("127.0.0.1 localhost\n# comment 10.0.0.9 a\n10.0.0.1 A.example a  # trailing\n"
            "fe80::1%eth0 a\n10.0.0.2 b\nnot-an-ip c\n10.0.0.1 a\n")
    assert parse_hosts(text) == {"localhost": ["127.0.0.1"], "a.example": ["10.0.0.1"],
                                 "a": ["10.0.0.1", "fe80::1"], "b": ["10.0.0.2"]}


def test_hosts_file_is_parsed_again_only_when_it_changed(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("10.0.0.1 a\n10.0.0.2 b\n")
    hosts = HostsFile(path)
    for _ in range(17):  # one SIGUSR1: every peer re-resolved
        assert hosts.lookup("a") == ["10.0.0.1"]
    assert hosts.lookup("B") == ["10.0.0.2"]
    assert hosts.lookup("c") is None  # not in the file: the resolver's (DNS) turn
    assert hosts.lookup("10.0.0.7") == ["10.0.0.7"]
    assert hosts.parses == 1
    new = tmp_path / "hosts.new"  # the guest agent's atomic rewrite
    new.write_text("10.0.0.9 a\n")
    os.replace(new, path)
    assert hosts.lookup("a") == ["10.0.0.9"] and hosts.lookup("b") is None
    assert hosts.parses == 2


def test_the_state_file_is_written_once_per_loop_turn(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    opts = Options.__new__(Options)
    object.__setattr__(opts, "state_file", state)
    daemon = ImexStandin.__new__(ImexStandin)
    daemon.opts = opts
    daemon._state_due = False
    writes = []
    daemon.state_doc = lambda: (writes.append(1), {"n": len(writes)})[1]  # type: ignore[method-assign]

    async def change_many() -> None:
        for _ in range(34):  # 17 links lost and found again
            daemon.write_state()
        await asyncio.sleep(0)
        await asyncio.sleep(0)

    threads = threading.active_count()
    asyncio.run(change_many())
    assert len(writes) == 1 and json.loads(state.read_text()) == {"n": 1}
    assert threading.active_count() == threads


def test_the_pong_is_encoded_again_only_when_what_it_shows_changed() -> None:
    """Every peer pings every 0.5 s; the pong's 17-link view is kept as one bytes object
    (an incoming link sends the short pong while it is the same object) until a link's
    status or address, or the daemon's state, changes."""
    cfg = parse_config("IMEX_NODE_CONFIG_FILE=/nonexistent\n")
    daemon = ImexStandin(Options(Path("config.cfg"), cfg), ["a", "b", "c"], 0, "10.0.0.1")
    first = daemon.own_view_line()
    assert daemon.own_view_line() is first
    assert json.loads(first) == {"type": "pong", "status": daemon.own_view()}

    seen = [first]
    daemon.links[1].set_status("CONNECTED")
    daemon.links[2].set_ip("10.0.0.3")
    daemon.set_state("READY")
    for change in (lambda: daemon.links[1].set_status("DISCONNECTED"),
                   lambda: daemon.links[2].set_ip("10.0.0.4"),
                   lambda: daemon.set_state("WAITING_FOR_PEERS")):
        before = daemon.own_view_line()
        change()
        after = daemon.own_view_line()
        assert after is not before and after not in seen
        assert json.loads(after) == {"type": "pong", "status": daemon.own_view()}
        seen.append(after)
    view = json.loads(seen[-1])["status"]
    assert view["status"] == "WAITING_FOR_PEERS"
    assert view["connections"]["1"]["status"] == "DISCONNECTED"
    assert view["connections"]["2"]["host"] == "10.0.0.4"

    unchanged = daemon.own_view_line()
    daemon.links[1].set_status("DISCONNECTED")  # no change: the same object
    daemon.links[2].set_ip("10.0.0.4")
    daemon.set_state("WAITING_FOR_PEERS")
    assert daemon.own_view_line() is unchanged


def test_the_stand_in_starts_from_bytecode() -> None:
    """A stand-in starts again on every own-address move; ``precompile`` writes its
    bytecode cache whatever PYTHONDONTWRITEBYTECODE says, as a real daemon is a binary."""
    import importlib.util

    from tests.sandbox import imex_standin

    cache = Path(importlib.util.cache_from_source(imex_standin.__file__))
    cache.unlink(missing_ok=True)
    imex_standin.precompile.cache_clear()
    imex_standin.precompile()
    assert cache.is_file() and cache.stat().st_size > 10_000
    cache.unlink()
    imex_standin.precompile()  # once per process: a second call writes nothing
    assert not cache.exists()
    imex_standin.precompile.cache_clear()
    imex_standin.precompile()
    assert cache.is_file()
