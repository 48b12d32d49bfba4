"""The host side of the VM harness: what a cluster gives a guest, inside the namespace.

TEST HARNESS. A mixin of :class:`tests.vm.harness.VmHarness`, started in this order from the
thread that entered the harness namespace: the DNS stand-in on the bridge address (fed from
the API double's EndpointSlices: what KubeVirt's DHCP hands out as cluster DNS), the real
``imex-host-agent`` (its registry on port 8080, ready once ``/readyz`` says so), a
``http.server`` with directory listings serving the wheelhouse tree on port 8000, and
``dnsmasq`` as DHCP server only (fixed MAC -> IP entries, re-read on SIGHUP when a VM's
address changes). Each stops in :meth:`VmHarness.close`; none outlives the namespace.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import ipaddress
import logging
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tests.sandbox.dns_server import ClusterDnsModel, DnsServer, follow_kubernetes
from tests.sandbox.ensemble import LoopThread
from tests.vm.observe import wait_for

if TYPE_CHECKING:
    from tests.sandbox.ensemble import EnsembleSpec
    from tests.vm.observe import Guest

log = logging.getLogger("vm.harness")
BRIDGE = "vmtbr0"


class HarnessError(Exception):
    """The harness itself could not be set up (missing tool, image, namespace)."""


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("wheelhouse: " + format, *args)


def _pdeathsig_child() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


class HostSide:
    """DNS, host agent, wheelhouse server and DHCP; the harness owns the attributes."""

    host_ip: str
    net: ipaddress.IPv4Network | ipaddress.IPv6Network
    workdir: Path
    kubeconfig: Path
    spec: EnsembleSpec
    guests: dict[int, Guest]
    dns_model: ClusterDnsModel
    _ip_pool: list[str]
    _loop: LoopThread | None
    _dns: DnsServer | None
    _host_agent: subprocess.Popen[bytes] | None
    _dnsmasq: subprocess.Popen[bytes] | None
    _http: http.server.ThreadingHTTPServer | None
    _stack: ExitStack

    @property
    def registry_url(self) -> str:
        return f"http://{self.host_ip}:8080"

    def _start_dns(self) -> None:
        self._loop = LoopThread()
        self._dns = DnsServer(self.dns_model, self.host_ip, 53)
        self._loop.run(self._dns.start())
        synced = asyncio.Event()
        kubeconfig = self.kubeconfig
        model = self.dns_model

        async def feed() -> None:
            from lightkube import AsyncClient, KubeConfig

            client = AsyncClient(KubeConfig.from_file(kubeconfig), trust_env=False)
            try:
                await follow_kubernetes(model, client, backoff=lambda n: min(0.1 * 2**n, 1.0),
                                        synced=synced)
            finally:
                await client.close()

        self._loop.spawn(feed())

        async def wait_synced() -> None:
            await asyncio.wait_for(synced.wait(), 20)

        self._loop.run(wait_synced(), 25)

    def _stop_dns(self) -> None:
        if self._loop is None:
            return
        if self._dns is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self._dns.stop(), 10)
        self._loop.close()

    def _start_host_agent(self) -> None:
        exe = Path(sys.executable).with_name("imex-host-agent")
        argv = [str(exe) if exe.exists() else "imex-host-agent",
                "--kubeconfig", str(self.kubeconfig),
                "--listen", f"{self.host_ip}:8080", "--json", "--report-stale-after", "120"]
        logf = open(self.workdir / "host-agent.log", "ab")  # noqa: SIM115 (child owns it)
        self._stack.callback(logf.close)
        self._host_agent = subprocess.Popen(argv, stdout=logf, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL,
                                            preexec_fn=_pdeathsig_child)

        def ready() -> bool:
            if self._host_agent is not None and self._host_agent.poll() is not None:
                raise HarnessError(f"imex-host-agent exited ({self._host_agent.returncode}):"
                                   f"\n{self.host_agent_log()}")
            try:
                with urllib.request.urlopen(f"{self.registry_url}/readyz", timeout=2) as r:
                    return bool(r.status == 200)
            except OSError:
                return False

        wait_for("the registry's /readyz", ready, 60, 0.2, self.host_agent_log)

    def host_agent_log(self) -> str:
        try:
            return (self.workdir / "host-agent.log").read_text(errors="replace")[-3000:]
        except OSError:
            return ""

    def _start_http(self) -> None:
        handler = functools.partial(_QuietHandler, directory=str(self.workdir / "wheelhouse"))
        self._http = http.server.ThreadingHTTPServer((self.host_ip, 8000), handler)
        threading.Thread(target=self._http.serve_forever, name="vmt-wheelhouse",
                         daemon=True).start()

    def _stop_http(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()

    def _dhcp_hosts_file(self) -> Path:
        return self.workdir / "dhcp-hosts"

    def _write_dhcp_hosts(self) -> None:
        lines = [f"{g.machine.mac},{g.ip},{g.vmi}\n" for g in self.guests.values()]
        self._dhcp_hosts_file().write_text("".join(lines))
        if self._dnsmasq is not None and self._dnsmasq.poll() is None:
            self._dnsmasq.send_signal(signal.SIGHUP)  # re-reads --dhcp-hostsfile

    def _start_dnsmasq(self) -> None:
        self._dhcp_hosts_file().write_text("")
        first, last = self._ip_pool[0], self._ip_pool[-1]
        search = (f"{self.spec.namespace}.svc.cluster.local,svc.cluster.local,"
                  "cluster.local")
        argv = ["dnsmasq", "--keep-in-foreground", "--conf-file=/dev/null", "--port=0",
                f"--interface={BRIDGE}", "--bind-interfaces", "--user=root", "--group=root",
                f"--dhcp-range={first},{last},{self.net.netmask},1h",
                f"--dhcp-hostsfile={self._dhcp_hosts_file()}",
                f"--dhcp-leasefile={self.workdir / 'dhcp.leases'}", "--dhcp-authoritative",
                f"--dhcp-option=option:router,{self.host_ip}",
                f"--dhcp-option=option:dns-server,{self.host_ip}",
                f"--dhcp-option=option:domain-search,{search}",
                "--log-dhcp", f"--log-facility={self.workdir / 'dnsmasq.log'}",
                f"--pid-file={self.workdir / 'dnsmasq.pid'}"]
        self._dnsmasq = subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                         preexec_fn=_pdeathsig_child)
        time.sleep(0.3)
        if self._dnsmasq.poll() is not None:
            err = self._dnsmasq.stderr.read().decode() if self._dnsmasq.stderr else ""
            raise HarnessError(f"dnsmasq exited ({self._dnsmasq.returncode}): {err}")

    @staticmethod
    def _stop_proc(p: subprocess.Popen[bytes] | None) -> None:
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)

