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

Guests may differ: ``HarnessSettings.guests`` names each VM's OS (``debian-12-arm64`` boots
under ``qemu-system-aarch64``), each gets its own cached image and the wheelhouse serves every
platform and Python among them; ``peers`` adds lean members (tests/vm/peer.py). The host side
lives in :mod:`tests.vm.hostside`, every read of the members' state in :mod:`tests.vm.observe`.

Teardown (:meth:`VmHarness.close`) always runs every step and logs instead of raising: VMs
(SIGKILL), dnsmasq, HTTP server, host agent, DNS loop, API double, then every process left
in the namespace, the namespace itself (its bridge and taps go with it). Namespaces of dead
runs (owner pid gone) are removed at the next start. With ``keep_artifacts`` the work
directory (serial logs, qemu argv, seeds, host-agent and dnsmasq logs, guest status files
collected on failure) is kept and its path printed.
"""

from __future__ import annotations

import contextlib
import http.server
import ipaddress
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from email.mime.multipart import MIMEMultipart
from email.mime.text import MIMEText
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar, cast

from tests.sandbox.dns_server import ClusterDnsModel, DnsServer
from tests.sandbox.ensemble import AGENT_NAMESPACE, EnsembleSpec, LoopThread
from tests.sandbox.kube_api import ThreadedKubeApi
from tests.sandbox.netns import in_netns, ip, list_netns, netns_pids
from tests.sandbox.virt_controller import VMI, VirtController, running_status, vmi_manifest
from tests.vm.hostside import BRIDGE, HarnessError, HostSide
from tests.vm.image import BOOKWORM_AMD64, GUESTS, REPO_ROOT, Image, ensure_image
from tests.vm.machine import Machine, make_seed, pick_accel, relevant_lines
from tests.vm.observe import (
    STATUS_FILE,
    Guest,
    Observation,
    VmFailure,
    connected_nodes,
    wait_for,
)
from tests.vm.peer import Peer
from tests.vm.qga import QgaError
from tests.vm.wheelhouse import build_wheelhouse, target_for

if TYPE_CHECKING:
    from tests.sandbox.ensemble import Sandbox

log = logging.getLogger("vm.harness")
T = TypeVar("T")

PREFIX = "vmt"
__all__ = ["STATUS_FILE", "Guest", "HarnessError", "HarnessSettings", "VmFailure", "VmHarness",
           "connected_nodes", "harness", "multipart_user_data", "wait_for"]
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


class _KubeconfigHolder:
    """What :class:`VirtController` needs of a sandbox: the kubeconfig path."""

    def __init__(self, kubeconfig: Path) -> None:
        self.kubeconfig = kubeconfig




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


class VmHarness(HostSide, Observation):
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
        # the host agent stores guest reports as ConfigMaps in its own namespace; without
        # it the agent is not ready (the manifests create it on a real cluster)
        self._api.put({"apiVersion": "v1", "kind": "Namespace",
                       "metadata": {"name": AGENT_NAMESPACE}})
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

    # ------------------------------------------------------------------ cloud-init
    def generate_user_data(self) -> str:
        """``imex-guest-agent cloudinit`` output for this ensemble (the project's generator)."""
        install = self.settings.install or f"find-links:{self.wheelhouse_url}"
        argv = [sys.executable, "-m", "guest_agent.cli", "cloudinit",
                "--ensemble", self.spec.name, "--namespace", self.spec.namespace,
                "--max-members", str(self.spec.max_members),
                "--expected-members", str(self.settings.vms),
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

def ci_venv() -> str:
    from guest_agent.installer.setup_script import VENV

    return VENV




@contextlib.contextmanager
def harness(settings: HarnessSettings) -> Iterator[VmHarness]:
    h = VmHarness(settings)
    with h:
        yield h
