"""What the VM harness reads from its members: files, IMEX's view, the registry, evidence.

TEST HARNESS. The observation half of :class:`tests.vm.harness.VmHarness` (a mixin): every
read goes through qemu-ga for QEMU guests (the channel KubeVirt uses), or the files of a
lean peer (tests/vm/peer.py); nothing here changes a guest. ``converged`` is the one
definition of "settled" every scenario waits for: each live member pins every slot (live
ones to their address, the rest to 127.0.0.2), its IMEX reports every other live member
CONNECTED, and the registry shows each live member READY at its address and no other.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from imex_shared.hostsfile import read_block
from tests.vm.image import BOOKWORM_AMD64, GuestOs
from tests.vm.machine import Machine
from tests.vm.qga import QgaError

if TYPE_CHECKING:
    from tests.sandbox.ensemble import EnsembleSpec
    from tests.vm.peer import Peer

log = logging.getLogger("vm.harness")
T = TypeVar("T")

STATUS_FILE = "/run/imex-guest-agent/status.json"
IMEX_STATE_FILE = "/run/nvidia-imex/state.json"


class VmFailure(AssertionError):
    """A guest did not do what the scenario needs; the message carries the evidence."""


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


def connected_nodes(dom: dict[str, Any] | None, own: int) -> set[int] | None:
    """Pure: the node ids (slots, in names mode) that node ``own``'s connections show
    CONNECTED in an ``nvidia-imex-ctl -N -j`` document. By id, not by ``host``: the real
    tool's ``host`` is an address or a name (FACTS.md), and the stand-in's followed."""
    if dom is None:
        return None
    node = (dom.get("nodes") or {}).get(str(own)) or {}
    return {int(k) for k, conn in (node.get("connections") or {}).items()
            if str(k).isdigit() and conn.get("status") == "CONNECTED"}


class Observation:
    """Reads of the members' state; mixed into the harness, which owns the attributes."""

    guests: dict[int, Guest]
    peers: dict[int, Peer]
    spec: EnsembleSpec
    settings: Any  # HarnessSettings
    workdir: Path
    _failed: bool

    @property
    def registry_url(self) -> str:
        raise NotImplementedError

    def _vmi_name(self, index: int) -> str:
        raise NotImplementedError

    def check_boot(self, g: Guest) -> None:
        raise NotImplementedError

    def serial_evidence(self, g: Guest) -> str:
        raise NotImplementedError

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

    def connected_peers(self, g: Guest) -> set[int] | None:
        """Nodes this guest's IMEX reports CONNECTED (None when it cannot be asked)."""
        return connected_nodes(self.imex_domain(g), g.index)

    def converged(self, live: list[int]) -> list[str]:
        """What is still missing for ``live`` members to be settled (empty when settled)."""
        want = self.expected_pins(live)
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
                     else connected_nodes(self.peers[i].domain(), i))
            want_peers = {j for j in live if j != i}
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
