"""Network-namespace "VMs" on a private bridge, for tests that need several guests.

Why: the guest agent and IMEX match nodes-file entries against *local* addresses and read
``/etc/hosts``; several guests on one machine therefore need separate network stacks and
separate hosts files. Linux network namespaces give both (FACTS.md, "This machine": root,
``ip netns``, veth pairs and bridges work; the ``dummy`` link type does not).

Layout: one "fabric" namespace holds a bridge ``br0``; every node is a namespace with a veth
``eth0`` plugged into that bridge and an address in the fabric's private subnet, loopback
up. Nothing touches the root namespace unless ``gateway=True``, which adds one veth from the
root namespace to the bridge with the subnet's ``.1`` address, so servers running in the test
process (DNS stand-in, registry) are reachable from the nodes; the subnet is then chosen so
it overlaps no root-namespace route.

Files: ``ip netns exec NAME`` bind-mounts every file in ``/etc/netns/NAME/`` over its
``/etc`` twin for the process it starts, so each node gets its own ``hosts`` and
``resolv.conf``. A bind mount pins the *inode*: a file replaced from outside (``os.replace``)
is not seen by processes already running in the namespace, and inside the namespace
``os.replace`` onto ``/etc/hosts`` fails with EBUSY. :meth:`Node.write_hosts` therefore
rewrites in place, as an admin's editor or cloud-init would.

Names: every namespace is ``<prefix>-<tag>-<suffix>`` where ``tag`` is random per fabric, so
parallel runs with one prefix never collide; the root-side gateway veth is
``<prefix[:6]><tag>g``.

Teardown is guaranteed three ways: the context manager (``with Fabric(...)``), an ``atexit``
hook for fabrics still open at interpreter exit, and :func:`cleanup_stale` for leftovers of
killed runs. Teardown kills every process still inside the namespaces (all of them were
started by the test), deletes the namespaces and ``/etc/netns/<name>``; failures are logged,
never raised, so one broken piece does not leak the rest.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import random
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger("sandbox.netns")

NETNS_RUN_DIR = Path("/var/run/netns")
NETNS_ETC_DIR = Path("/etc/netns")
CLONE_NEWNET = 0x40000000
DEFAULT_HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
# Nothing listens on a node's own loopback port 53, so names missing from the hosts file
# fail fast instead of leaking to the machine's resolver.
DEFAULT_RESOLV = "nameserver 127.0.0.1\noptions timeout:1 attempts:1\n"


class NetnsError(Exception):
    """An ``ip`` command failed while building or changing the fabric."""


def ip(*args: str, netns: str | None = None, check: bool = True) -> str:
    """Run ``ip [-n NETNS] ARGS...`` and return stdout; :class:`NetnsError` on failure."""
    argv = ["ip", *(("-n", netns) if netns else ()), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    if check and proc.returncode != 0:
        raise NetnsError(f"{' '.join(argv)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def list_netns() -> list[str]:
    out = ip("-j", "netns", "list", check=False)
    try:
        return [str(e["name"]) for e in json.loads(out or "[]")]
    except (ValueError, KeyError, TypeError):
        return [ln.split()[0] for ln in out.splitlines() if ln.strip()]


def netns_pids(name: str) -> list[int]:
    out = ip("netns", "pids", name, check=False)
    return [int(x) for x in out.split() if x.isdigit()]


_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise NetnsError(f"setns: {os.strerror(err)}")


@contextlib.contextmanager
def in_netns(name: str) -> Iterator[None]:
    """Move the *calling thread* into namespace ``name`` for the block.

    Sockets created inside the block stay in that namespace after it ends, so a server in
    the test process can listen inside a node (``DnsServer(..., netns=name)`` does this).
    Other threads are unaffected.
    """
    own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
    try:
        target = os.open(NETNS_RUN_DIR / name, os.O_RDONLY)
    except OSError as e:
        os.close(own)
        raise NetnsError(f"no network namespace {name!r}: {e}") from e
    try:
        _setns(target)
        try:
            yield
        finally:
            _setns(own)
    finally:
        os.close(target)
        os.close(own)


def _kill_all_in(name: str) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = netns_pids(name)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 2
        while netns_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)


def _delete_netns(name: str) -> None:
    try:
        _kill_all_in(name)
        ip("netns", "del", name, check=False)
    except Exception as e:  # teardown never raises
        log.warning("deleting netns %s: %s", name, e)
    shutil.rmtree(NETNS_ETC_DIR / name, ignore_errors=True)


def cleanup_stale(prefix: str) -> list[str]:
    """Delete every namespace ``<prefix>-*``, its /etc/netns dir and ``<prefix[:6]>*`` links.

    For leftovers of a killed run; returns the namespaces removed.
    """
    removed = []
    for name in list_netns():
        if name.startswith(prefix + "-"):
            _delete_netns(name)
            removed.append(name)
    if NETNS_ETC_DIR.is_dir():
        for d in NETNS_ETC_DIR.iterdir():
            if d.name.startswith(prefix + "-"):
                shutil.rmtree(d, ignore_errors=True)
    out = ip("-j", "link", "show", check=False)
    with contextlib.suppress(ValueError):
        for link in json.loads(out or "[]"):
            nm = str(link.get("ifname", ""))
            if nm.startswith(prefix[:6]) and nm.endswith("g") and link.get("link_type") == "ether":
                ip("link", "del", nm, check=False)
    return removed


_open_fabrics: set[Fabric] = set()
_open_lock = threading.Lock()


@atexit.register
def _close_leftovers() -> None:
    with _open_lock:
        fabrics = list(_open_fabrics)
    for f in fabrics:
        f.close()


@dataclass(eq=False)
class Node:
    """One namespace "VM": ``eth0`` on the fabric bridge, its own hosts and resolv.conf."""

    fabric: Fabric
    name: str
    ip: str
    prefixlen: int
    ifname: str = "eth0"
    hostname: str | None = None
    procs: list[subprocess.Popen[Any]] = field(default_factory=list)

    @property
    def etc_dir(self) -> Path:
        return NETNS_ETC_DIR / self.name

    @property
    def hosts_path(self) -> Path:
        """The file processes in this namespace see as ``/etc/hosts``."""
        return self.etc_dir / "hosts"

    @property
    def resolv_path(self) -> Path:
        return self.etc_dir / "resolv.conf"

    # ---- files
    def write_hosts(self, text: str) -> None:
        """Rewrite the hosts file in place (same inode, so running processes see it)."""
        _write_in_place(self.hosts_path, text)

    def read_hosts(self) -> str:
        return self.hosts_path.read_text()

    def write_resolv(self, text: str) -> None:
        _write_in_place(self.resolv_path, text)

    # ---- processes
    def argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` wrapped to run inside this namespace (with its /etc files).

        With a ``hostname`` the process also gets its own UTS namespace answering that name
        (``gethostname()``), as a VM named after its VMI would.
        """
        if self.hostname is None:
            return ["ip", "netns", "exec", self.name, *argv]
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "sh", "-c",
                'hostname "$0" && exec "$@"', self.hostname, *argv]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start ``argv`` inside the namespace; the process is killed at teardown."""
        p: subprocess.Popen[Any] = subprocess.Popen(self.argv(argv), **kwargs)
        self.procs.append(p)
        return p

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
            **kwargs: Any) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside the namespace to completion, capturing text output."""
        kwargs.setdefault("capture_output", True)
        return subprocess.run(self.argv(argv), check=check, timeout=timeout, text=True,
                              **kwargs)

    @contextlib.contextmanager
    def enter(self) -> Iterator[None]:
        """Run the block's socket calls in this namespace (calling thread only)."""
        with in_netns(self.name):
            yield

    # ---- addresses and link
    def addresses(self) -> list[str]:
        out = ip("-j", "addr", "show", "dev", self.ifname, netns=self.name)
        return [str(a["local"]) for link in json.loads(out or "[]")
                for a in link.get("addr_info", []) if a.get("scope") == "global"]

    def add_address(self, addr: str, prefixlen: int | None = None) -> None:
        ip("addr", "add", f"{addr}/{prefixlen or self.prefixlen}", "dev", self.ifname,
           netns=self.name)

    def del_address(self, addr: str, prefixlen: int | None = None) -> None:
        ip("addr", "del", f"{addr}/{prefixlen or self.prefixlen}", "dev", self.ifname,
           netns=self.name)

    def set_address(self, new_ip: str | None = None) -> str:
        """Give the node a new address (as after a live migration); returns it.

        The new address is added before the old one is removed, as DHCP renewal does.
        """
        new = new_ip or self.fabric.allocate()
        old = self.ip
        self.add_address(new)
        self.ip = new
        if old != new:
            with contextlib.suppress(NetnsError):
                self.del_address(old)
        return new

    def set_link(self, up: bool) -> None:
        """Take the node's ``eth0`` down or up (a partition, a paused VM)."""
        ip("link", "set", self.ifname, "up" if up else "down", netns=self.name)

    def kill_processes(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(3)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(3)


def _write_in_place(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "r+" if path.exists() else "w") as f:
        f.seek(0)
        f.write(text)
        f.truncate()
        f.flush()
        os.fsync(f.fileno())


def _root_networks() -> list[ipaddress.IPv4Network | ipaddress.IPv6Network]:
    nets: list[ipaddress.IPv4Network | ipaddress.IPv6Network] = []
    out = ip("-j", "-4", "addr", "show", check=False)
    with contextlib.suppress(ValueError):
        for link in json.loads(out or "[]"):
            for a in link.get("addr_info", []):
                nets.append(ipaddress.ip_network(f"{a['local']}/{a['prefixlen']}", strict=False))
    out = ip("-j", "-4", "route", "show", "table", "all", check=False)
    with contextlib.suppress(ValueError):
        for r in json.loads(out or "[]"):
            dst = r.get("dst", "")
            if dst and dst != "default":
                with contextlib.suppress(ValueError):
                    nets.append(ipaddress.ip_network(dst, strict=False))
    return nets


def _pick_subnet() -> str:
    used = _root_networks()
    rng = random.Random()
    for _ in range(200):
        cand = ipaddress.ip_network(f"10.{rng.randint(160, 250)}.{rng.randint(0, 255)}.0/24")
        if not any(cand.overlaps(n) for n in used if n.prefixlen > 0):
            return str(cand)
    raise NetnsError("no free private /24 for the fabric")


class Fabric:
    """A bridge in its own namespace plus node namespaces plugged into it.

    ``with Fabric("stdn", nodes=3) as fab: fab.nodes[0].popen([...])``
    """

    def __init__(
        self,
        prefix: str,
        nodes: int = 0,
        *,
        subnet: str | None = None,
        gateway: bool = False,
        hosts: str = DEFAULT_HOSTS,
        resolv: str = DEFAULT_RESOLV,
    ) -> None:
        if not prefix or "-" in prefix or len(prefix) > 10:
            raise ValueError(f"prefix {prefix!r}: 1-10 characters without '-'")
        self.prefix = prefix
        self.tag = f"{random.getrandbits(24):06x}"
        self.subnet = ipaddress.ip_network(subnet or (_pick_subnet() if gateway
                                                      else "10.213.0.0/24"))
        self.fabric_ns = f"{prefix}-{self.tag}-fab"
        self.gateway_ip: str | None = None
        self.gateway_link: str | None = None
        self.nodes: list[Node] = []
        self._default_hosts = hosts
        self._default_resolv = resolv
        self._hosts_iter = self.subnet.hosts()
        self._used: set[str] = set()
        self._closed = False
        self._counter = 0
        with _open_lock:
            _open_fabrics.add(self)
        try:
            ip("netns", "add", self.fabric_ns)
            ip("link", "set", "lo", "up", netns=self.fabric_ns)
            ip("link", "add", "br0", "type", "bridge", netns=self.fabric_ns)
            ip("link", "set", "br0", "up", netns=self.fabric_ns)
            first = self.allocate()  # .1 is the gateway's, used or not
            if gateway:
                self._add_gateway(first)
            for _ in range(nodes):
                self.add_node()
        except BaseException:
            self.close()
            raise

    def _add_gateway(self, addr: str) -> None:
        link = (self.prefix[:6] + self.tag)[:14] + "g"
        ip("link", "add", "name", link, "type", "veth", "peer", "name", "gw",
           "netns", self.fabric_ns)
        self.gateway_link = link
        ip("link", "set", "gw", "master", "br0", "up", netns=self.fabric_ns)
        ip("addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", link)
        ip("link", "set", link, "up")
        self.gateway_ip = addr

    def allocate(self) -> str:
        """A fresh address in the subnet (never handed out twice by this fabric)."""
        for h in self._hosts_iter:
            s = str(h)
            if s not in self._used:
                self._used.add(s)
                return s
        raise NetnsError(f"subnet {self.subnet} exhausted")

    def add_node(self, suffix: str | None = None, ip_addr: str | None = None, *,
                 hosts: str | None = None, resolv: str | None = None,
                 hostname: str | None = None) -> Node:
        """Create one node namespace; ``hosts``/``resolv`` seed its /etc files.

        ``hostname``: processes started through the node see it as their host name.
        """
        if self._closed:
            raise NetnsError("fabric is closed")
        idx = self._counter
        self._counter += 1
        name = f"{self.prefix}-{self.tag}-{suffix if suffix is not None else idx}"
        addr = ip_addr or self.allocate()
        self._used.add(addr)
        ip("netns", "add", name)
        node = Node(self, name, addr, self.subnet.prefixlen, hostname=hostname)
        self.nodes.append(node)
        node.etc_dir.mkdir(parents=True, exist_ok=True)
        node.write_hosts(self._default_hosts if hosts is None else hosts)
        node.write_resolv(self._default_resolv if resolv is None else resolv)
        ip("link", "set", "lo", "up", netns=name)
        # no duplicate address detection (a new IPv6 address is usable at once), and
        # removing the first IPv4 address must not take the newer ones with it
        subprocess.run(["ip", "netns", "exec", name, "sysctl", "-qw",
                        "net.ipv6.conf.all.accept_dad=0", "net.ipv6.conf.default.accept_dad=0",
                        "net.ipv4.conf.all.promote_secondaries=1",
                        "net.ipv4.conf.default.promote_secondaries=1"],
                       capture_output=True, check=False, timeout=30)
        port = f"p{idx}"
        ip("link", "add", "name", "eth0", "netns", name, "type", "veth",
           "peer", "name", port, "netns", self.fabric_ns)
        ip("link", "set", port, "master", "br0", "up", netns=self.fabric_ns)
        ip("addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", "eth0", netns=name)
        ip("link", "set", "eth0", "up", netns=name)
        if self.gateway_ip:
            ip("route", "add", "default", "via", self.gateway_ip, netns=name)
        return node

    def node(self, name_or_index: str | int) -> Node:
        if isinstance(name_or_index, int):
            return self.nodes[name_or_index]
        for n in self.nodes:
            if n.name == name_or_index or n.name.endswith(f"-{name_or_index}"):
                return n
        raise KeyError(name_or_index)

    def hosts_lines(self, names: Mapping[str, str]) -> str:
        """Convenience: default hosts text plus ``IP<TAB>name`` lines for ``names``."""
        return self._default_hosts + "".join(f"{v}\t{k}\n" for k, v in names.items())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for n in self.nodes:
            with contextlib.suppress(Exception):
                n.kill_processes()
        for n in self.nodes:
            _delete_netns(n.name)
        if self.gateway_link:
            ip("link", "del", self.gateway_link, check=False)
        _delete_netns(self.fabric_ns)
        with _open_lock:
            _open_fabrics.discard(self)

    def __enter__(self) -> Fabric:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m tests.sandbox.netns cleanup PREFIX...``: remove leftovers of killed runs."""
    import argparse

    p = argparse.ArgumentParser(prog="python -m tests.sandbox.netns")
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("cleanup", help="delete namespaces <prefix>-*, their /etc/netns, links")
    c.add_argument("prefixes", nargs="+")
    sub.add_parser("list", help="list network namespaces")
    args = p.parse_args(argv)
    if args.cmd == "list":
        print("\n".join(list_netns()))
        return 0
    for prefix in args.prefixes:
        if not prefix or "-" in prefix:
            p.error(f"prefix {prefix!r}: must be non-empty without '-'")
        for name in cleanup_stale(prefix):
            print(f"removed {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
