"""The hazard portreserve.py removes, on the real kernel, in a namespace of our own.

With the ephemeral range narrowed to IMEX's port, an outgoing connection is given
that port and a later bind to it fails with EADDRINUSE, SO_REUSEADDR or not (what
make test's sandbox once saw for four IMEX starts); with the port reserved, the
connection gets another port and the bind works. The host's sysctls are untouched:
both are per network namespace.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.guest_support.agent import env
from tests.sandbox.netns import Fabric, Node

pytestmark = pytest.mark.root

PROBE = """
import socket, sys
from pathlib import Path
from guest_agent.net.portreserve import reserve_port
reserve, port_range = sys.argv[1] == "1", sys.argv[2]
Path("/proc/sys/net/ipv4/ip_local_port_range").write_text(port_range)
if reserve:
    assert reserve_port(50000)
srv = socket.socket()
srv.bind(("127.0.0.1", 40000))
srv.listen()
conn = socket.create_connection(("127.0.0.1", 40000))
imex = socket.socket()
imex.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
try:
    imex.bind(("127.0.0.1", 50000))
    imex.listen()
    bound = "bound"
except OSError as exc:
    bound = f"errno {exc.errno}"
print(conn.getsockname()[1], bound)
"""


@pytest.fixture
def node() -> Iterator[Node]:
    with Fabric("gprs") as fab:
        n = fab.add_node("p0")
        n.run(["ip", "link", "set", "lo", "up"])
        yield n


def probe(node: Node, reserve: bool, port_range: str) -> tuple[int, str]:
    out = node.run([sys.executable, "-c", PROBE, "1" if reserve else "0", port_range],
                   env=env(), check=False)
    assert out.returncode == 0, out.stderr
    local, bound = out.stdout.split(maxsplit=1)
    return int(local), bound.strip()


def test_a_connection_given_imex_port_blocks_its_bind_unless_reserved(node: Node) -> None:
    host_before = Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text()
    assert probe(node, False, "50000 50000") == (50000, "errno 98")
    assert probe(node, True, "50000 50001") == (50001, "bound")
    assert node.run(["cat", "/proc/sys/net/ipv4/ip_local_reserved_ports"]).stdout == "50000\n"
    assert Path("/proc/sys/net/ipv4/ip_local_reserved_ports").read_text() == host_before
