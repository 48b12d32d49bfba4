"""The kube-proxy stand-in (tests/sandbox/balancer.py): DNAT to ready backends, the
client's address kept, readiness followed, a partition that answers nothing.

Real parts: nftables in the root namespace, two HTTP servers on the host side of a
namespace fabric, clients inside a namespace "VM".
"""

from __future__ import annotations

import http.server
import json
import os
import shutil
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from tests.sandbox.balancer import Balancer
from tests.sandbox.netns import Fabric

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (namespaces, nftables)"),
    pytest.mark.skipif(shutil.which("nft") is None, reason="nftables (nft) is not installed"),
    pytest.mark.timeout(60),
]


class Server(http.server.ThreadingHTTPServer):
    ready = True
    name = ""


class Handler(http.server.BaseHTTPRequestHandler):
    server: Server

    def do_GET(self) -> None:
        if self.path == "/readyz":
            code, body = (200, b"ok") if self.server.ready else (503, b"no")
        else:
            code = 200
            body = json.dumps({"who": self.server.name, "peer": self.client_address[0]}).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


@pytest.fixture
def rig() -> Iterator[tuple[Fabric, Balancer, list[Server], str]]:
    with Fabric("lbt", gateway=True) as fabric:
        vip = fabric.gateway_ip
        assert vip is not None
        servers = []
        for name in ("a", "b"):
            srv = Server((vip, free_port(vip)), Handler)
            srv.name = name
            threading.Thread(target=srv.serve_forever, daemon=True).start()
            servers.append(srv)
        port = free_port(vip)
        lb = Balancer.over(vip, port, [(vip, s.server_address[1]) for s in servers],
                           period=0.1, timeout=0.3).start()
        fabric.add_node("c")
        try:
            yield fabric, lb, servers, f"http://{vip}:{port}"
        finally:
            lb.close()
            for s in servers:
                s.shutdown()
                s.server_close()


FETCH = ("import json,sys,urllib.request\n"
         "out=[]\n"
         "for _ in range(int(sys.argv[2])):\n"
         "    try:\n"
         "        out.append(json.load(urllib.request.urlopen(sys.argv[1]+'/who',timeout=2)))\n"
         "    except Exception as e:\n"
         "        out.append({'error': type(e).__name__})\n"
         "print(json.dumps(out))\n")


def fetch(fabric: Fabric, url: str, n: int = 30) -> list[dict[str, str]]:
    node = fabric.node("c")
    proc = node.run([sys.executable, "-c", FETCH, url, str(n)], timeout=60)
    result: list[dict[str, str]] = json.loads(proc.stdout)
    return result


def wait_ready(lb: Balancer, want: list[int]) -> None:
    deadline = time.monotonic() + 5
    while lb.ready() != want:
        assert time.monotonic() < deadline, lb.ready()
        time.sleep(0.05)


def test_spreads_over_ready_backends_and_keeps_the_clients_address(
        rig: tuple[Fabric, Balancer, list[Server], str]) -> None:
    fabric, lb, _servers, url = rig
    wait_ready(lb, [0, 1])
    answers = fetch(fabric, url)
    assert {a["who"] for a in answers} == {"a", "b"}
    client_ip = fabric.node("c").addresses()[0].split("/")[0]
    assert {a["peer"] for a in answers} == {client_ip}  # no SNAT: the registry's check holds


def test_follows_readiness_and_refuses_without_ready_backends(
        rig: tuple[Fabric, Balancer, list[Server], str]) -> None:
    fabric, lb, servers, url = rig
    wait_ready(lb, [0, 1])
    servers[0].ready = False
    wait_ready(lb, [1])
    assert {a.get("who") for a in fetch(fabric, url, 10)} == {"b"}
    servers[1].ready = False
    wait_ready(lb, [])
    assert {a.get("error") for a in fetch(fabric, url, 3)} == {"ConnectionRefusedError"} or \
        all("error" in a for a in fetch(fabric, url, 3))
    servers[0].ready = True
    wait_ready(lb, [0])
    assert {a.get("who") for a in fetch(fabric, url, 5)} == {"a"}


def test_a_partitioned_backend_answers_nothing(
        rig: tuple[Fabric, Balancer, list[Server], str]) -> None:
    fabric, lb, _servers, url = rig
    wait_ready(lb, [0, 1])
    lb.partition(0)
    assert lb.ready() == [1]
    assert {a.get("who") for a in fetch(fabric, url, 10)} == {"b"}
    direct = f"http://{lb.backends[0].host}:{lb.backends[0].port}"
    t0 = time.monotonic()
    (answer,) = fetch(fabric, direct, 1)
    assert answer.get("error") in ("TimeoutError", "URLError", "timeout")  # silence, no reset
    assert time.monotonic() - t0 >= 1.5
