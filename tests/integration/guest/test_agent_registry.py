"""The real agent on the registry fast path: long-poll in, status report out, over loopback.

The registry here is a small threaded HTTP server speaking the contract's two calls
(``GET /v1/ensembles/{ns}/{name}?wait=G&timeout=S`` held until the generation moves, and
``PUT .../members/{i}/status``); DNS points at a closed port, so everything the agent learns
comes from the registry.
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest

from imex_shared.hostsfile import read_block
from imex_shared.model import EnsembleId
from tests.guest_support.agent import (
    FAKE_IMEX,
    READY_CTL,
    AgentProc,
    read_events,
    wait_until,
    write_config,
)

NS, NAME = "gpu", "rack-r"
SMI = str(Path(__file__).resolve().parents[3] / "tests" / "sandbox" / "bin" / "nvidia-smi")
FABRIC = {"cluster_uuid": "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10", "clique_id": 7}
ENS = EnsembleId(NS, NAME)


class FakeRegistry:
    def __init__(self) -> None:
        self.generation = 1_700_000_000_000
        self.members: dict[int, str] = {}
        self.cliques: dict[int, str] = {}
        self.reports: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        registry = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def _send(self, code: int, doc: object) -> None:
                body = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                if url.path != f"/v1/ensembles/{NS}/{NAME}":
                    self._send(404, {"error": "no such ensemble"})
                    return
                q = parse_qs(url.query)
                wait = int(q["wait"][0]) if "wait" in q else None
                timeout = float(q.get("timeout", ["1"])[0])
                with registry.cond:
                    registry.cond.wait_for(lambda: registry.generation != wait, timeout)
                    self._send(200, registry.doc())

            def do_PUT(self) -> None:
                n = int(self.headers.get("Content-Length", "0"))
                body = json.loads(self.rfile.read(n))
                with registry.cond:
                    registry.reports.append({"path": self.path, "body": body,
                                             "auth": self.headers.get("Authorization")})
                self._send(200, {"ok": True})

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def doc(self) -> dict[str, Any]:
        return {"namespace": NS, "name": NAME, "domain_id": ENS.domain_id,
                "generation": self.generation, "max_members": 4, "port": 50000,
                "members": [{"index": i, "slot": ENS.slot(i), "ip": ip, "vmi": f"vm-{i}",
                             "node": "n1", "phase": "Running", "ready": True,
                             "clique": self.cliques.get(i)}
                            for i, ip in sorted(self.members.items())],
                "problems": []}

    def publish(self, members: dict[int, str], cliques: dict[int, str] | None = None) -> None:
        with self.cond:
            self.members = dict(members)
            self.cliques = dict(cliques or {})
            self.generation += 1
            self.cond.notify_all()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture
def registry() -> Iterator[FakeRegistry]:
    reg = FakeRegistry()
    reg.thread.start()
    try:
        yield reg
    finally:
        reg.server.shutdown()
        reg.server.server_close()


def _config(tmp_path: Path, registry: FakeRegistry, extra: dict[str, Any]) -> Path:
    """An agent on the registry path only (DNS at a closed port), in process mode."""
    return write_config(tmp_path / "config.toml", {
        "ensemble": NAME, "namespace": NS, "max_members": 4,
        "registry_url": registry.url,
        "nameservers": [f"127.0.0.1:{_closed_port()}"],
        "hosts_file": str(tmp_path / "hosts"),
        "nodes_config": str(tmp_path / "imex" / "nodes_config.cfg"),
        "status_file": str(tmp_path / "status.json"),
        "imex_control": "process",
        "imex_command": [*FAKE_IMEX, "--log", str(tmp_path / "imex.log")],
        "imex_ctl": READY_CTL,
        "own_index": 0, "own_slot": "published",
        "poll_interval": 0.3, "dns_timeout": 0.3, **extra,
    })


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_registry_views_applied_and_status_reported(tmp_path: Path, registry: FakeRegistry
                                                    ) -> None:
    registry.publish({0: "10.77.1.10", 1: "10.77.1.11"})
    (tmp_path / "token").write_text("tok-123\n")
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    fabric = tmp_path / "fabric.json"
    fabric.write_text(json.dumps(FABRIC))
    cfg = _config(tmp_path, registry, {
        "token_file": str(tmp_path / "token"), "longpoll_timeout": 5,
        "signal_interval": 1.0,
        "report_interval": 0.5,
        "nvidia_smi": [SMI, "--fabric-file", str(fabric)],
        "imex_channel_device": str(tmp_path / "channel0"),
    })
    agent = AgentProc(cfg, tmp_path / "status.json", tmp_path / "agent.log")
    try:
        g0 = registry.generation
        st = agent.wait("registry view applied, IMEX up",
                        lambda s: s.get("generation_applied") == g0 and s.get("starts") == 1
                        and s.get("imex_state") == "READY")
        assert st["source"] == "registry"
        assert read_block((tmp_path / "hosts").read_bytes(), ENS)[1] == "10.77.1.11"  # type: ignore[index]

        def report(pred: Any) -> dict[str, Any] | None:
            with registry.cond:
                return next((r for r in reversed(registry.reports) if pred(r["body"])), None)

        r = wait_until("status report for the first generation",
                       lambda: report(lambda b: b["generation_applied"] == g0
                                      and b["imex_state"] == "READY"), 10, log=agent.log)
        assert r["path"] == f"/v1/ensembles/{NS}/{NAME}/members/0/status"
        assert r["auth"] == "Bearer tok-123"
        assert set(r["body"]) - {"imex_domain", "fabric", "imex_channel0", "imex_channels",
                                 "preflight"} == {
            "imex_state", "generation_applied", "nodes_config_sha256", "hosts_sha256",
            "signals", "restarts", "agent_version", "registry_ca_sha256", "sent"}
        assert r["body"]["hosts_sha256"] == st["hosts_sha256"]

        # Every report_interval: -N -j, the fabric and the channel, sent even if unchanged.
        full = wait_until("a report with the domain fields", lambda: report(
            lambda b: "imex_domain" in b and "fabric" in b), 10, log=agent.log)
        assert full["body"]["imex_domain"] == {"nodes": {}}
        assert full["body"]["fabric"] == FABRIC and full["body"]["imex_channel0"] is False
        # the preflight checks ride along from their first run (within seconds of start)
        wait_until("a report with the preflight checks", lambda: report(
            lambda b: "preflight" in b), 15, log=agent.log)
        with registry.cond:
            seen = len(registry.reports)
        wait_until("two more heartbeats", lambda: len(registry.reports) >= seen + 2, 5,
                   log=agent.log)
        with registry.cond:
            last, before = (dict(r["body"]) for r in registry.reports[-2:][::-1])
        # heartbeats repeat the report; only the stamp of when each was sent moves on
        assert last.pop("sent")["boottime_ns"] > before.pop("sent")["boottime_ns"]
        assert last == before
        st = agent.wait("status shows the clique",
                        lambda s: s.get("clique") == f"{FABRIC['cluster_uuid']}.7")
        assert st["fabric"] == FABRIC and st["domain_errors"] == 0

        # A peer moves: the long-poll wakes at once, the file follows, IMEX is signalled.
        registry.publish({0: "10.77.1.10", 1: "10.77.1.99"})
        g1 = registry.generation
        agent.wait("new generation applied", lambda s: s.get("generation_applied") == g1, 5)
        assert read_block((tmp_path / "hosts").read_bytes(), ENS)[1] == "10.77.1.99"  # type: ignore[index]
        wait_until("SIGUSR1", lambda: [e for e in read_events(tmp_path / "imex.log")
                                       if e["event"] == "usr1"], 5, log=agent.log)
        wait_until("report of the signal", lambda: report(
            lambda b: b["generation_applied"] == g1 and b["signals"] == 1), 10, log=agent.log)
    finally:
        assert agent.stop() == 0, agent.log()


def test_members_of_another_clique_are_pinned_away_with_a_signal_not_a_restart(
    tmp_path: Path, registry: FakeRegistry
) -> None:
    a, b = f"{FABRIC['cluster_uuid']}.1", f"{FABRIC['cluster_uuid']}.2"
    ips = {0: "10.77.1.10", 1: "10.77.1.11", 2: "10.77.1.12", 3: "10.77.1.13"}
    registry.publish(ips)
    (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
    cfg = write_config(tmp_path / "config.toml", {
        "ensemble": NAME, "namespace": NS, "max_members": 4,
        "registry_url": registry.url, "nameservers": [f"127.0.0.1:{_closed_port()}"],
        "hosts_file": str(tmp_path / "hosts"),
        "nodes_config": str(tmp_path / "imex" / "nodes_config.cfg"),
        "status_file": str(tmp_path / "status.json"),
        "imex_control": "process",
        "imex_command": [*FAKE_IMEX, "--log", str(tmp_path / "imex.log")],
        "imex_ctl": READY_CTL, "own_index": 0, "own_slot": "published",
        "poll_interval": 0.3, "dns_timeout": 0.3, "longpoll_timeout": 5,
        "signal_interval": 1.0, "nvidia_smi": [str(tmp_path / "none")],
    })
    agent = AgentProc(cfg, tmp_path / "status.json", tmp_path / "agent.log")
    try:
        agent.wait("IMEX up", lambda s: s.get("starts") == 1 and s.get("imex_state") == "READY")
        nodes = (tmp_path / "imex" / "nodes_config.cfg").read_bytes()
        assert read_block((tmp_path / "hosts").read_bytes(), ENS) == ips
        registry.publish(ips, {0: a, 1: a, 2: b, 3: b})  # 2 and 3 are on another rack
        g = registry.generation
        agent.wait("split applied", lambda s: s.get("generation_applied") == g, 5)
        assert read_block((tmp_path / "hosts").read_bytes(), ENS) == {
            0: ips[0], 1: ips[1], 2: "127.0.0.2", 3: "127.0.0.2"}
        assert (tmp_path / "imex" / "nodes_config.cfg").read_bytes() == nodes
        wait_until("SIGUSR1", lambda: [e for e in read_events(tmp_path / "imex.log")
                                       if e["event"] == "usr1"], 5, log=agent.log)
        st = agent.wait("status", lambda s: s.get("signals") == 1, 5)
        assert st["restarts"] == 0 and st["starts"] == 1
        assert [m["clique"] for m in st["members"]] == [a, a, b, b]
    finally:
        assert agent.stop() == 0, agent.log()


@pytest.mark.root
def test_a_write_refused_for_space_is_retried_once_space_returns(tmp_path: Path,
                                                                 registry: FakeRegistry) -> None:
    """ENOSPC before the first write (a full disk at boot). On the registry path the view
    that asked for the write is the last one until the membership moves (the long poll
    waits for a new generation), so the agent must try again by itself. The soak found
    it (seed 8, issue 30): a VM's nodes file stayed empty after the space came back."""
    registry.publish({0: "10.77.1.10", 1: "10.77.1.11"})
    imex_dir = tmp_path / "imex"
    imex_dir.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0755", "tmpfs",
                    str(imex_dir)], check=True)
    agent = None
    try:
        filler = imex_dir / "filler"
        with contextlib.suppress(OSError), open(filler, "wb") as f:
            while True:
                f.write(b"\0" * 4096)
        (tmp_path / "hosts").write_text("127.0.0.1 localhost\n")
        cfg = _config(tmp_path, registry, {"longpoll_timeout": 60})
        agent = AgentProc(cfg, tmp_path / "status.json", tmp_path / "agent.log")
        st = agent.wait("the write refused for space",
                        lambda s: "No space left" in (s.get("last_error") or ""))
        assert st.get("generation_applied") is None
        nodes = imex_dir / "nodes_config.cfg"
        assert not nodes.exists() or nodes.read_bytes() == b""  # nothing torn
        g0 = registry.generation
        filler.unlink()
        st = agent.wait("the files written once space returned, with no new view",
                        lambda s: s.get("generation_applied") == g0, timeout=40)
        assert registry.generation == g0
        assert nodes.read_text().splitlines() == [ENS.slot(i) for i in range(4)]
        assert read_block((tmp_path / "hosts").read_bytes(), ENS) is not None
        assert agent.stop() == 0
    finally:
        if agent is not None and agent.proc.poll() is None:
            agent.kill()
        subprocess.run(["umount", "-l", str(imex_dir)], check=False)
