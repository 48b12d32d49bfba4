"""The agent's own work stops within 2 s of SIGTERM, whatever it is waiting on.

Issue 14's "prompt stop": the storm benchmark saw ``agent ignored SIGTERM for 10s``. The
agent here runs in a network namespace (its own ``/etc/resolv.conf``) next to a second
namespace whose DNS server (UDP 53) and registry (TCP 8080) accept and never answer, so at
the moment of SIGTERM the agent is inside:

* a long-poll that hangs (TCP connected, no response),
* a DNS query that hangs (the fallback discovery asking the silent server), and, with the
  registry given by name,
* a ``getaddrinfo`` that hangs in asyncio's resolver thread (the system resolver asking the
  silent server, ``timeout:30``): the case that held the process up until the thread
  returned, because ``asyncio.run()`` joins its default executor on the way out.

In every IMEX mode the process must exit within 2 s of the signal, with exit code 0. A
process-mode child keeps its own documented grace (SIGTERM, up to 10 s, SIGKILL); the one
used here exits at once.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from guest_agent.daemon import STOP_DEADLINE
from guest_agent.imex.control import ProcessController
from tests.guest_support.agent import FAKE_IMEX, READY_CTL, AgentProc, read_events, write_config
from tests.sandbox.netns import Fabric, Node
from tests.timing import measured

pytestmark = [pytest.mark.root]

#: the contract: the agent's own work, from SIGTERM to exit
PROMPT = 2.0
#: what the test allows from SIGTERM to the process's exit, which adds the interpreter's
#: exit on a loaded machine: measured median 0.4 s, max 1.8 s (32 stops at load average
#: 6-32 from other jobs) and 1.4 s beside stress-ng (32), 2026-12-02. Any hung wait it
#: guards against lasts 20 s (the watchdog) or more.
STOPPED_WITHIN = 4.0


class Silent:
    """DNS and HTTP servers that take requests and never answer, inside ``node``."""

    def __init__(self, node: Node) -> None:
        with node.enter():
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind((node.ip, 53))
            self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self.tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self.tcp.bind((node.ip, 8080))
            self.tcp.listen(64)
        self.queries = 0
        self.connections: list[socket.socket] = []
        self._stop = threading.Event()
        threading.Thread(target=self._udp, daemon=True).start()
        threading.Thread(target=self._tcp, daemon=True).start()

    def _udp(self) -> None:
        self.udp.settimeout(0.2)
        while not self._stop.is_set():
            try:
                self.udp.recvfrom(4096)
                self.queries += 1
            except OSError:
                continue

    def _tcp(self) -> None:
        self.tcp.settimeout(0.2)
        while not self._stop.is_set():
            try:
                conn, _ = self.tcp.accept()
            except OSError:
                continue
            self.connections.append(conn)  # read nothing, answer nothing

    def close(self) -> None:
        self._stop.set()
        for s in (self.udp, self.tcp, *self.connections):
            s.close()


@pytest.fixture
def world() -> Iterator[tuple[Node, Silent]]:
    with Fabric("gstop") as fab:
        silent_node = fab.add_node("silent")
        resolv = f"nameserver {silent_node.ip}\noptions timeout:30 attempts:1\n"
        guest = fab.add_node("guest", resolv=resolv)
        srv = Silent(silent_node)
        try:
            yield guest, srv
        finally:
            srv.close()


def config(tmp_path: Path, silent: str, registry_host: str, mode: str) -> Path:
    values: dict[str, object] = {
        "ensemble": "gb200", "namespace": "gpu", "max_members": 4,
        "registry_url": f"http://{registry_host}:8080",
        "nameservers": [silent],
        "hosts_file": str(tmp_path / "hosts"),
        "nodes_config": str(tmp_path / "imex" / "nodes_config.cfg"),
        "status_file": str(tmp_path / "run" / "status.json"),
        "imex_control": mode,
        "own_index": 0,
        "poll_interval": 0.2,
        "dns_timeout": 30.0,
        "longpoll_timeout": 60.0,
    }
    if mode == "process":
        values["imex_command"] = [*FAKE_IMEX, "--log", str(tmp_path / "imex.log")]
        values["imex_ctl"] = READY_CTL
    (tmp_path / "hosts").write_text("127.0.0.1\tlocalhost\n")
    return write_config(tmp_path / "config.toml", values)


@pytest.mark.parametrize("mode", ["none", "process"])
@pytest.mark.parametrize("registry", ["ip", "name"])
def test_sigterm_ends_the_agent_within_2s_while_dns_and_the_long_poll_hang(
        world: tuple[Node, Silent], tmp_path: Path, mode: str, registry: str) -> None:
    guest, srv = world
    host = srv_ip = guest.fabric.nodes[0].ip
    if registry == "name":
        host = "registry.silent.test"  # getaddrinfo asks the silent server (timeout:30)
    agent = AgentProc(config(tmp_path, srv_ip, host, mode), tmp_path / "run" / "status.json",
                      tmp_path / "agent.log", wrap=guest.argv([]))
    try:
        # hanging for real: a DNS query sent, and (by IP) a long-poll connected
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not (
                srv.queries and (registry == "name" or srv.connections)):
            assert agent.proc.poll() is None, agent.log()
            time.sleep(0.1)
        assert srv.queries, f"no DNS query reached the silent server\n{agent.log()}"
        if registry == "ip":
            assert srv.connections, f"no registry connection\n{agent.log()}"
        time.sleep(1.0)  # well inside every wait (dns_timeout 30, long-poll 60, resolv 30)
        t0 = time.monotonic()
        code = agent.stop(timeout=STOP_DEADLINE + 5)
        took = measured(f"guest.agent.sigterm_{mode}_{registry}", time.monotonic() - t0)
    finally:
        if agent.proc.poll() is None:
            agent.kill()
    assert code == 0, agent.log()
    assert took < STOPPED_WITHIN, f"stopped {took:.2f} s after SIGTERM\n{agent.log()}"
    events = [e["event"] for e in read_events(tmp_path / "imex.log")]
    if mode == "process" and "start" in events:  # started on the startup deadline
        assert "term" in events


def test_process_mode_childs_grace_fits_under_the_watchdog_and_the_unit() -> None:
    """The child keeps its documented grace (SIGTERM, 10 s, SIGKILL: exercised with a short
    grace in tests/integration/guest/test_imex_process.py); the agent's own work adds at
    most 2 s; the stop watchdog and the unit's TimeoutStopSec are above both."""
    import configparser
    from importlib import resources

    grace = ProcessController([]).stop_timeout
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read_string(resources.files("guest_agent").joinpath(
        "data/imex-guest-agent.service").read_text())
    timeout_stop = float(unit["Service"]["TimeoutStopSec"])
    assert grace == 10.0
    assert grace + PROMPT < STOP_DEADLINE < timeout_stop


def test_the_sandbox_waits_for_the_whole_documented_stop() -> None:
    from tests.sandbox.ensemble import GUEST_STOP_WAIT

    assert ProcessController([]).stop_timeout + PROMPT <= GUEST_STOP_WAIT
