"""The IMEX stand-in's reconnect loop, as the peers benchmark (issue 18) relies on it.

Real processes in network namespaces, each with its own /etc/hosts; the daemon's
``--attempt-log`` is read as the benchmark reads it. What is checked is FACTS.md's
reconnect loop: a fresh resolution on every attempt (so an /etc/hosts change is seen
without a signal), 500 ms backing off to 3 s, every resolved address dialled in order,
and attempts counted per target address.
"""

from __future__ import annotations

import ipaddress
import itertools
import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest

from tests.sandbox.imex_standin import StandinProcess, write_standin_files
from tests.sandbox.netns import Fabric

pytestmark = [pytest.mark.root, pytest.mark.usefixtures("imex_impl")]

SLOT = "imex-a77e0001"
T = TypeVar("T")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}; last probe: {last!r}")


def events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line]
    except FileNotFoundError:
        return []


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with Fabric("stat") as fab:
        yield fab


@pytest.fixture
def daemons() -> Iterator[list[StandinProcess]]:
    started: list[StandinProcess] = []
    yield started
    for d in started:
        d.stop(5)


def start(fabric_node: Any, d: Path, entries: list[str],
          daemons: list[StandinProcess]) -> tuple[StandinProcess, Path]:
    cfg = write_standin_files(d, entries)
    log = d / "attempts.jsonl"
    imex = StandinProcess.start(cfg, node=fabric_node, args=["--attempt-log", str(log)])
    daemons.append(imex)
    return imex, log


def test_backoff_and_fresh_resolution_without_a_signal(
    fabric: Fabric, tmp_path: Path, daemons: list[StandinProcess]
) -> None:
    a, b = fabric.add_node(), fabric.add_node()
    names = [f"{SLOT}-0", f"{SLOT}-1"]
    # slot 1 is unknown to a at first: every attempt is a failed resolution
    a.write_hosts(fabric.hosts_lines({names[0]: a.ip}))
    imex_a, log = start(a, tmp_path / "a", names, daemons)
    wait_for("six failed resolutions",
             lambda: len([e for e in events(log) if e.get("outcome") == "no_address"]) >= 6)
    fails = [e["t"] for e in events(log) if e.get("outcome") == "no_address"]
    gaps = [later - earlier for earlier, later in itertools.pairwise(fails)]
    # 0.5, 1, 2, 3, 3 s (each gap also holds one failed lookup: loopback, ~ms)
    for got, want in zip(gaps, [0.5, 1.0, 2.0, 3.0, 3.0], strict=False):
        assert want <= got < want + 0.4, (gaps, want)

    # b comes up and a's hosts file learns it: no signal, the next attempt resolves afresh
    b.write_hosts(fabric.hosts_lines({names[0]: a.ip, names[1]: b.ip}))
    start(b, tmp_path / "b", names, daemons)
    a.write_hosts(fabric.hosts_lines({names[0]: a.ip, names[1]: b.ip}))
    wait_for("a CONNECTED to b", lambda: imex_a.state().get("peers", {}).get("1", {})
             .get("status") == "CONNECTED")
    assert events(log)[0] == {"ev": "listening", "t": events(log)[0]["t"], "ip": a.ip,
                              "port": 50000}
    connected = [e for e in events(log) if e.get("outcome") == "connected"]
    assert [e["ip"] for e in connected] == [b.ip]
    assert imex_a.state()["signals_received"] == 0
    assert imex_a.state()["attempts_by_ip"][b.ip] >= 1


def test_every_address_is_dialled_in_order_and_counted(
    fabric: Fabric, tmp_path: Path, daemons: list[StandinProcess]
) -> None:
    # glibc sorts a name's addresses (RFC 6724, longest matching prefix first), so the
    # dead address is the one next to a's own: it is dialled first
    base = ipaddress.ip_address(fabric.subnet.network_address)
    a = fabric.add_node(ip_addr=str(base + 100))
    idle = fabric.add_node(ip_addr=str(base + 101))
    b = fabric.add_node(ip_addr=str(base + 200))
    names = [f"{SLOT}-0", f"{SLOT}-1"]
    # the name gives two addresses: first one where nothing listens (refused), then b
    hosts = fabric.hosts_lines({names[0]: a.ip}) + f"{idle.ip}\t{names[1]}\n{b.ip}\t{names[1]}\n"
    a.write_hosts(hosts)
    b.write_hosts(fabric.hosts_lines({names[0]: a.ip, names[1]: b.ip}))
    start(b, tmp_path / "b", names, daemons)
    imex_a, log = start(a, tmp_path / "a", names, daemons)
    wait_for("a CONNECTED to b", lambda: imex_a.state().get("peers", {}).get("1", {})
             .get("status") == "CONNECTED")
    tries = [(e["ip"], e["outcome"]) for e in events(log) if e["ev"] == "attempt"]
    first_connect = tries.index((b.ip, "connected"))
    assert (idle.ip, "refused") in tries[:first_connect]
    counts = imex_a.state()["attempts_by_ip"]
    assert counts[idle.ip] >= 1 and counts[b.ip] >= 1


def test_attempts_to_a_dead_address_stop_once_it_is_pinned_away(
    fabric: Fabric, tmp_path: Path, daemons: list[StandinProcess]
) -> None:
    a, b = fabric.add_node(), fabric.add_node()
    names = [f"{SLOT}-0", f"{SLOT}-1"]
    both = fabric.hosts_lines({names[0]: a.ip, names[1]: b.ip})
    a.write_hosts(both)
    b.write_hosts(both)
    _, imex_b_log = start(b, tmp_path / "b", names, daemons)
    imex_a, log = start(a, tmp_path / "a", names, daemons)
    wait_for("a CONNECTED to b", lambda: imex_a.state().get("peers", {}).get("1", {})
             .get("status") == "CONNECTED")
    daemons[0].stop()  # b's daemon goes: a sees the link lost, then refused dials
    wait_for("two refused dials to b", lambda: len(
        [e for e in events(log) if e["ip"] == b.ip and e.get("outcome") == "refused"]) >= 2)
    assert any(e["ev"] == "lost" and e["ip"] == b.ip for e in events(log))
    a.write_hosts(fabric.hosts_lines({names[0]: a.ip, names[1]: "127.0.0.2"}))
    wait_for("a dial to 127.0.0.2", lambda: any(e["ip"] == "127.0.0.2" for e in events(log)))
    pinned_at = next(e["t"] for e in events(log) if e["ip"] == "127.0.0.2")
    time.sleep(3.5)  # more than one full backoff step
    late = [e for e in events(log) if e["ip"] == b.ip and e["t"] > pinned_at]
    assert late == []
    assert imex_b_log.exists()
