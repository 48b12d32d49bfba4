"""Network-namespace "VMs": separate stacks and hosts files, address changes, sure teardown."""

from __future__ import annotations

import asyncio
import errno
import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.sandbox import netns as netns_mod
from tests.sandbox.dns_server import ClusterDnsModel, DnsServer
from tests.sandbox.netns import Fabric, Node, cleanup_stale, in_netns, list_netns

pytestmark = pytest.mark.root
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with Fabric("stdn", nodes=2) as fab:
        yield fab


def listen(node: Node, addr: str | None = None) -> socket.socket:
    with node.enter():
        fam = socket.AF_INET6 if addr and ":" in addr else socket.AF_INET
        s = socket.socket(fam)
        s.bind((addr or node.ip, 0))
        s.listen()
    return s


def can_connect(node: Node, addr: str, port: int, timeout: float = 1.0) -> bool:
    with node.enter():
        try:
            socket.create_connection((addr, port), timeout).close()
            return True
        except OSError:
            return False


def connects(node: Node, addr: str, port: int, within: float = 5.0) -> bool:
    """A positive check: retried until ``within`` (a loaded machine may be slow to ARP)."""
    deadline = time.monotonic() + within
    while not can_connect(node, addr, port):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def test_nodes_reach_each_other_only_inside_the_fabric(fabric: Fabric) -> None:
    a, b = fabric.nodes
    assert a.ip != b.ip and a.addresses() == [a.ip]
    srv = listen(b)
    port = srv.getsockname()[1]
    assert connects(a, b.ip, port)
    # the root namespace has no route into a fabric without a gateway
    with pytest.raises(OSError):
        socket.create_connection((b.ip, port), 0.5).close()
    srv.close()
    # in_netns only moved the calling thread for the block
    with socket.socket() as s, pytest.raises(OSError):
        s.bind((a.ip, 0))


def test_each_node_sees_its_own_hosts_and_resolv(fabric: Fabric) -> None:
    a, b = fabric.nodes
    a.write_hosts(fabric.hosts_lines({"peer-x": "10.9.9.1"}))
    b.write_hosts(fabric.hosts_lines({"peer-x": "10.9.9.2"}))
    b.write_resolv("nameserver 10.9.9.53\n")
    assert a.run(["getent", "hosts", "peer-x"]).stdout.split()[0] == "10.9.9.1"
    assert b.run(["getent", "hosts", "peer-x"]).stdout.split()[0] == "10.9.9.2"
    assert b.run(["cat", "/etc/resolv.conf"]).stdout == "nameserver 10.9.9.53\n"
    assert "peer-x" not in Path("/etc/hosts").read_text()


def test_hosts_rewrite_reaches_running_processes_and_replace_is_ebusy(fabric: Fabric) -> None:
    a = fabric.nodes[0]
    a.write_hosts("127.0.0.1\tlocalhost\n")
    proc = a.popen(["sh", "-c", "read _; cat /etc/hosts"], stdin=subprocess.PIPE,
                   stdout=subprocess.PIPE, text=True)
    a.write_hosts("127.0.0.1\tlocalhost\n10.7.7.7\tlate-name\n")
    out, _ = proc.communicate("go\n", timeout=10)
    assert "late-name" in out  # same inode: the bind mount shows the new text
    # inside the namespace /etc/hosts is a bind mount: replacing it fails (FACTS.md)
    code = ("import os,errno\nopen('/etc/hosts.stdn','w').close()\n"
            "try:\n os.replace('/etc/hosts.stdn','/etc/hosts')\nexcept OSError as e:\n"
            " print(e.errno)\nfinally:\n"
            " os.path.exists('/etc/hosts.stdn') and os.unlink('/etc/hosts.stdn')\n")
    res = a.run([sys.executable, "-c", code])
    assert res.stdout.strip() == str(errno.EBUSY)


def test_node_hostname_is_seen_by_its_processes(fabric: Fabric) -> None:
    vm = fabric.add_node(hostname="pool-a-3")
    assert vm.run(["hostname"]).stdout.strip() == "pool-a-3"
    assert vm.run([sys.executable, "-c", "import socket;print(socket.gethostname())"]
                  ).stdout.strip() == "pool-a-3"
    assert fabric.nodes[0].run(["hostname"]).stdout.strip() == socket.gethostname()


def test_set_address_moves_the_node(fabric: Fabric) -> None:
    a, b = fabric.nodes
    old = b.ip
    new = b.set_address()
    assert new != old and b.ip == new
    assert b.addresses() == [new]
    srv = listen(b)
    assert connects(a, new, srv.getsockname()[1])
    srv.close()
    b.add_address("fd00:5::2", 64)
    a.add_address("fd00:5::1", 64)
    srv6 = listen(b, "fd00:5::2")
    assert connects(a, "fd00:5::2", srv6.getsockname()[1])
    srv6.close()


def test_link_down_partitions_the_node(fabric: Fabric) -> None:
    a, b = fabric.nodes
    srv = listen(b)
    port = srv.getsockname()[1]
    b.set_link(False)
    assert not can_connect(a, b.ip, port, timeout=0.5)
    b.set_link(True)
    assert connects(a, b.ip, port)
    srv.close()


def test_gateway_connects_the_test_process(tmp_path: Path) -> None:
    with Fabric("stdn", nodes=1, gateway=True) as fab:
        assert fab.gateway_ip is not None
        srv = socket.socket()
        srv.bind((fab.gateway_ip, 0))
        srv.listen()
        assert connects(fab.nodes[0], fab.gateway_ip, srv.getsockname()[1])
        srv.close()
        link = fab.gateway_link
    assert link is not None
    assert subprocess.run(["ip", "link", "show", link], capture_output=True,
                          check=False).returncode != 0


def test_dns_standin_can_listen_inside_a_node(fabric: Fabric) -> None:
    a, b = fabric.nodes
    model = ClusterDnsModel()
    model.set_members("ns", "ens", {"imex-00000000-0": "10.3.0.1"})

    async def go() -> list[str]:
        async with DnsServer(model, host=a.ip, netns=a.name) as srv:
            code = ("import dns.resolver as r;x=r.Resolver(configure=False);"
                    f"x.nameservers=['{a.ip}'];x.port={srv.port};x.lifetime=3;"
                    "print(x.resolve('imex-00000000-0.ens.ns.svc.cluster.local','A')[0])")
            proc = await asyncio.create_subprocess_exec(
                *b.argv([sys.executable, "-c", code]), stdout=subprocess.PIPE, cwd=REPO)
            out, _ = await asyncio.wait_for(proc.communicate(), 20)
            return out.decode().split()

    assert asyncio.run(go()) == ["10.3.0.1"]


def test_teardown_kills_processes_and_removes_everything() -> None:
    fab = Fabric("stdn", nodes=2)
    names = [n.name for n in fab.nodes] + [fab.fabric_ns]
    proc = fab.nodes[0].popen(["sleep", "300"])
    fab.close()
    assert proc.wait(5) is not None
    assert not set(names) & set(list_netns())
    assert not any((netns_mod.NETNS_ETC_DIR / n).exists() for n in names)
    fab.close()  # idempotent


def test_cleanup_stale_removes_leftovers_of_a_killed_run() -> None:
    fab = Fabric("stdnz", nodes=1)
    # forget it, as a killed test run would
    with netns_mod._open_lock:
        netns_mod._open_fabrics.discard(fab)
    pid = fab.nodes[0].popen(["sleep", "300"]).pid
    removed = cleanup_stale("stdnz")
    assert set(removed) == {fab.nodes[0].name, fab.fabric_ns}
    assert not [n for n in list_netns() if n.startswith("stdnz-")]
    assert not os.path.exists(f"/proc/{pid}") or _is_zombie(pid)
    fab.nodes[0].procs[0].wait(5)


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"
    except OSError:
        return True


def test_prefix_is_validated() -> None:
    with pytest.raises(ValueError, match="prefix"):
        Fabric("has-dash")


def test_in_netns_names_a_missing_namespace() -> None:
    with pytest.raises(netns_mod.NetnsError, match="stdn-nope"), in_netns("stdn-nope"):
        pass


def test_cleanup_command_line() -> None:
    fab = Fabric("stdny", nodes=1)
    with netns_mod._open_lock:
        netns_mod._open_fabrics.discard(fab)
    out = subprocess.run([sys.executable, "-m", "tests.sandbox.netns", "cleanup", "stdny"],
                         capture_output=True, text=True, cwd=REPO, timeout=60, check=True)
    assert f"removed {fab.nodes[0].name}" in out.stdout
    assert not [n for n in list_netns() if n.startswith("stdny-")]
