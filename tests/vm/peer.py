"""A lean ensemble member next to the QEMU guests: a network namespace on the same bridge.

TEST HARNESS. The smoke tests need *one peer* for the guest under test, so that "names
pinned both ways, IMEX CONNECTED both ways, both READY in the registry" means something.
The cheapest peer that still proves convergence is not another QEMU guest (minutes of TCG)
but what the sandbox's e2e tests run as a VM: a network namespace with its own eth0 on the
harness bridge (a veth), its own ``/etc/hosts`` (``/etc/netns/<ns>/hosts``, bind-mounted by
``ip netns exec``), the real guest agent from this tree and the IMEX stand-in as its
``process``-mode child, its VMI in the API double set Running with that address. What it
does not prove (cloud-init, systemd, the installer, a foreign CPU) is exactly what the
guest under test proves; the peer only has to be a correct, independent member.

Lifecycle: :meth:`Peer.start` after the harness namespace exists; :meth:`Peer.close` kills
its processes and deletes its namespace and ``/etc/netns`` entry (the harness also removes
``vmt-<pid>-*`` namespaces of dead runs).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

from imex_shared.hostsfile import read_block
from tests.sandbox.ensemble import EnsembleSpec, child_env, toml_value
from tests.sandbox.imex_standin import write_standin_files
from tests.sandbox.netns import ip, netns_pids

REPO = Path(__file__).resolve().parents[2]
STANDIN_IMEX = str(REPO / "tests" / "sandbox" / "bin" / "nvidia-imex")
STANDIN_CTL = str(REPO / "tests" / "sandbox" / "bin" / "nvidia-imex-ctl")
ETC_NETNS = Path("/etc/netns")


class Peer:
    """Member ``index`` of ``spec`` at ``addr``, in namespace ``netns`` off ``bridge``."""

    def __init__(self, *, index: int, vmi: str, addr: str, prefixlen: int, netns: str,
                 veth: str, bridge: str, spec: EnsembleSpec, workdir: Path,
                 registry_url: str, dns: str, search: str) -> None:
        self.index, self.vmi, self.ip = index, vmi, addr
        self.prefixlen, self.netns, self.veth, self.bridge = prefixlen, netns, veth, bridge
        self.spec, self.dir = spec, workdir
        self.registry_url, self.dns, self.search = registry_url, dns, search
        self.mac = f"52:54:00:78:00:{index + 10:02x}"
        self.agent: subprocess.Popen[bytes] | None = None
        self.imex_cfg = workdir / "imex" / "config.cfg"

    @property
    def hosts_path(self) -> Path:
        return ETC_NETNS / self.netns / "hosts"

    def start(self) -> None:
        """Namespace, veth on the bridge (called from inside the harness namespace), agent."""
        self.dir.mkdir(parents=True, exist_ok=True)
        ip("netns", "add", self.netns)
        etc = ETC_NETNS / self.netns
        etc.mkdir(parents=True, exist_ok=True)
        (etc / "hosts").write_text("127.0.0.1\tlocalhost\n")
        (etc / "resolv.conf").write_text(f"nameserver {self.dns}\nsearch {self.search}\n")
        ip("link", "add", self.veth, "type", "veth", "peer", "name", "eth0",
           "netns", self.netns)
        ip("link", "set", self.veth, "master", self.bridge, "up")
        ip("link", "set", "lo", "up", netns=self.netns)
        ip("link", "set", "eth0", "address", self.mac, netns=self.netns)
        ip("addr", "add", f"{self.ip}/{self.prefixlen}", "dev", "eth0", netns=self.netns)
        ip("link", "set", "eth0", "up", netns=self.netns)
        cfg = self.write_config()
        logf = open(self.dir / "agent.log", "ab")  # noqa: SIM115 (the child owns it)
        try:
            self.agent = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, "-m", "guest_agent.cli",
                 "run", "--config", str(cfg), "--json"],
                stdout=logf, stderr=subprocess.STDOUT, env=child_env(), cwd=REPO,
                start_new_session=True)
        finally:
            logf.close()

    def write_config(self) -> Path:
        self.imex_cfg = write_standin_files(self.dir / "imex", [])
        token = self.dir / "token"
        token.write_text(self.spec.token + "\n")
        token.chmod(0o600)
        values: dict[str, object] = {
            "ensemble": self.spec.name, "namespace": self.spec.namespace,
            "max_members": self.spec.max_members, "port": self.spec.port,
            "registry_url": self.registry_url, "token_file": str(token),
            "nameservers": [self.dns], "own_index": self.index,
            "nodes_config": str(self.dir / "imex" / "nodes_config.cfg"),
            "status_file": str(self.dir / "status.json"),
            "imex_control": "process",
            "imex_command": [STANDIN_IMEX, "-c", str(self.imex_cfg),
                             "--state-file", str(self.dir / "imex-state.json")],
            "imex_ctl": [STANDIN_CTL, "-c", str(self.imex_cfg)],
        }
        cfg = self.dir / "config.toml"
        cfg.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
        return cfg

    def running(self) -> bool:
        return self.agent is not None and self.agent.poll() is None

    def pins(self) -> dict[int, str] | None:
        try:
            return read_block(self.hosts_path.read_bytes(), self.spec.id)
        except OSError:
            return None

    def domain(self) -> dict[str, Any] | None:
        """``nvidia-imex-ctl -N -j`` of the peer's IMEX stand-in (None when unanswered)."""
        p = subprocess.run(["ip", "netns", "exec", self.netns, STANDIN_CTL, "-c",
                            str(self.imex_cfg), "-N", "-j"], capture_output=True, text=True,
                           timeout=20, env=child_env(), cwd=REPO, check=False)
        if p.returncode != 0:
            return None
        with contextlib.suppress(ValueError):
            doc = json.loads(p.stdout)
            return doc if isinstance(doc, dict) else None
        return None

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return (self.dir / "agent.log").read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    def close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.agent.pid, signal.SIGTERM)
            try:
                self.agent.wait(15)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.agent.pid, signal.SIGKILL)
                self.agent.wait(5)
        for pid in netns_pids(self.netns):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        ip("netns", "del", self.netns, check=False)
        shutil.rmtree(ETC_NETNS / self.netns, ignore_errors=True)
