"""The two in-VM helpers of the peers benchmark, as real processes on loopback.

``recipe_boot.py`` must exec IMEX only once DNS answers the VM's own name with its own
address; ``floor_probe.py`` must follow the registry's long-poll and leave every answer's
members, and nothing else, in the hosts file.
"""

from __future__ import annotations

import http.server
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import dns.message
import dns.rcode
import dns.rrset
import pytest

from imex_shared.hostsfile import read_block
from imex_shared.model import EnsembleId

HERE = Path(__file__).resolve().parents[2] / "tests" / "bench" / "peers"
NAME = "vm-3.imex.recipe.svc.cluster.local"


class FakeDns:
    """Answers A queries for NAME with ``self.ip`` (NXDOMAIN while it is None)."""

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 53))  # recipe_boot asks port 53, as a guest does
        self.ip: str | None = None
        self.queries = 0
        self._stop = False
        self._t = threading.Thread(target=self._serve, daemon=True)
        self._t.start()

    def _serve(self) -> None:
        self.sock.settimeout(0.1)
        while not self._stop:
            try:
                wire, peer = self.sock.recvfrom(4096)
            except TimeoutError:
                continue
            q = dns.message.from_wire(wire)
            self.queries += 1
            r = dns.message.make_response(q)
            if self.ip is None:
                r.set_rcode(dns.rcode.NXDOMAIN)
            else:
                r.answer.append(dns.rrset.from_text(NAME + ".", 30, "IN", "A", self.ip))
            self.sock.sendto(r.to_wire(), peer)

    def close(self) -> None:
        self._stop = True
        self._t.join(2)
        self.sock.close()


@pytest.fixture
def fake_dns() -> Iterator[FakeDns]:
    try:
        d = FakeDns()
    except OSError as e:
        pytest.skip(f"port 53 on loopback is taken or not ours to bind: {e}")
    yield d
    d.close()


@pytest.mark.root
def test_recipe_boot_execs_imex_once_its_own_name_resolves(
    fake_dns: FakeDns, tmp_path: Path
) -> None:
    mark, out = tmp_path / "mark", tmp_path / "out"
    proc = subprocess.Popen([sys.executable, str(HERE / "recipe_boot.py"), "127.0.0.1", NAME,
                             "10.9.0.3", str(mark), "--", "/bin/sh", "-c",
                             f"echo started > {out}"])
    try:
        deadline = time.monotonic() + 30  # the interpreter's start, on a loaded machine
        while fake_dns.queries < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not out.exists() and fake_dns.queries >= 3  # NXDOMAIN: still waiting
        fake_dns.ip = "10.9.0.4"  # another VM's address under the name: keep waiting
        seen = fake_dns.queries
        while fake_dns.queries < seen + 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not out.exists()
        answered = time.time()
        fake_dns.ip = "10.9.0.3"
        assert proc.wait(10) == 0
        assert out.read_text() == "started\n"
        started = float(mark.read_text())
        # the wall time it saw its own address: after the answer changed, before its exit
        assert answered <= started <= time.time()
    finally:
        proc.kill()
        proc.wait()


def test_recipe_boot_refuses_a_bad_command_line(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, str(HERE / "recipe_boot.py"), "127.0.0.1", NAME],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage" in r.stderr


ENS = EnsembleId("gpu", "rack")


class Registry(http.server.BaseHTTPRequestHandler):
    """generation 1 at once; ``?wait=1`` is held 0.3 s, then generation 2 with vm-1 moved."""

    def do_GET(self) -> None:
        gen = 2 if "wait=1" in self.path else 1
        if gen == 2:
            time.sleep(0.3)
        ip1 = "10.0.0.21" if gen == 2 else "10.0.0.11"
        body = json.dumps({"generation": gen, "members": [
            {"index": 0, "slot": ENS.slot(0), "ip": "10.0.0.10"},
            {"index": 1, "slot": ENS.slot(1), "ip": ip1},
            {"index": 2, "slot": ENS.slot(2), "ip": None}]}).encode()
        if "wait=2" in self.path:
            time.sleep(5)  # parks: nothing changes any more
        try:
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except OSError:  # the probe was stopped while parked
            pass

    def log_message(self, *args: object) -> None:
        pass


def test_floor_probe_follows_the_long_poll_into_the_hosts_file(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Registry)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    hosts = tmp_path / "hosts"
    hosts.write_text("stale content that is longer than what the probe writes\n" * 20)
    proc = subprocess.Popen([sys.executable, str(HERE / "floor_probe.py"), "127.0.0.1",
                             str(server.server_address[1]), "gpu", "rack", str(hosts)])
    ens = ENS
    try:
        deadline = time.monotonic() + 10
        block = None
        while time.monotonic() < deadline:
            block = read_block(hosts.read_bytes(), ens)
            if block == {0: "10.0.0.10", 1: "10.0.0.21"}:
                break
            time.sleep(0.05)
        assert block == {0: "10.0.0.10", 1: "10.0.0.21"}
        text = hosts.read_text()
        assert text.startswith("127.0.0.1\tlocalhost\n# BEGIN imex-ensemble gpu/rack\n")
        assert "stale" not in text and text.endswith("# END imex-ensemble gpu/rack\n")
    finally:
        proc.kill()
        proc.wait()
        server.shutdown()
