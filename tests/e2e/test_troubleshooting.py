"""docs/troubleshooting.md's condition and Event texts, produced by a sandbox run.

Each ``text`` block of the doc marked ``<!-- observed: KEY -->`` shows what ``kubectl
describe imexens`` shows for one symptom: the conditions that name it and the Events the
host agent wrote. Here a sandbox (the API double, the real host agent, namespace VMs
with the real guest agents) is made to have each symptom, the ImexEnsemble's conditions
and Events are read from the API, rendered the same way and compared with the doc, the
variable parts aside (addresses, generations). ``IMEX_PRINT_OBSERVED=1`` prints them.
"""

from __future__ import annotations

import base64
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from lightkube.core.exceptions import ApiError
from lightkube.resources.core_v1 import Secret

from tests.e2e.domain_support import block_dials, unblock_dials
from tests.sandbox.demo_views import new_events
from tests.sandbox.ensemble import (
    AGENT_NAMESPACE,
    RACK_CLUSTER_UUID,
    STANDIN_IMEX,
    EnsembleSpec,
    Sandbox,
    SandboxSettings,
    Vm,
    wait_for,
)
from tests.sandbox.virt_controller import (
    VMI,
    ImexEnsemble,
    Pool,
    VirtController,
    running_status,
    vmi_manifest,
)

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(300)]

DOC = Path(__file__).resolve().parents[2] / "docs" / "troubleshooting.md"
STALE = 6.0
VMS = 3
_BLOCK = re.compile(r"<!-- observed: (?P<key>[a-z0-9-]+) -->\n```text\n(?P<text>.*?)```", re.S)


def documented() -> dict[str, str]:
    return {m["key"]: m["text"] for m in _BLOCK.finditer(DOC.read_text())}


def normalize(text: str) -> str:
    """The doc's text and the run's, their variable parts (addresses, generations,
    times) replaced by one word each."""
    text = re.sub(r"\b\d{1,3}(\.\d{1,3}){3}\b", "<ip>", text)
    text = re.sub(r"\b\d{10,}\b", "<generation>", text)
    return "\n".join(" ".join(line.split()) for line in text.strip().splitlines())


def render(status: dict[str, Any], ctypes: tuple[str, ...], events: list[dict[str, Any]],
           reasons: tuple[str, ...]) -> str:
    """Conditions ``ctypes`` and the first Event of each of ``reasons``, one line each."""
    conds = {c["type"]: c for c in status.get("conditions") or ()}
    lines = [f"Condition {t}={conds[t]['status']}  {conds[t]['reason']}: {conds[t]['message']}"
             for t in ctypes]
    for reason in reasons:
        e = next(e for e in events if e["reason"] == reason)
        lines.append(f"Event     {e['type']:<7}  {e['reason']}: {e['note']}")
    return "\n".join(lines) + "\n"


class Rig:
    def __init__(self, sbx: Sandbox, ctl: VirtController, spec: EnsembleSpec,
                 pool: Pool) -> None:
        self.sbx, self.ctl, self.spec, self.pool = sbx, ctl, spec, pool
        self.seen: set[str] = set()
        self.observed: dict[str, str] = {}
        #: the ensemble a symptom shows on (another one for the CA's)
        self.target = spec

    def status(self) -> dict[str, Any]:
        return self.ctl.get_ensemble(self.target).get("status") or {}

    def healthy(self, timeout: float = 60.0) -> None:
        """Every guest converged, and the CR says so at the registry's generation."""
        self.target = self.spec
        with self.sbx.diagnostics_on_failure():
            self.sbx.wait_converged(self.spec, timeout)
            gen = self.sbx.registry_json(self.spec)["generation"]

            def ok() -> bool:
                st = self.status()
                conds = {c["type"]: c["status"] for c in st.get("conditions") or ()}
                return (st.get("membershipGeneration") == gen and st.get("imexReady") == VMS
                        and conds.get("Ready") == "True" and st.get("domainStatus") == "UP")
            wait_for("the ensemble Ready and its domain UP", ok, timeout, 0.3)
        new_events(self.ctl.events(self.spec), self.seen)  # what came before: not this one

    def observe(self, key: str, want: dict[str, str | tuple[str, str]], reasons: tuple[str, ...],
                timeout: float = 45.0) -> None:
        """Wait until each condition of ``want`` has its reason and each Event of
        ``reasons`` was written; keep their rendering as ``key``."""
        fresh: list[dict[str, Any]] = []

        def probe() -> dict[str, Any] | None:
            fresh.extend(new_events(self.ctl.events(self.target), self.seen))
            st = self.status()
            conds = {c["type"]: c for c in st.get("conditions") or ()}
            have = {e["reason"] for e in fresh}
            done = set(reasons) <= have and all(
                (w if isinstance(w, str) else w[0]) == conds.get(t, {}).get("reason") and
                (isinstance(w, str) or _matches(w[1], conds[t]["message"]))
                for t, w in want.items())
            return st if done else None

        st = wait_for(f"{key}: conditions {want}, Events {reasons}", probe, timeout, 0.3,
                      lambda: f"conditions {self.status().get('conditions')}, Events "
                      f"{[(e['reason'], e['note']) for e in fresh]}")
        self.observed[key] = render(st, tuple(want), fresh, reasons)


@pytest.fixture(scope="module")
def rig() -> Iterator[Rig]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the e2e sandbox builds network namespaces and a bridge")
    sbx = Sandbox(SandboxSettings(prefix="tsh", report_stale_after=STALE, report_interval=2.0))
    try:
        sbx.start()
        ctl = VirtController(sbx)
        try:
            spec = ctl.create_ensemble("gpu-jobs", "gb200", max_members=VMS + 1, form="cr")
            wait_for("the ImexEnsemble's Service", lambda: sbx.registry_json(spec), 30, 0.1)
            pool = ctl.pool(spec)
            pool.scale(VMS)
            yield Rig(sbx, ctl, spec, pool)
        finally:
            ctl.close()
    finally:
        sbx.close()


def _scenarios(r: Rig) -> list[tuple[str, Callable[[], None], Callable[[], None]]]:
    vms = {vm.index: vm for vm in r.sbx.vms_of(r.spec)}

    def no_address() -> None:
        """A VMI Running whose interface has no address yet (DHCP, the QEMU guest agent)."""
        name = r.pool.vmi_name(VMS)
        r.ctl.client.create(VMI.from_dict(vmi_manifest(r.spec, name, r.pool.name)))
        status = running_status("10.0.0.1", "gb200-tray-09", "02:00:00:00:00:09")
        status["interfaces"] = [{"name": "default", "mac": "02:00:00:00:00:09",
                                 "infoSource": "domain", "podInterfaceName": "eth0"}]
        r.ctl.set_status(r.spec, name, status)

    def no_address_undo() -> None:
        r.ctl.client.delete(VMI, r.pool.vmi_name(VMS), namespace=r.spec.namespace)

    def restore() -> None:
        r.pool.restore(1)

    def other_clique(moved: bool) -> Callable[[], None]:
        """The pool replaces VM 2 on a rack of another NVLink clique (or back)."""
        def do() -> None:
            where = (r.spec.namespace, r.pool.vmi_name(2))
            if moved:
                r.sbx.fabrics[where] = {"cluster_uuid": RACK_CLUSTER_UUID, "clique_id": 2}
            else:
                r.sbx.fabrics.pop(where, None)
            r.pool.crash(2)
            r.pool.restore(2)
        return do

    def imex_stuck(stuck: bool) -> Callable[[], None]:
        """VM 2 boots again with an IMEX that never leaves WAITING_FOR_PEERS (the
        stand-in's --stuck-state) and a ready_grace of 2 s, so its agent restarts IMEX
        every 2 s; or boots again as the others."""
        def do() -> None:
            vm = vms[2]
            where = (r.spec.namespace, vm.vmi)
            if stuck:
                r.sbx.guest_config[where] = {
                    "ready_grace": 2.0,
                    "imex_command": [STANDIN_IMEX, "-c", str(vm.imex_cfg), "--state-file",
                                     str(vm.imex_state_file), "--stuck-state",
                                     "WAITING_FOR_PEERS"]}
            else:
                r.sbx.guest_config.pop(where, None)
            r.pool.crash(2)
            r.pool.restore(2)
        return do

    ca_secret = "imex-ca-gpu-jobs.gb300"

    def ca_edited() -> None:
        """A second ensemble with authEncryption; once the agent made its CA Secret, a
        hand edits the certificate in it."""
        r.target = r.ctl.create_ensemble("gpu-jobs", "gb300", max_members=2,
                                         auth_encryption=True, form="cr")
        secret = wait_for("the CA Secret", lambda: _get_secret(r, ca_secret), 30, 0.2)
        assert secret.data is not None
        secret.data["ca.crt"] = base64.b64encode(b"edited by hand").decode()
        r.ctl.client.replace(secret)

    def ca_removed() -> None:
        r.target = r.spec
        r.ctl.client.delete(ImexEnsemble, "gb300", namespace="gpu-jobs")
        r.ctl.client.delete(Secret, ca_secret, namespace=AGENT_NAMESPACE)

    agent = vms[0].agent
    assert agent is not None
    return [
        ("member-not-running", lambda: r.pool.crash(1), restore),
        ("no-address", no_address, no_address_undo),
        ("guest-silent", lambda: os.kill(agent.pid, signal.SIGSTOP),
         lambda: os.kill(agent.pid, signal.SIGCONT)),
        ("links-missing", lambda: block_dials(vms[0], vms[1], r.spec.port),
         lambda: unblock_dials(vms[0])),
        ("clique-split", other_clique(True), other_clique(False)),
        ("registry-unreachable", lambda: r.sbx.block_registry(True),
         lambda: r.sbx.block_registry(False)),
        ("imex-restart-loop", imex_stuck(True), imex_stuck(False)),
        ("ca-secret-invalid", ca_edited, ca_removed),
    ]


#: each symptom: {condition: its reason, or (reason, a piece of its message, or "=" and
#: the whole message)}, Events
WANT: dict[str, tuple[dict[str, str | tuple[str, str]], tuple[str, ...]]] = {
    "member-not-running": ({"Ready": "MemberNotRunning"}, ("MemberLeft", "ReadyLost")),
    "no-address": ({"Ready": "NoAddress"}, ("NoAddress", "ReadyLost")),
    "guest-silent": ({"Ready": "GuestSilent"}, ("ReadyLost",)),
    "links-missing": ({"DomainUp": "LinksMissing"}, ()),
    "clique-split": ({"Degraded": ("Problem", "NVLink cliques")}, ()),
    "registry-unreachable": ({"Ready": ("GuestSilent", "slots 0, 1, 2")}, ()),
    # the whole message: a part matched while slots 0 and 1 had not yet applied a new
    # generation, and the doc's block (slot 2 alone) differed (CI, 2026-12-03)
    "imex-restart-loop": ({"Ready": ("GuestNotReady", "=slot 2: IMEX WAITING_FOR_PEERS")},
                          ()),
    "ca-secret-invalid": ({"Degraded": "CASecretInvalid"}, ()),
}


def _matches(want: str, message: str) -> bool:
    """``want`` is a part of the message, or with a leading ``=`` the whole of it."""
    return message == want[1:] if want.startswith("=") else want in message


def _get_secret(r: Rig, name: str) -> Secret | None:
    try:
        return r.ctl.client.get(Secret, name, namespace=AGENT_NAMESPACE)
    except ApiError as exc:
        if exc.status.code == 404:
            return None
        raise


def restarted_twice(vm: Vm) -> Callable[[], bool]:
    return lambda: int(vm.status().get("restarts", 0)) >= 2


def test_the_doc_shows_what_the_agent_writes(rig: Rig) -> None:
    for key, do, undo in _scenarios(rig):
        rig.healthy()
        t0 = time.monotonic()
        do()
        try:
            rig.observe(key, *WANT[key], timeout=90 if key == "ca-secret-invalid" else 45)
            if key == "imex-restart-loop":  # a loop, not one slow start
                wait_for("IMEX restarted twice",
                         restarted_twice(rig.sbx.vm(rig.spec, rig.pool.vmi_name(2))), 30, 0.3)
        finally:
            undo()
        print(f"{key}: observed in {time.monotonic() - t0:.1f} s")
    rig.healthy()
    if os.environ.get("IMEX_PRINT_OBSERVED"):
        for key, text in rig.observed.items():
            print(f"\n<!-- observed: {key} -->\n```text\n{text}```")
    doc = documented()
    assert set(doc) == set(rig.observed) == set(WANT), (set(doc), set(rig.observed))
    for key, text in rig.observed.items():
        assert normalize(doc[key]) == normalize(text), f"{DOC.name} {key}:\n{text}"
