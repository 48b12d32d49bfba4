"""Real Debian guests under QEMU around the real host side, all inside one network namespace.

TEST HARNESS, never product code. :class:`VmHarness` builds, in this order:

1. the guest image (:mod:`tests.vm.image`, cached) and the wheelhouse
   (:mod:`tests.vm.wheelhouse`), before any namespace exists, so a build failure leaves
   nothing to clean up;
2. a network namespace ``vmt-<pid>`` with a bridge ``vmtbr0`` holding ``10.77.0.1/24``;
   the calling thread *enters* it (``setns``) for the harness's lifetime, so every socket,
   thread and child the harness creates from then on lives there and the root namespace
   sees none of it;
3. the Kubernetes API double (in process, on the namespace's loopback), the DNS stand-in on
   ``10.77.0.1:53`` fed from the double's EndpointSlices (what KubeVirt's DHCP hands out as
   cluster DNS), the real ``imex-host-agent`` (registry on ``10.77.0.1:8080``), a
   ``http.server`` serving the wheelhouse on ``10.77.0.1:8000``, and ``dnsmasq`` as the DHCP
   server on the bridge (fixed MAC -> IP entries, DNS off: KubeVirt's DHCP role);
4. per VM (:meth:`VmHarness.add_vm`): the VMI through the double (Pending, Scheduled), a tap
   on the bridge, the NoCloud seed from ``imex-guest-agent cloudinit`` (the project's
   generator, byte for byte), qemu. The scripted virt-controller role
   (``tests.sandbox.virt_controller``) sets the VMI Running with the guest's IP once
   qemu-ga reports that address on eth0, as KubeVirt's virt-handler does.

Waiting polls real things (serial log, qemu-ga, registry) with deadlines; a wait that fails
raises :class:`VmFailure` with the serial log's relevant lines and the guest's service logs
where qemu-ga answers. Failure rules while waiting for a boot: qemu exited, a kernel panic,
cloud-init's ``runcmd`` failing (``scripts-user``) or no progress by the deadline.

Teardown (:meth:`VmHarness.close`) always runs every step and logs instead of raising: VMs
(SIGKILL), dnsmasq, HTTP server, host agent, DNS loop, API double, then every process left
in the namespace, the namespace itself (its bridge and taps go with it). Namespaces of dead
runs (owner pid gone) are removed at the next start. With ``keep_artifacts`` the work
directory (serial logs, qemu argv, seeds, host-agent and dnsmasq logs, guest status files
collected on failure) is kept and its path printed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import ipaddress
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass, field
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar, cast

from guest_agent.hostsfile import read_block
from tests.sandbox.dns_server import ClusterDnsModel, DnsServer, follow_kubernetes
from tests.sandbox.ensemble import EnsembleSpec, LoopThread
from tests.sandbox.kube_api import ThreadedKubeApi
from tests.sandbox.netns import in_netns, ip, list_netns, netns_pids
from tests.sandbox.virt_controller import VMI, VirtController, running_status, vmi_manifest
from tests.vm.image import BOOKWORM_AMD64, GUESTS, REPO_ROOT, GuestOs, Image, ensure_image
from tests.vm.machine import Machine, make_seed, pick_accel, relevant_lines
from tests.vm.peer import Peer
from tests.vm.qga import QgaError
from tests.vm.wheelhouse import build_wheelhouse, target_for

if TYPE_CHECKING:
    from tests.sandbox.ensemble import Sandbox

log = logging.getLogger("vm.harness")
T = TypeVar("T")

PREFIX = "vmt"
BRIDGE = "vmtbr0"
STATUS_FILE = "/run/imex-guest-agent/status.json"
IMEX_STATE_FILE = "/run/nvidia-imex/state.json"
REQUIRED_TOOLS = {
    "qemu-img": "qemu-utils",
    "mmdebstrap": "mmdebstrap", "cloud-localds": "cloud-image-utils",
    "dnsmasq": "dnsmasq-base", "mkfs.ext4": "e2fsprogs", "ip": "iproute2",
}
QEMU_PACKAGES = {"qemu-system-x86_64": "qemu-system-x86", "qemu-system-aarch64": "qemu-system-arm"}
# serial-console markers of a failed first boot (cloud-init 22.4 and 25.1 word it the
# same: docs/facts.md), and the installer's and the bootcmd's one line
FATAL_MARKERS = ("Kernel panic", "Failed to run module scripts-user",
                 "Failed running /var/lib/cloud/instance/scripts/runcmd",
                 "imex-ensemble setup: error:")


class HarnessError(Exception):
    """The harness itself could not be set up (missing tool, image, namespace)."""


class VmFailure(AssertionError):
    """A guest did not do what the scenario needs; the message carries the evidence."""


@dataclass(frozen=True)
class HarnessSettings:
    vms: int = 3
    memory_mb: int = 640
    namespace: str = "vmtest"
    ensemble: str = "gb200"
    #: seconds for a first boot up to the guest agent running (TCG on 2 shared cores)
    boot_timeout: float = 900.0
    #: seconds for the ensemble to settle after a change (pins, CONNECTED, reports)
    converge_timeout: float = 300.0
    subnet: str = "10.77.0.0/24"
    #: override the generator's ``--install`` (bad-input tests); default the wheelhouse
    install: str | None = None
    workdir: Path | None = None
    keep_artifacts: bool = False
    #: the guest OS of each VM by index (``debian-12-arm64`` ...); empty: all bookworm amd64
    guests: tuple[str, ...] = ()
    #: lean members (tests/vm/peer.py) after the VMs' indexes
    peers: int = 0


@dataclass
class Guest:
    """One member: its VMI, its machine, its address plan."""

    index: int
    vmi: str
    machine: Machine
    ip: str
    node: str
    os: GuestOs = BOOKWORM_AMD64
    timings: dict[str, float] = field(default_factory=dict)
    #: what the guest says it runs (python, cloud-init, systemd), read through qemu-ga
    facts: dict[str, str] = field(default_factory=dict)


class _KubeconfigHolder:
    """What :class:`VirtController` needs of a sandbox: the kubeconfig path."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        log.debug("wheelhouse: " + format, *args)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def delete_netns(name: str) -> None:
    """Kill everything inside ``name``, then delete it (its bridge and taps go with it)."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        pids = netns_pids(name)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        deadline = time.monotonic() + 3
        while netns_pids(name) and time.monotonic() < deadline:
            time.sleep(0.05)
    ip("netns", "del", name, check=False)


def cleanup_dead_runs() -> list[str]:
    """Delete ``vmt-<pid>`` namespaces whose owner process is gone."""
    removed = []
    for name in list_netns():
        head, _, rest = name.partition("-")
        pid = rest.partition("-")[0]  # vmt-<pid> and its peers vmt-<pid>-p<i>
        if head == PREFIX and pid.isdigit() and not _pid_alive(int(pid)):
            delete_netns(name)
            removed.append(name)
    return removed


def wait_for(what: str, probe: Callable[[], T | None], timeout: float, interval: float = 1.0,
             evidence: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until it returns something truthy; :class:`VmFailure` at the deadline."""
    deadline = time.monotonic() + timeout
    while True:
        value = probe()
        if value:
            return value
        if time.monotonic() > deadline:
            extra = f"\n{evidence()}" if evidence is not None else ""
            raise VmFailure(f"timed out after {timeout:.0f}s waiting for {what}{extra}")
        time.sleep(interval)


def multipart_user_data(generated: str, extra_cloud_config: str) -> str:
    """Pure: the generator's user-data plus one harness part, as cloud-init multipart MIME.

    cloud-init merges cloud-config parts in order and a later part's scalar replaces an
    earlier one (checked with cloud-init 22.4's own handler), so the second part can force
    ``manage_etc_hosts: true`` while the generator's part stays untouched.
    """
    msg = MIMEMultipart()
    for i, text in enumerate((generated, extra_cloud_config)):
        part = MIMEText(text, "cloud-config")
        part.add_header("Content-Disposition", "attachment", filename=f"part-{i}.yaml")
        msg.attach(part)
    return msg.as_string()


class VmHarness:
    def __init__(self, settings: HarnessSettings | None = None) -> None:
        self.settings = s = settings or HarnessSettings()
        self.net = ipaddress.ip_network(s.subnet)
        hosts = list(self.net.hosts())
        self.host_ip = str(hosts[0])
        self._ip_pool = [str(h) for h in hosts[10:200]]
        self.netns = f"{PREFIX}-{os.getpid()}"
        self.workdir = Path("/nonexistent")
        self.image: Image | None = None
        self.images: dict[str, Image] = {}
        self.accels: dict[str, str] = {}
        self.accel = "tcg"
        self.guests: dict[int, Guest] = {}
        self.peers: dict[int, Peer] = {}
        self.timings: dict[str, float] = {}
        self.spec = EnsembleSpec(s.namespace, s.ensemble, max_members=s.vms + s.peers + 1)
        self._stack = ExitStack()
        self._api: ThreadedKubeApi | None = None
        self.kubeconfig = Path("/nonexistent")
        self._loop: LoopThread | None = None
        self._dns: DnsServer | None = None
        self.dns_model = ClusterDnsModel(ttl=5)
        self._host_agent: subprocess.Popen[bytes] | None = None
        self._dnsmasq: subprocess.Popen[bytes] | None = None
        self._http: http.server.ThreadingHTTPServer | None = None
        self.vc: VirtController | None = None
        self.user_data = ""
        self._failed = False
        self._closed = False
        self._netns_made = False
        #: qemu-ga sockets live here (short path; UNIX socket paths are < 108 bytes)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="vmt-"))

    # ------------------------------------------------------------------ addresses
    @property
    def registry_url(self) -> str:
        return f"http://{self.host_ip}:8080"

    @property
    def wheelhouse_url(self) -> str:
        return f"http://{self.host_ip}:8000/"

    def next_ip(self) -> str:
        return self._ip_pool.pop(0)

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> VmHarness:
        try:
            self.start()
        except BaseException:
            self._failed = True
            self.close()
            raise
        return self

    def __exit__(self, et: type[BaseException] | None, *_: object) -> None:
        if et is not None:
            self._failed = True
        self.close()

    def start(self) -> VmHarness:
        s = self.settings
        if os.geteuid() != 0:
            raise HarnessError("the VM harness needs root (netns, taps, dnsmasq)")
        missing = [f"{tool} (apt package {pkg})" for tool, pkg in REQUIRED_TOOLS.items()
                   if shutil.which(tool) is None]
        if missing:
            raise HarnessError("missing tools: " + ", ".join(missing))
        if s.workdir is not None:
            self.workdir = s.workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix="imex-vmtest-"))
        log.info("work dir %s", self.workdir)
        for gid in set(self.guest_ids()):
            if gid not in GUESTS:
                raise HarnessError(f"unknown guest {gid!r}; known: {', '.join(GUESTS)}")
            qemu = "qemu-system-aarch64" if GUESTS[gid].arch == "arm64" else "qemu-system-x86_64"
            if shutil.which(qemu) is None:
                raise HarnessError(f"missing tools: {qemu} (apt package {QEMU_PACKAGES[qemu]})")
        # 1. images and wheelhouse (nothing to clean up if these fail)
        for gid in dict.fromkeys(self.guest_ids()):
            t = time.monotonic()
            self.images[gid] = ensure_image(guest=GUESTS[gid])
            self.timings[f"image {gid}"] = time.monotonic() - t
        self.image = self.images[self.guest_ids()[0]]
        self.timings["image"] = sum(v for k, v in self.timings.items() if k.startswith("image "))
        t = time.monotonic()
        build_wheelhouse(self.workdir / "wheelhouse",
                         [target_for(GUESTS[g].arch, GUESTS[g].python) for g in self.images])
        self.timings["wheelhouse"] = time.monotonic() - t
        for gid, img in self.images.items():
            self.accels[gid] = pick_accel(img, self.workdir)
        self.accel = self.accels[self.guest_ids()[0]]
        # 2. the namespace, entered by this thread
        stale = cleanup_dead_runs()
        if stale:
            log.info("removed namespaces of dead runs: %s", " ".join(stale))
        if self.netns in list_netns():
            delete_netns(self.netns)
        ip("netns", "add", self.netns)
        self._netns_made = True
        ip("link", "set", "lo", "up", netns=self.netns)
        ip("link", "add", BRIDGE, "type", "bridge", netns=self.netns)
        ip("addr", "add", f"{self.host_ip}/{self.net.prefixlen}", "dev", BRIDGE,
           netns=self.netns)
        ip("link", "set", BRIDGE, "up", netns=self.netns)
        self._stack.enter_context(in_netns(self.netns))
        # 3. host side
        self._api = ThreadedKubeApi(bookmark_interval=1.0).start()
        self.kubeconfig = self._api.write_kubeconfig(self.workdir / "kubeconfig")
        self._start_dns()
        self._start_host_agent()
        self._start_http()
        self._start_dnsmasq()
        self.vc = VirtController(cast("Sandbox", _KubeconfigHolder(self.kubeconfig)))
        self.vc.create_ensemble(self.spec.namespace, self.spec.name,
                                max_members=self.spec.max_members, token=self.spec.token)
        self.user_data = self.generate_user_data()
        (self.workdir / "user-data").write_text(self.user_data)
        for k in range(s.peers):
            self.add_peer(s.vms + k)
        return self

    def guest_ids(self) -> list[str]:
        """The guest OS of every VM, by index."""
        s = self.settings
        if s.guests and len(s.guests) != s.vms:
            raise HarnessError(f"{len(s.guests)} guest OS names for {s.vms} VMs")
        return list(s.guests) or [BOOKWORM_AMD64.id] * s.vms

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        steps: list[tuple[str, Callable[[], None]]] = [
            ("artifacts", self._collect_artifacts),
            ("vms", self._kill_vms),
            ("peers", self._close_peers),
            ("dnsmasq", lambda: self._stop_proc(self._dnsmasq)),
            ("http", self._stop_http),
            ("host agent", lambda: self._stop_proc(self._host_agent)),
            ("virt-controller", lambda: self.vc.close() if self.vc else None),
            ("dns", self._stop_dns),
            ("api double", lambda: self._api.stop() if self._api else None),
            ("leave namespace", self._stack.close),
            ("namespace", lambda: delete_netns(self.netns) if self._netns_made else None),
            ("workdir", self._drop_workdir),
            ("sockets", lambda: shutil.rmtree(self.sock_dir, ignore_errors=True)),
        ]
        for what, step in steps:
            try:
                step()
            except Exception as e:  # teardown never raises
                log.warning("teardown %s: %s", what, e)

    def mark_failed(self) -> None:
        self._failed = True

    def _drop_workdir(self) -> None:
        if self.settings.keep_artifacts or self._failed:
            # logs stay; disks and wheels are large and rebuilt from the cache anyway
            for disk in self.workdir.glob("*/disk.qcow2"):
                disk.unlink(missing_ok=True)
            shutil.rmtree(self.workdir / "wheelhouse", ignore_errors=True)
            print(f"\nvmtest artifacts kept in {self.workdir}", file=sys.stderr)
            return
        shutil.rmtree(self.workdir, ignore_errors=True)

    # ------------------------------------------------------------------ host side
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

    # ------------------------------------------------------------------ cloud-init
    def generate_user_data(self) -> str:
        """``imex-guest-agent cloudinit`` output for this ensemble (the project's generator)."""
        install = self.settings.install or f"find-links:{self.wheelhouse_url}"
        argv = [sys.executable, "-m", "guest_agent.cli", "cloudinit",
                "--ensemble", self.spec.name, "--namespace", self.spec.namespace,
                "--max-members", str(self.spec.max_members),
                "--registry-url", self.registry_url, "--token", self.spec.token,
                "--install", install, "--raw"]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60,
                              cwd=REPO_ROOT)
        if proc.returncode != 0:
            raise HarnessError(f"imex-guest-agent cloudinit failed: {proc.stderr.strip()}")
        return proc.stdout

    @staticmethod
    def meta_data(vmi: str) -> str:
        # the VMI name as host name, as KubeVirt sets it; one instance per disk
        return f"instance-id: {vmi}-disk1\nlocal-hostname: {vmi}\n"

    # ------------------------------------------------------------------ VMs
    def _vmi_name(self, index: int) -> str:
        return f"{self.spec.name}-{index}"

    def add_vm(self, index: int) -> Guest:
        """Create the VMI (Pending, Scheduled), its tap, seed and disk, and start qemu."""
        assert self.vc is not None
        gos = GUESTS[self.guest_ids()[index]]
        vmi = self._vmi_name(index)
        tap = f"vmtt{index}"
        mac = f"52:54:00:77:00:{index + 10:02x}"
        ip("tuntap", "add", "dev", tap, "mode", "tap")
        ip("link", "set", tap, "master", BRIDGE, "up")
        machine = Machine(vmi, self.workdir / vmi, self.images[gos.id], tap, mac,
                          self.settings.memory_mb, self.sock_dir)
        make_seed(machine.seed, self.user_data, self.meta_data(vmi))
        guest = Guest(index, vmi, machine, self.next_ip(), self.vc.pick_node(), gos)
        self.guests[index] = guest
        self._create_vmi(guest)
        self._write_dhcp_hosts()
        machine.start(self.accels[gos.id])
        return guest

    def add_peer(self, index: int) -> Peer:
        """A lean member (tests/vm/peer.py) at the next address, its VMI Running."""
        assert self.vc is not None
        vmi = self._vmi_name(index)
        search = f"{self.spec.namespace}.svc.cluster.local svc.cluster.local cluster.local"
        peer = Peer(index=index, vmi=vmi, addr=self.next_ip(), prefixlen=self.net.prefixlen,
                    netns=f"{self.netns}-p{index}", veth=f"vmtp{index}", bridge=BRIDGE,
                    spec=self.spec, workdir=self.workdir / vmi,
                    registry_url=self.registry_url, dns=self.host_ip, search=search)
        self.peers[index] = peer
        node = self.vc.pick_node()
        self.vc.client.create(VMI.from_dict(vmi_manifest(self.spec, vmi, self.spec.name)))
        self.vc.set_status(self.spec, vmi, running_status(peer.ip, node, peer.mac))
        peer.start()
        return peer

    def _close_peers(self) -> None:
        for p in self.peers.values():
            try:
                p.close()
            except Exception as e:  # teardown never raises
                log.warning("teardown peer %s: %s", p.vmi, e)

    def _create_vmi(self, g: Guest) -> None:
        assert self.vc is not None
        self.vc.client.create(VMI.from_dict(vmi_manifest(self.spec, g.vmi, self.spec.name)))
        self.vc.set_status(self.spec, g.vmi, {"phase": "Pending"})
        self.vc.set_status(self.spec, g.vmi, {"phase": "Scheduled", "nodeName": g.node})

    def guest_ip(self, g: Guest) -> str | None:
        """eth0's IPv4 address as qemu-ga reports it (what virt-handler reads), or None."""
        try:
            ifaces = g.machine.qga.call("guest-network-get-interfaces", timeout=5)
        except (QgaError, ValueError):
            return None
        for iface in ifaces or []:
            if iface.get("name") != "eth0":
                continue
            for a in iface.get("ip-addresses", []):
                if a.get("ip-address-type") == "ipv4":
                    return str(a["ip-address"])
        return None

    def check_boot(self, g: Guest) -> None:
        """Raise :class:`VmFailure` when this boot has visibly failed (see module doc)."""
        m = g.machine
        if not m.running():
            raise VmFailure(f"{g.vmi}: qemu exited ({m.proc.returncode if m.proc else '?'})"
                            f"\n{m.qemu_log()}\n{self.serial_evidence(g)}")
        text = m.serial_text()
        for marker in FATAL_MARKERS:
            if marker in text:
                raise VmFailure(f"{g.vmi}: {marker!r} on the serial console"
                                f"\n{self.serial_evidence(g)}")

    def serial_evidence(self, g: Guest) -> str:
        lines = relevant_lines(g.machine.serial_text())
        tail = [ln for ln in g.machine.serial_text().splitlines()[-10:] if ln.strip()]
        return (f"---- {g.vmi} serial ({g.machine.serial}), relevant lines:\n"
                + "\n".join(lines) + "\n---- last lines:\n" + "\n".join(tail))

    def wait_running(self, g: Guest, timeout: float | None = None) -> None:
        """Wait for eth0's address via qemu-ga, then set the VMI Running with it."""
        assert self.vc is not None
        timeout = timeout or self.settings.boot_timeout

        def probe() -> str | None:
            self.check_boot(g)
            return self.guest_ip(g)

        got = wait_for(f"{g.vmi}: qemu-ga reporting an address on eth0", probe, timeout, 2.0,
                       lambda: self.serial_evidence(g))
        g.timings["address"] = time.monotonic() - g.machine.boot_started
        if got != g.ip:
            raise VmFailure(f"{g.vmi}: eth0 has {got}, DHCP plan says {g.ip}"
                            f"\n{self._dnsmasq_tail()}")
        self.vc.set_status(self.spec, g.vmi, running_status(g.ip, g.node, g.machine.mac))
        log.info("%s: eth0 %s after %.0fs; VMI Running", g.vmi, g.ip, g.timings["address"])

    def wait_agent(self, g: Guest, timeout: float | None = None) -> None:
        """Wait until the guest agent and nvidia-imex are active in the guest."""
        timeout = timeout or self.settings.boot_timeout

        def probe() -> bool:
            self.check_boot(g)
            try:
                r = g.machine.qga.exec(["/bin/systemctl", "is-active",
                                        "imex-guest-agent.service", "nvidia-imex.service"],
                                       timeout=20)
            except QgaError:
                return False
            return r.out.split() == ["active", "active"]

        wait_for(f"{g.vmi}: imex-guest-agent and nvidia-imex active", probe, timeout, 3.0,
                 lambda: self.guest_evidence(g))
        g.timings["agent"] = time.monotonic() - g.machine.boot_started
        log.info("%s: imex-guest-agent and nvidia-imex active %.0fs after qemu started",
                 g.vmi, g.timings["agent"])

    def boot(self, indexes: list[int]) -> None:
        """Start VMs for ``indexes`` and wait for each to run our agent (boots overlap)."""
        for i in indexes:
            self.add_vm(i)
        for i in indexes:
            self.wait_running(self.guests[i])
        for i in indexes:
            self.wait_agent(self.guests[i])
            self.read_facts(self.guests[i])

    def read_facts(self, g: Guest) -> dict[str, str]:
        """The guest's python (the agent's venv), ``cloud-init --version``, systemd major."""
        probes = {
            "python": [f"{ci_venv()}/bin/python", "-c",
                       "import sys; print('%d.%d' % sys.version_info[:2])"],
            "cloud-init": ["/usr/bin/cloud-init", "--version"],
            "systemd": ["/bin/systemctl", "--version"],
        }
        for key, argv in probes.items():
            with contextlib.suppress(QgaError):
                r = g.machine.qga.exec(argv, timeout=300)  # slow under TCG
                words = (r.out + r.err).split()
                if key == "python" and words:
                    g.facts[key] = words[0]
                elif key == "cloud-init" and len(words) >= 2:
                    g.facts[key] = words[1]  # "/usr/bin/cloud-init 25.1.4"
                elif key == "systemd" and len(words) >= 2:
                    g.facts[key] = words[1]  # "systemd 257 (257.9-1~deb13u1)"
        return g.facts

    def kill(self, index: int) -> None:
        """The VM dies (qemu SIGKILL); the VMI turns Failed, as virt-handler reports it."""
        assert self.vc is not None
        g = self.guests[index]
        g.machine.kill()
        self.vc.set_status(self.spec, g.vmi, {
            "phase": "Failed", "reason": "Crashed", "interfaces": [],
            "conditions": [{"type": "Ready", "status": "False", "lastProbeTime": None,
                            "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ",
                                                                time.gmtime()),
                            "reason": "GuestCrashed"}]})

    def restart_with_new_address(self, index: int) -> str:
        """The VMI is replaced (deleted, created again) and the VM boots from its own disk
        with a new DHCP address; returns the new IP."""
        assert self.vc is not None
        g = self.guests[index]
        self.vc.client.delete(VMI, g.vmi, namespace=self.spec.namespace)
        g.ip = self.next_ip()
        g.node = self.vc.pick_node(avoid=g.node)
        self._create_vmi(g)
        self._write_dhcp_hosts()
        g.machine.start(self.accels[g.os.id])
        return g.ip

    def reboot_with_seed(self, index: int, user_data: str, timeout: float = 900) -> None:
        """Power the guest off cleanly, give it a new seed (same instance), boot it again."""
        g = self.guests[index]
        # qemu-ga may drop the connection while the guest shuts down
        with contextlib.suppress(QgaError):
            g.machine.qga.call("guest-shutdown", {"mode": "powerdown"}, timeout=10)
        if not g.machine.wait_exit(timeout):
            raise VmFailure(f"{g.vmi}: still running {timeout:.0f}s after powerdown"
                            f"\n{self.serial_evidence(g)}")
        make_seed(g.machine.seed, user_data, self.meta_data(g.vmi))
        g.machine.start(self.accels[g.os.id])

    def _kill_vms(self) -> None:
        for g in self.guests.values():
            with contextlib.suppress(Exception):
                g.machine.kill()

    # ------------------------------------------------------------------ observation
    def guest_json(self, g: Guest, path: str) -> dict[str, Any] | None:
        try:
            doc = json.loads(g.machine.qga.read_file(path))
        except (QgaError, ValueError):
            return None
        return doc if isinstance(doc, dict) else None

    def hosts(self, g: Guest) -> str | None:
        try:
            return g.machine.qga.read_file("/etc/hosts").decode()
        except QgaError:
            return None

    def pins(self, g: Guest) -> dict[int, str] | None:
        text = self.hosts(g)
        return None if text is None else read_block(text.encode(), self.spec.id)

    def imex_domain(self, g: Guest) -> dict[str, Any] | None:
        try:
            r = g.machine.qga.exec(["/usr/bin/nvidia-imex-ctl", "-N", "-j"], timeout=20)
        except QgaError:
            return None
        if r.exitcode != 0:
            return None
        try:
            doc = json.loads(r.out)
        except ValueError:
            return None
        return doc if isinstance(doc, dict) else None

    def imex_main_pid(self, g: Guest) -> int | None:
        try:
            r = g.machine.qga.exec(["/bin/systemctl", "show", "-p", "MainPID", "--value",
                                    "nvidia-imex.service"], timeout=20)
        except QgaError:
            return None
        return int(r.out.strip()) if r.out.strip().isdigit() else None

    def registry(self) -> dict[str, Any]:
        url = f"{self.registry_url}/v1/ensembles/{self.spec.key}"
        try:
            with urllib.request.urlopen(url, timeout=5) as r:
                doc = json.loads(r.read())
        except (OSError, ValueError, urllib.error.URLError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def member_ip(self, i: int) -> str:
        return self.guests[i].ip if i in self.guests else self.peers[i].ip

    def expected_pins(self, live: list[int]) -> dict[int, str]:
        """Every slot: the member's IP when live, else 127.0.0.2."""
        return {i: (self.member_ip(i) if i in live else "127.0.0.2")
                for i in range(self.spec.max_members)}

    def connected_peers(self, g: Guest) -> set[str] | None:
        """Hosts this guest's IMEX reports CONNECTED (None when it cannot be asked)."""
        return connected_hosts(self.imex_domain(g))

    def converged(self, live: list[int]) -> list[str]:
        """What is still missing for ``live`` members to be settled (empty when settled)."""
        want = self.expected_pins(live)
        slot = self.spec.id.slot
        missing: list[str] = []
        reg = self.registry()
        reg_members = {m["index"]: m for m in reg.get("members", [])}
        for i in live:
            name = self._vmi_name(i)
            pins = self.pins(self.guests[i]) if i in self.guests else self.peers[i].pins()
            if pins != want:
                missing.append(f"{name}: pins {pins} != {want}")
                continue
            peers = (self.connected_peers(self.guests[i]) if i in self.guests
                     else connected_hosts(self.peers[i].domain()))
            want_peers = {slot(j) for j in live if j != i}
            if peers is None or not want_peers <= peers:
                missing.append(f"{name}: IMEX CONNECTED to {sorted(peers or [])}, "
                               f"want {sorted(want_peers)}")
                continue
            guest = (reg_members.get(i) or {}).get("guest") or {}
            if guest.get("imex_state") != "READY" or reg_members[i].get("ip") != self.member_ip(i):
                missing.append(f"{name}: registry member {reg_members.get(i)}")
        for i, m in reg_members.items():
            if i not in live:
                missing.append(f"registry still publishes slot {i}: {m.get('ip')}")
        return missing

    def wait_converged(self, live: list[int], timeout: float | None = None) -> float:
        t = time.monotonic()
        last: list[str] = []

        def probe() -> bool:
            nonlocal last
            for i in live:
                if i in self.guests:
                    self.check_boot(self.guests[i])
                elif not self.peers[i].running():
                    raise VmFailure(f"peer {self.peers[i].vmi}: agent exited\n"
                                    f"{self.peers[i].log_tail()}")
            last = self.converged(live)
            return not last

        wait_for(f"members {live} to converge", probe,
                 timeout or self.settings.converge_timeout, 3.0,
                 lambda: "still missing:\n  " + "\n  ".join(last) + self._peer_logs())
        took = time.monotonic() - t
        for i in live:
            if i in self.guests:
                g = self.guests[i]
                g.timings["converged"] = time.monotonic() - g.machine.boot_started
        log.info("members %s converged in %.0fs", live, took)
        return took

    # ------------------------------------------------------------------ evidence
    def guest_evidence(self, g: Guest) -> str:
        parts = [self.serial_evidence(g)]
        if g.machine.running():
            try:
                r = g.machine.qga.sh(
                    "journalctl -b --no-pager -u imex-guest-agent -u nvidia-imex "
                    "-u cloud-final | tail -n 40; tail -n 20 /var/log/cloud-init-output.log",
                    timeout=30)
                parts.append(f"---- {g.vmi} journal (qemu-ga):\n{r.out}{r.err}")
            except QgaError as e:
                parts.append(f"---- {g.vmi}: qemu-ga not answering ({e})")
        return "\n".join(parts)

    def _peer_logs(self) -> str:
        return "".join(f"\n---- peer {p.vmi} agent log:\n{p.log_tail(1500)}"
                       for p in self.peers.values())

    def _dnsmasq_tail(self) -> str:
        try:
            return (self.workdir / "dnsmasq.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def _collect_artifacts(self) -> None:
        """On failure: each guest's status files, journal and hosts next to its serial log."""
        if not self._failed:
            return
        for g in self.guests.values():
            if not g.machine.running():
                continue
            for name, path in (("status.json", STATUS_FILE),
                               ("imex-state.json", IMEX_STATE_FILE), ("hosts", "/etc/hosts"),
                               ("cloud-init-output.log", "/var/log/cloud-init-output.log")):
                with contextlib.suppress(QgaError, OSError):
                    (g.machine.dir / name).write_bytes(g.machine.qga.read_file(path))
            with contextlib.suppress(QgaError, OSError):
                r = g.machine.qga.sh("journalctl -b --no-pager | tail -n 400", timeout=60)
                (g.machine.dir / "journal.txt").write_text(r.out)
        reg = self.registry()
        if reg:
            (self.workdir / "registry.json").write_text(json.dumps(reg, indent=2))


def connected_hosts(dom: dict[str, Any] | None) -> set[str] | None:
    """Pure: the hosts an ``nvidia-imex-ctl -N -j`` document shows CONNECTED."""
    if dom is None:
        return None
    out: set[str] = set()
    for node in dom.get("nodes", {}).values():
        for conn in node.get("connections", {}).values():
            if conn.get("status") == "CONNECTED":
                out.add(str(conn.get("host")))
    return out


def ci_venv() -> str:
    from guest_agent.cloudinit import VENV

    return VENV


def _pdeathsig_child() -> None:
    import ctypes

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)


@contextlib.contextmanager
def harness(settings: HarnessSettings) -> Iterator[VmHarness]:
    h = VmHarness(settings)
    with h:
        yield h
