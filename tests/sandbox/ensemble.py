"""A whole ensemble on one machine: API double, DNS, host agent, registry and namespace VMs.

TEST STAND-IN, never product code. :class:`Sandbox` wires the stand-ins and both real
agents together as close to a rack as this machine allows:

* the Kubernetes API double (:mod:`tests.sandbox.kube_api`) on loopback, on its own thread;
* the DNS stand-in (:mod:`tests.sandbox.dns_server`, TTL 5) fed live from the double's
  EndpointSlices and Services, as CoreDNS's kubernetes plugin is, on a background event
  loop in this process;
* the host agent as a real process (``tests.sandbox.host_agent_proc``: the real CLI, with
  test-sized backoff), serving its registry;
* "VMs": network namespaces on a bridge (:mod:`tests.sandbox.netns`) in a private /24,
  each with its own ``/etc/hosts`` and host name (the VMI's name), running the real guest
  agent (``imex_control = "process"``) whose child is the IMEX stand-in.

Addresses: the host side of the bridge (a veth in the root namespace) holds three
addresses of the subnet: the gateway, the DNS stand-in's and the registry's. Separate
addresses let a test take the registry or DNS away from the guests alone (a ``prohibit``
route inside every VM) while the host agent keeps publishing.

Teardown (:meth:`Sandbox.close`, also from ``with``) always runs every step, logging
failures instead of raising: guest agents (SIGTERM, then everything left in each namespace
is killed), namespaces and bridge, host agent, DNS, API double, temp dir. SIGTERM is turned
into ``KeyboardInterrupt`` while a sandbox is open in the main thread, so ``kill`` tears down
like Ctrl-C; every child gets ``PR_SET_PDEATHSIG`` so even ``kill -9`` of this process
leaves no agent running; namespaces of a run whose owner died are removed by the next run
with the same prefix (the owner's pid is kept in ``/run/imex-sandbox``).

Concurrency: the public methods are synchronous and meant for one thread (a test or the
demo). The DNS server and its feeder live on a private event loop thread; the API double
on its own; everything else is a child process. Waiting is polling of real files and
endpoints with deadlines: the agents are other processes, there is no event to await.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Coroutine, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import Any, TypeVar

from imex_shared.hostsfile import read_block
from imex_shared.model import EnsembleId
from tests.sandbox.ctl_build import standin_ctl, standin_daemon
from tests.sandbox.dns_server import ClusterDnsModel, DnsServer, follow_kubernetes
from tests.sandbox.imex_standin import precompile, write_standin_files
from tests.sandbox.kube_api import ThreadedKubeApi
from tests.sandbox.netns import Fabric, Node, cleanup_stale, ip, list_netns, netns_pids
from tests.sandbox.releases import Release

log = logging.getLogger("sandbox.ensemble")

REPO_ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
STANDIN_IMEX = str(REPO_ROOT / "tests" / "sandbox" / "bin" / "nvidia-imex")
STANDIN_CTL = str(REPO_ROOT / "tests" / "sandbox" / "bin" / "nvidia-imex-ctl")
STANDIN_SMI = str(REPO_ROOT / "tests" / "sandbox" / "bin" / "nvidia-smi")
#: the rack every sandbox VM's GPUs are in unless a test moves it (``Sandbox.fabrics``)
RACK_CLUSTER_UUID = "5e1f0c2a-7b3d-4c8e-9a61-2d4f8b0e3c17"
PID_DIR = Path("/run/imex-sandbox")
#: how long a guest's clean stop may take: the process-mode child's grace, the agent's 2 s
GUEST_STOP_WAIT = 10.0 + 2.0 + 3.0
#: the host agent's own namespace (its CA Secrets live there)
AGENT_NAMESPACE = "imex-system"
PR_SET_PDEATHSIG = 1

T = TypeVar("T")


class SandboxError(Exception):
    """The sandbox could not be built or a component did not come up."""


class NotConverged(SandboxError):
    """A wait ran past its deadline; the message says what was still missing."""


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True)
class SandboxSettings:
    """Knobs of one sandbox; the defaults are sized for 2 shared cores and quick tests."""

    #: namespaces are ``<prefix>-<tag>-*``; 1-6 characters
    prefix: str = "sbx"
    poll_interval: float = 1.0
    signal_interval: float = 5.0
    dns_timeout: float = 0.5
    longpoll_timeout: float = 10.0
    #: IMEX restart when not READY this long. Generous: the ctl stand-in is a Python
    #: process, so on an overloaded machine ``nvidia-imex-ctl -q`` can miss its 5 s
    #: deadline again and again and a short grace restarts healthy daemons.
    ready_grace: float = 300.0
    dns_ttl: int = 5
    #: HostSettings fields overridden in the host agent process (test-sized backoff)
    host_tuning: Mapping[str, float] = field(default_factory=lambda: {
        "backoff_initial": 0.1, "backoff_max": 1.0, "watch_timeout_seconds": 60,
        "shutdown_grace": 2.0})
    #: report_stale_after for the registry (seconds)
    report_stale_after: float = 30.0
    #: the guests' report_interval (-N -j collection and heartbeat), seconds
    report_interval: float = 10.0
    #: the NVLink clique of every VM's GPUs (nvidia-smi stand-in), unless set per VM
    default_fabric: Mapping[str, object] | None = field(default_factory=lambda: {
        "cluster_uuid": RACK_CLUSTER_UUID, "clique_id": 1})
    #: authEncryption: the host agent's --ca-overlap and --cert-lifetime (seconds)
    ca_overlap: float = 3600.0
    cert_lifetime: float = 7 * 86400.0
    workdir: Path | None = None
    keep_workdir: bool = False
    #: Interpreter of the guest agents (run from the repository root, so it only needs
    #: the guest extra's dependencies). Default: this one. The benchmarks pass a venv
    #: holding just ``imex-ensemble[guest]``'s dependencies, as a real guest has, since
    #: dnspython imports whatever optional HTTP/2 stack it finds installed.
    guest_python: str = PY
    #: version skew (tests/sandbox/releases.py): the host agent's release and every guest's
    #: unless ``Sandbox.guest_releases`` names another; None: this tree
    host_release: Release | None = None
    guest_release: Release | None = None
    #: the registry serves HTTPS too (``--tls-self-issued``, its address as a SAN); guests
    #: of this tree use it, pinned to the registry CA; a previous release's keep HTTP
    registry_tls: bool = False
    #: the IMEX stand-in the guests run: "python" (imex_standin.py: every feature, mutual
    #: TLS included) or "c" (imex_standin.c: the same daemon for plain TCP, at the cost of
    #: a small native one; the benchmarks' choice, issue 27). An ensemble with mutual TLS
    #: runs the Python one either way.
    imex_daemon: str = "python"


@dataclass(frozen=True)
class EnsembleSpec:
    """One ensemble as the virt-controller created it (its Service) plus the guests' token."""

    namespace: str
    name: str
    max_members: int = 18
    port: int = 50000
    token: str = field(default_factory=lambda: secrets.token_hex(16), repr=False)
    #: IMEX mutual TLS (issue 19): the Service says so, guests get certificates
    auth_encryption: bool = False

    @property
    def id(self) -> EnsembleId:
        return EnsembleId(self.namespace, self.name)

    @property
    def token_sha256(self) -> str:
        return hashlib.sha256(self.token.encode()).hexdigest()

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


# --------------------------------------------------------------------------- helpers


def _pdeathsig() -> None:
    """preexec_fn: the child dies with the thread that started it (even on ``kill -9``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)


def child_env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{pp}" if pp else str(REPO_ROOT),
            "PYTHONUNBUFFERED": "1", "NO_PROXY": "*", "no_proxy": "*"}


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def wait_for(what: str, probe: Callable[[], T | None], timeout: float,
             interval: float = 0.2, detail: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until it returns something truthy; :class:`NotConverged` otherwise."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while True:
        last = probe()
        if last:
            return last
        if time.monotonic() >= deadline:
            break
        time.sleep(interval)
    extra = f"\n{detail()}" if detail else ""
    raise NotConverged(f"timed out after {timeout:g}s waiting for {what} (last: {last!r})"
                       f"{extra}")


def free_port(host: str) -> int:
    """A TCP port free on ``host`` right now (for a child that must be told its port)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def cleanup_dead_runs(prefix: str) -> list[str]:
    """Remove namespaces ``<prefix>-<tag>-*`` of runs whose owner process is gone."""
    removed: list[str] = []
    tags = {n.split("-")[1] for n in list_netns()
            if n.startswith(prefix + "-") and n.count("-") >= 2}
    for tag in sorted(tags):
        pidfile = PID_DIR / f"{prefix}-{tag}.pid"
        try:
            owner = int(pidfile.read_text().strip())
        except (OSError, ValueError):
            owner = 0
        if owner and _pid_alive(owner):
            continue
        removed += cleanup_stale(f"{prefix}-{tag}")
        pidfile.unlink(missing_ok=True)
    return removed


class LoopThread:
    """A private asyncio loop on a daemon thread (a DNS stand-in and its Kubernetes feeder)."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="sandbox-loop",
                                       daemon=True)
        self.thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future[Any]:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def close(self) -> None:
        if not self.thread.is_alive():
            return

        async def cancel_all() -> None:
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        with contextlib.suppress(Exception):
            self.run(cancel_all(), 10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        if not self.thread.is_alive():
            self.loop.close()


# --------------------------------------------------------------------------- VMs


class Vm:
    """One namespace "VM": its guest agent, the IMEX stand-in's files, and views of them."""

    def __init__(self, sandbox: Sandbox, spec: EnsembleSpec, vmi: str, node: Node) -> None:
        self.sandbox = sandbox
        self.spec = spec
        self.vmi = vmi
        self.node = node
        self.dir = sandbox.workdir / "vms" / f"{spec.namespace}.{vmi}"
        self.agent: subprocess.Popen[bytes] | None = None
        self.boots = 0
        #: the agent's imex_channels (none by default: see write_config)
        self.channels: list[int] = []

    # ---- paths and views
    @property
    def ip(self) -> str:
        return self.node.ip

    @property
    def index(self) -> int:
        return int(self.vmi.rsplit("-", 1)[1])

    @property
    def imex_cfg(self) -> Path:
        return self.dir / "imex" / "config.cfg"

    @property
    def imex_state_file(self) -> Path:
        return self.dir / "imex" / "state.json"

    @property
    def status_file(self) -> Path:
        return self.dir / "status.json"

    @property
    def log_file(self) -> Path:
        return self.dir / "agent.log"

    @property
    def hosts_path(self) -> Path:
        return self.node.hosts_path

    @property
    def release(self) -> Release | None:
        """The release this VM's guest agent runs (None: this tree)."""
        key = (self.spec.namespace, self.vmi)
        if key in self.sandbox.guest_releases:
            return self.sandbox.guest_releases[key]
        return self.sandbox.settings.guest_release

    def status(self) -> dict[str, Any]:
        """The guest agent's status.json ({} before it wrote one)."""
        return _read_json(self.status_file)

    def imex_state(self) -> dict[str, Any]:
        """The IMEX stand-in's state file (peers with resolved address and status)."""
        return _read_json(self.imex_state_file)

    def hosts_block(self) -> dict[int, str] | None:
        try:
            return read_block(self.hosts_path.read_bytes(), self.spec.id)
        except OSError:
            return None

    def connected_peers(self) -> set[int]:
        st = self.imex_state()
        if st.get("state") != "READY" or not self.running():
            return set()
        return {int(i) for i, p in (st.get("peers") or {}).items()
                if p.get("status") == "CONNECTED"}

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``nvidia-imex-ctl -c CFG ARGS`` (the ctl stand-in) inside this VM."""
        return self.node.run([STANDIN_CTL, "-c", str(self.imex_cfg), *args], check=False,
                             timeout=20, env=child_env(), cwd=REPO_ROOT)

    def domain(self) -> dict[str, Any]:
        """``nvidia-imex-ctl -N -j``: IMEX's own view of the domain ({} when unreachable)."""
        out = self.ctl("-N", "-j")
        if out.returncode != 0:
            return {}
        try:
            doc = json.loads(out.stdout)
        except ValueError:
            return {}
        return doc if isinstance(doc, dict) else {}

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_file.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def running(self) -> bool:
        return self.agent is not None and self.agent.poll() is None

    def _imex_daemon(self) -> list[str]:
        """The IMEX stand-in's command (``SandboxSettings.imex_daemon``): the native one is
        exec'd directly, as a guest has the real binary; TLS stays on the Python one."""
        choice = self.sandbox.settings.imex_daemon
        if choice not in ("python", "c"):
            raise ValueError(f"SandboxSettings.imex_daemon must be 'python' or 'c', "
                             f"not {choice!r}")
        if choice == "c" and not self.spec.auth_encryption:
            return [str(standin_daemon())]
        return [STANDIN_IMEX]

    # ---- lifecycle
    def write_config(self) -> Path:
        self.dir.mkdir(parents=True, exist_ok=True)
        write_standin_files(self.dir / "imex", [])
        fabric = self.sandbox.fabrics.get((self.spec.namespace, self.vmi),
                                          self.sandbox.settings.default_fabric)
        (self.dir / "fabric.json").write_text(json.dumps(fabric))
        token = self.dir / "token"
        token.write_text(self.spec.token + "\n")
        token.chmod(0o600)
        s = self.sandbox.settings
        values: dict[str, object] = {
            "ensemble": self.spec.name,
            "namespace": self.spec.namespace,
            "max_members": self.spec.max_members,
            "port": self.spec.port,
            "registry_url": self.sandbox.registry_url,
            "token_file": str(token),
            "nameservers": [self.sandbox.dns_address],
            "nodes_config": str(self.dir / "imex" / "nodes_config.cfg"),
            "status_file": str(self.status_file),
            "imex_control": "process",
            "imex_command": [*self._imex_daemon(), "-c", str(self.imex_cfg),
                             "--state-file", str(self.imex_state_file)],
            # the native stand-in itself, as a guest has the real binary (issue 27)
            "imex_ctl": [str(standin_ctl()), "-c", str(self.imex_cfg)],
            "nvidia_smi": [STANDIN_SMI, "--fabric-file", str(self.dir / "fabric.json")],
            # IMEX channel nodes: none, unless a test asks (tests/e2e/test_barrier.py, in a
            # private mount namespace): the host's /dev is never touched
            "imex_channels": list(self.channels),
            "report_interval": s.report_interval,
            "poll_interval": s.poll_interval,
            "signal_interval": s.signal_interval,
            "dns_timeout": s.dns_timeout,
            "longpoll_timeout": s.longpoll_timeout,
            "ready_grace": s.ready_grace,
        }
        if self.release is not None:  # 0.1 knows no imex_channels: its one channel's path
            del values["imex_channels"]
            values["imex_channel_device"] = str(self.dir / "channel0")
        if self.spec.auth_encryption:
            # the pin comes from the CA Secret (as the generator's --from-ensemble takes it
            # from status.caSHA256), never from the registry
            values |= {"auth_encryption": True, "ca_sha256": self.sandbox.ca_sha256(self.spec),
                       "tls_dir": str(self.dir / "tls"), "imex_config": str(self.imex_cfg)}
        if self.sandbox.settings.registry_tls and self.release is None:
            values |= {"registry_url": self.sandbox.registry_tls_url,
                       "registry_ca_sha256": self.sandbox.registry_ca_sha256()}
        values |= self.sandbox.guest_config.get((self.spec.namespace, self.vmi), {})
        cfg = self.dir / "config.toml"
        cfg.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
        return cfg

    def start(self, wrap: Sequence[str] = ()) -> None:
        """Boot: start the guest agent inside the namespace (it starts IMEX itself).
        ``wrap``: a command the agent's argv is appended to, inside the namespace (the
        channel test's private mount namespace)."""
        if self.running():
            return
        cfg = self.write_config()
        self.boots += 1
        with open(self.log_file, "ab") as logf:
            logf.write(f"---- boot {self.boots} at {time.strftime('%H:%M:%S')} ip {self.ip}\n"
                       .encode())
            logf.flush()
            release = self.release
            head = [release.script("imex-guest-agent")] if release is not None else [
                self.sandbox.settings.guest_python, "-m", "guest_agent.cli"]
            self.agent = subprocess.Popen(
                self.node.argv([*wrap, *head, "run", "--config", str(cfg), "--json"]),
                stdout=logf, stderr=subprocess.STDOUT,
                env=release.env(child_env()) if release is not None else child_env(),
                cwd=REPO_ROOT, preexec_fn=_pdeathsig)
        self.node.procs.append(self.agent)

    def stop(self, timeout: float = GUEST_STOP_WAIT) -> None:
        """Shut down cleanly (SIGTERM to the agent, which stops IMEX), then kill leftovers.

        The wait covers the agent's documented stop: its IMEX child (process mode) gets up to
        its grace (SIGTERM, 10 s, SIGKILL), and the agent's own work ends within 2 s. The
        old 10 s wait equalled the child's grace alone, so an IMEX slow to exit (the
        stand-in once was: issue 14's "agent ignored SIGTERM for 10s") raced it."""
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(timeout)
            except subprocess.TimeoutExpired:
                log.warning("%s: agent ignored SIGTERM for %gs", self.vmi, timeout)
        self.kill()

    def kill(self) -> None:
        """Power off: SIGKILL every process in the VM's namespace (a crash)."""
        for sig in (signal.SIGKILL,):
            for pid in netns_pids(self.node.name):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        if self.agent is not None:
            with contextlib.suppress(ProcessLookupError):
                self.agent.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.agent.wait(5)
        deadline = time.monotonic() + 5
        while netns_pids(self.node.name) and time.monotonic() < deadline:
            time.sleep(0.05)


# --------------------------------------------------------------------------- the sandbox


class Sandbox:
    """API double + DNS + host agent/registry + namespace VMs; see the module docstring.

    ``with Sandbox(SandboxSettings(prefix="demo")) as sbx: ...``
    """

    def __init__(self, settings: SandboxSettings | None = None) -> None:
        self.settings = settings or SandboxSettings()
        if not 1 <= len(self.settings.prefix) <= 6 or "-" in self.settings.prefix:
            raise ValueError(f"prefix {self.settings.prefix!r}: 1-6 characters without '-'")
        self.workdir = Path("/nonexistent")
        self._own_workdir = False
        self.api: ThreadedKubeApi | None = None
        self.kubeconfig = Path("/nonexistent")
        self.fabric: Fabric | None = None
        self.dns_ip = ""
        self.registry_ip = ""
        self.registry_port = 0
        self.registry_tls_port = 0
        #: (namespace, vmi) -> the release its guest runs, overriding the settings'
        self.guest_releases: dict[tuple[str, str], Release | None] = {}
        #: (namespace, vmi) -> config keys written over the sandbox's own
        self.guest_config: dict[tuple[str, str], Mapping[str, object]] = {}
        self.dns_model = ClusterDnsModel(ttl=self.settings.dns_ttl)
        self.dns: DnsServer | None = None
        self._loop: LoopThread | None = None
        self._feeder: concurrent.futures.Future[Any] | None = None
        self.host_agent: subprocess.Popen[bytes] | None = None
        self.host_agent_starts = 0
        self.vms: dict[tuple[str, str], Vm] = {}
        #: (namespace, vmi) -> the fabric its GPUs report from its next boot (None: none)
        self.fabrics: dict[tuple[str, str], Mapping[str, object] | None] = {}
        self._spare: list[Node] = []
        self._pidfile: Path | None = None
        #: keep the work directory at close (a test session sets it after a failure)
        self.keep_workdir = self.settings.keep_workdir
        self._old_sigterm: Any = None
        self._closed = False

    # ---- addresses
    @property
    def dns_address(self) -> str:
        assert self.dns is not None
        return f"{self.dns_ip}:{self.dns.port}"

    @property
    def registry_url(self) -> str:
        return f"http://{self.registry_ip}:{self.registry_port}"

    @property
    def registry_tls_url(self) -> str:
        return f"https://{self.registry_ip}:{self.registry_tls_port}"

    def registry_ca_sha256(self, timeout: float = 30.0) -> str:
        """The registry CA's fingerprint, from its Secret (what guests pin)."""
        assert self.api is not None

        def probe() -> str | None:
            try:
                obj = self.api.get("v1", "Secret", "imex-registry-tls",  # type: ignore[union-attr]
                                   AGENT_NAMESPACE)
            except Exception:
                return None
            pem = base64.b64decode(obj["data"]["ca.crt"]).decode()
            return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()

        return wait_for("the registry TLS Secret", probe, timeout, 0.1,
                        self.host_agent_log_tail)

    @property
    def host_agent_log(self) -> Path:
        return self.workdir / "host-agent.log"

    # ---- lifecycle
    def __enter__(self) -> Sandbox:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> Sandbox:
        if os.geteuid() != 0:
            raise SandboxError("the namespace sandbox needs root (ip netns, veth, bridge)")
        self._install_sigterm()
        precompile()
        s = self.settings
        stale = cleanup_dead_runs(s.prefix)
        if stale:
            log.info("removed %d namespaces of dead runs: %s", len(stale), " ".join(stale))
        if s.workdir is not None:
            self.workdir = s.workdir
            self.workdir.mkdir(parents=True, exist_ok=True)
        else:
            self.workdir = Path(tempfile.mkdtemp(prefix=f"imex-{s.prefix}-"))
            self._own_workdir = True
        # 1. the API double (loopback; the host agent and feeder talk to it)
        self.api = ThreadedKubeApi(bookmark_interval=1.0).start()
        self.kubeconfig = self.api.write_kubeconfig(self.workdir / "kubeconfig")
        self.api.put({"apiVersion": "v1", "kind": "Namespace",
                      "metadata": {"name": AGENT_NAMESPACE}})
        # 2. the fabric: bridge, gateway in the root namespace, DNS and registry addresses
        self.fabric = Fabric(s.prefix, gateway=True)
        PID_DIR.mkdir(parents=True, exist_ok=True)
        self._pidfile = PID_DIR / f"{s.prefix}-{self.fabric.tag}.pid"
        self._pidfile.write_text(f"{os.getpid()}\n")
        self.dns_ip = self.fabric.allocate()
        self.registry_ip = self.fabric.allocate()
        self.ensure_host_addresses()
        # 3. DNS stand-in fed from the API's EndpointSlices and Services
        self._loop = LoopThread()
        self.dns = DnsServer(self.dns_model, self.dns_ip, 0)
        self._loop.run(self.dns.start())
        synced = asyncio.Event()

        async def feed() -> None:
            from lightkube import AsyncClient, KubeConfig

            client = AsyncClient(KubeConfig.from_file(self.kubeconfig), trust_env=False)
            try:
                await follow_kubernetes(self.dns_model, client,
                                        backoff=lambda n: min(0.1 * 2**n, 1.0), synced=synced)
            finally:
                await client.close()

        self._feeder = self._loop.spawn(feed())

        async def wait_synced() -> None:
            await asyncio.wait_for(synced.wait(), 20)

        self._loop.run(wait_synced(), 25)
        # 4. the host agent and its registry
        self.registry_port = free_port(self.registry_ip)
        if s.registry_tls:
            self.registry_tls_port = free_port(self.registry_ip)
        self.start_host_agent()
        log.info("sandbox up: api %s, dns %s, registry %s, subnet %s, workdir %s",
                 self.api.url, self.dns_address, self.registry_url, self.fabric.subnet,
                 self.workdir)
        return self

    def close(self) -> None:
        """Tear everything down; every step runs even when an earlier one fails."""
        if self._closed:
            return
        self._closed = True
        steps: list[tuple[str, Callable[[], None]]] = [
            ("guest agents", self._stop_all_vms),
            ("namespaces", self._close_fabric),
            ("host agent", self.stop_host_agent),
            ("dns", self._stop_dns),
            ("api double", self._stop_api),
            ("pid file", self._drop_pidfile),
            ("workdir", self._drop_workdir),
            ("signal handler", self._restore_sigterm),
        ]
        for what, step in steps:
            try:
                step()
            except BaseException as e:
                log.warning("teardown of %s failed: %s", what, e)

    def _stop_all_vms(self) -> None:
        vms = [vm for vm in self.vms.values() if vm.running()]
        for vm in vms:  # all at once: each needs a moment to stop IMEX
            if vm.agent is not None:
                with contextlib.suppress(ProcessLookupError):
                    vm.agent.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for vm in vms:
            if vm.agent is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    vm.agent.wait(max(0.1, deadline - time.monotonic()))
        for vm in self.vms.values():
            vm.kill()

    def _close_fabric(self) -> None:
        if self.fabric is not None:
            self.fabric.close()

    def _stop_dns(self) -> None:
        if self._loop is None:
            return
        if self._feeder is not None:
            self._feeder.cancel()
        if self.dns is not None:
            with contextlib.suppress(Exception):
                self._loop.run(self.dns.stop(), 10)
        self._loop.close()

    def _stop_api(self) -> None:
        if self.api is not None:
            self.api.stop()

    def _drop_pidfile(self) -> None:
        if self._pidfile is not None:
            self._pidfile.unlink(missing_ok=True)

    def _drop_workdir(self) -> None:
        if self._own_workdir and not self.keep_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def _install_sigterm(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return

        def on_term(signum: int, frame: FrameType | None) -> None:
            raise KeyboardInterrupt(f"signal {signum}")

        self._old_sigterm = signal.signal(signal.SIGTERM, on_term)

    def _restore_sigterm(self) -> None:
        if self._old_sigterm is not None:
            signal.signal(signal.SIGTERM, self._old_sigterm)
            self._old_sigterm = None

    def host_addresses(self) -> list[str]:
        """The IPv4 addresses on the host side of the bridge right now."""
        assert self.fabric is not None and self.fabric.gateway_link is not None
        out = ip("-j", "-4", "addr", "show", "dev", self.fabric.gateway_link, check=False)
        try:
            return [str(a["local"]) for link in json.loads(out or "[]")
                    for a in link.get("addr_info", [])]
        except (ValueError, KeyError, TypeError):
            return []

    def ensure_host_addresses(self) -> None:
        """Put the DNS and registry addresses on the host side of the bridge (again).

        Something outside the sandbox (another run's cleanup on a shared machine) once took
        the registry's address away mid-run; say so loudly and put it back.
        """
        assert self.fabric is not None and self.fabric.gateway_link is not None
        have = self.host_addresses()
        for addr in (self.dns_ip, self.registry_ip):
            if addr in have:
                continue
            if self.host_agent_starts:
                log.warning("address %s vanished from %s (have %s); adding it again", addr,
                            self.fabric.gateway_link, have)
            ip("addr", "replace", f"{addr}/{self.fabric.subnet.prefixlen}", "dev",
               self.fabric.gateway_link)

    # ---- host agent
    def start_host_agent(self, timeout: float = 30.0) -> None:
        """Start the host agent process and wait until its registry says ready."""
        if self.host_agent is not None and self.host_agent.poll() is None:
            return
        self.ensure_host_addresses()
        tune = [a for k, v in self.settings.host_tuning.items() for a in ("--tune", f"{k}={v}")]
        release = self.settings.host_release
        head = [release.script("imex-host-agent")] if release is not None else [
            PY, "-m", "tests.sandbox.host_agent_proc", *tune]
        argv = [*head,
                "--kubeconfig", str(self.kubeconfig),
                "--listen", f"{self.registry_ip}:{self.registry_port}", "--json",
                "--report-stale-after", str(self.settings.report_stale_after),
                "--agent-namespace", AGENT_NAMESPACE,
                "--ca-overlap", str(self.settings.ca_overlap),
                "--cert-lifetime", str(self.settings.cert_lifetime)]
        if self.settings.registry_tls:
            argv += ["--tls-listen", f"{self.registry_ip}:{self.registry_tls_port}",
                     "--tls-self-issued", "--tls-san", self.registry_ip]
        self.host_agent_starts += 1
        with open(self.host_agent_log, "ab") as logf:
            logf.write(f"---- start {self.host_agent_starts}\n".encode())
            logf.flush()
            self.host_agent = subprocess.Popen(
                argv, stdout=logf, stderr=subprocess.STDOUT,
                env=release.env(child_env()) if release is not None else child_env(),
                cwd=REPO_ROOT, preexec_fn=_pdeathsig)

        def ready() -> bool:
            if self.host_agent is not None and self.host_agent.poll() is not None:
                raise SandboxError(f"host agent exited ({self.host_agent.returncode}):\n"
                                   f"{self.host_agent_log_tail()}")
            try:
                with urllib.request.urlopen(f"{self.registry_url}/readyz", timeout=2) as r:
                    return bool(r.status == 200)
            except (OSError, urllib.error.URLError):
                return False

        wait_for("the registry's /readyz", ready, timeout, 0.1, self.host_agent_log_tail)

    def stop_host_agent(self, timeout: float = 20.0) -> None:
        p = self.host_agent
        if p is None or p.poll() is not None:
            return
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            log.warning("host agent ignored SIGTERM for %gs; killing it", timeout)
            p.kill()
            p.wait(5)

    def host_agent_log_tail(self, chars: int = 4000) -> str:
        try:
            return self.host_agent_log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    # ---- registry
    def registry_get(self, path: str, timeout: float = 5.0) -> tuple[int, bytes]:
        """``GET`` on the registry from the root namespace: (status, body)."""
        req = urllib.request.Request(f"{self.registry_url}{path}")
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return int(r.status), r.read()
        except urllib.error.HTTPError as e:
            return int(e.code), e.read()

    def registry_json(self, spec: EnsembleSpec, wait: int | None = None,
                      timeout: float = 0, strict: bool = False) -> dict[str, Any]:
        """The registry's ensemble document; {} when it is not there or unreachable, unless
        ``strict`` (then :class:`SandboxError`)."""
        q = f"?wait={wait}&timeout={timeout:g}" if wait is not None else ""
        try:
            status, body = self.registry_get(f"/v1/ensembles/{spec.key}{q}", timeout + 15)
        except OSError as e:
            if strict:
                raise SandboxError(f"registry unreachable: {e}") from e
            return {}
        if status != 200:
            if strict:
                raise SandboxError(f"registry: HTTP {status}: {body[:200]!r}")
            return {}
        doc = json.loads(body)
        return doc if isinstance(doc, dict) else {}

    def registry_table(self, spec: EnsembleSpec) -> str:
        try:
            status, body = self.registry_get(f"/v1/ensembles/{spec.key}?format=table")
        except OSError as e:
            return f"(registry unreachable: {e})"
        return body.decode(errors="replace") if status == 200 else f"(HTTP {status})"

    # ---- VMs (called by the virt-controller, as virt-handler would start a domain)
    def ca_sha256(self, spec: EnsembleSpec, timeout: float = 30.0) -> str:
        """The ensemble CA's fingerprint, from its Secret (the trust anchor guests pin)."""
        assert self.api is not None
        name = f"imex-ca-{spec.namespace}.{spec.name}"

        def probe() -> str | None:
            try:
                obj = self.api.get("v1", "Secret", name, AGENT_NAMESPACE)  # type: ignore[union-attr]
            except Exception:
                return None
            pem = base64.b64decode(obj["data"]["ca.crt"]).decode()
            return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()

        return wait_for(f"the CA Secret {AGENT_NAMESPACE}/{name}", probe, timeout, 0.1,
                        self.host_agent_log_tail)

    def vm(self, spec: EnsembleSpec, vmi: str) -> Vm:
        return self.vms[(spec.namespace, vmi)]

    def vms_of(self, spec: EnsembleSpec) -> list[Vm]:
        return sorted((vm for (ns, _), vm in self.vms.items()
                       if ns == spec.namespace and vm.spec.name == spec.name and vm.running()),
                      key=lambda v: v.index)

    def create_vm(self, spec: EnsembleSpec, vmi: str) -> Vm:
        """A powered-off VM with a fresh address (reusing a namespace when there is one)."""
        assert self.fabric is not None
        key = (spec.namespace, vmi)
        if key in self.vms:
            vm = self.vms[key]
            vm.kill()
            vm.node.set_address()
            vm.node.set_link(True)
            return vm
        node = self._spare.pop() if self._spare else None
        if node is None:
            node = self.fabric.add_node(hostname=vmi)
        else:
            node.hostname = vmi
            node.set_address()
            node.set_link(True)
        vm = Vm(self, spec, vmi, node)
        self.vms[key] = vm
        return vm

    def destroy_vm(self, spec: EnsembleSpec, vmi: str) -> None:
        """Shut the VM down and keep its namespace (link down) for a later VM."""
        vm = self.vms.pop((spec.namespace, vmi), None)
        if vm is None:
            return
        vm.stop()
        vm.node.set_link(False)
        vm.node.write_hosts(self.fabric.hosts_lines({}) if self.fabric else "")
        self._spare.append(vm.node)

    # ---- faults seen from the guests
    def _route_all(self, verb: str, target: str) -> None:
        """Add or remove a prohibit route to ``target`` in every VM; adding it also aborts
        the VMs' open TCP connections to ``target`` (``ss -K``).

        A route only stops what a VM sends: a long-poll parked before the block would
        still receive the registry's answer, which a real partition never delivers
        (the e2e "DNS down too" test saw a guest learn a crash that way).
        """
        names = [vm.node.name for vm in self.vms.values()] + [n.name for n in self._spare]
        for name in names:
            ip("route", verb, "prohibit", f"{target}/32", netns=name, check=False)
            if verb != "del":
                subprocess.run(["ip", "netns", "exec", name, "ss", "-K", "-t", "dst", target],
                               capture_output=True, check=False, timeout=10)

    def block_registry(self, blocked: bool = True) -> None:
        """Make the registry unreachable from every VM (the host agent keeps publishing)."""
        self._route_all("replace" if blocked else "del", self.registry_ip)

    def block_dns(self, blocked: bool = True) -> None:
        """Make the DNS stand-in unreachable from every VM."""
        self._route_all("replace" if blocked else "del", self.dns_ip)

    # ---- waiting
    def converged(self, spec: EnsembleSpec, expect: Mapping[int, str] | None = None,
                  cliques: Mapping[int, str] | None = None) -> str | None:
        """None when every running VM of ``spec`` pins exactly ``expect`` (default: the
        running VMs' addresses) with absent slots at 127.0.0.2 and its IMEX sees every
        other running member CONNECTED; else a short reason. With ``cliques`` (index ->
        clique) a VM expects only the members of its own clique (``imex_shared.cliques``)."""
        from imex_shared.cliques import pins_for

        vms = self.vms_of(spec)
        everyone = dict(expect) if expect is not None else {vm.index: vm.ip for vm in vms}
        for vm in vms:
            want = pins_for(everyone, cliques or {}, vm.index)
            block = {i: want.get(i, "127.0.0.2") for i in range(spec.max_members)}
            got = vm.hosts_block()
            if got != block:
                diff = {i: (got or {}).get(i) for i in block if (got or {}).get(i) != block[i]}
                return f"{vm.vmi}: hosts block differs at {diff}"
            peers = set(want) - {vm.index}
            missing = peers - vm.connected_peers()
            if missing:
                return f"{vm.vmi}: IMEX not CONNECTED to {sorted(missing)}"
        return None

    def wait_converged(self, spec: EnsembleSpec, timeout: float = 60.0,
                       expect: Mapping[int, str] | None = None,
                       cliques: Mapping[int, str] | None = None) -> float:
        """Wait until :meth:`converged`; returns the seconds it took."""
        t0 = time.monotonic()
        reason: list[str | None] = [None]

        def probe() -> bool:
            reason[0] = self.converged(spec, expect, cliques)
            return reason[0] is None

        wait_for(f"{spec.key} to converge", probe, timeout, 0.25,
                 lambda: f"still: {reason[0]}")
        return time.monotonic() - t0

    @contextlib.contextmanager
    def diagnostics_on_failure(self) -> Iterator[None]:
        """Append agent logs to a NotConverged/AssertionError raised in the block."""
        try:
            yield
        except (NotConverged, AssertionError) as e:
            tails = [f"--- host agent ---\n{self.host_agent_log_tail(2000)}"]
            for vm in list(self.vms.values())[:4]:
                tails.append(f"--- {vm.vmi} ---\n{vm.log_tail(1500)}")
            raise type(e)(f"{e}\n" + "\n".join(tails)) from e
