"""Six VMs with authEncryption on: the domain forms over mutual TLS, intruders on a member's
address are refused both ways, every member renews while membership changes, and the CA
rotates with the domain UP and no IMEX restart.

Real parts: the API double (the CA Secret lives there), the host agent process (CA,
certificate endpoint), the guest agents in network-namespace VMs (key, CSR, pin check,
renewal, SIGUSR1) and the IMEX stand-in with mutual TLS (tests/sandbox/imex_standin.py).
The tests share one sandbox and run in file order; each leaves the ensemble converged.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from lightkube.types import PatchType

from guest_agent.tls.imex_config import imex_tls_settings, merge_imex_config
from host_agent.ca import authority as ca_mod
from host_agent.ca import secret as ca_secret
from tests.e2e.conftest import running, signals_quiet
from tests.sandbox.ensemble import (
    AGENT_NAMESPACE,
    EnsembleSpec,
    Sandbox,
    SandboxSettings,
    Vm,
    wait_for,
)
from tests.sandbox.imex_standin import StandinProcess, write_standin_files
from tests.sandbox.netns import ip
from tests.sandbox.virt_controller import Pool, Service, VirtController

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(300)]
VMS = 6


@dataclass
class TlsRack:
    sbx: Sandbox
    ctl: VirtController
    spec: EnsembleSpec
    pool: Pool

    def vms(self) -> list[Vm]:
        return self.sbx.vms_of(self.spec)

    def settle(self, timeout: float = 120.0) -> float:
        with self.sbx.diagnostics_on_failure():
            return self.sbx.wait_converged(self.spec, timeout)

    def secret(self) -> dict[str, Any]:
        assert self.sbx.api is not None
        return self.sbx.api.get("v1", "Secret", ca_secret.secret_name(self.spec.id),
                                AGENT_NAMESPACE)

    def ca(self) -> ca_mod.CaState:
        return ca_secret.parse_secret(self.secret(), dt.datetime.now(dt.UTC))

    def annotate(self, key: str, value: str) -> None:
        self.ctl.client.patch(Service, self.spec.name,
                              {"metadata": {"annotations": {key: value}}},
                              namespace=self.spec.namespace, patch_type=PatchType.MERGE)


@pytest.fixture(scope="module")
def rack() -> Iterator[TlsRack]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the e2e sandbox builds network namespaces and a bridge")
    sbx = Sandbox(SandboxSettings(prefix="e2tls", ca_overlap=40.0))
    with running(sbx) as ctl:
        spec = ctl.create_ensemble("rack-t", "gb300", max_members=VMS, auth_encryption=True)
        pool = ctl.pool(spec)
        pool.scale(VMS)
        yield TlsRack(sbx, ctl, spec, pool)


def imex_log(vm: Vm) -> str:
    path = vm.dir / "imex" / "imex.log"
    return path.read_text(errors="replace") if path.exists() else ""


def leaf_of(vm: Vm) -> x509.Certificate:
    return x509.load_pem_x509_certificate((vm.dir / "tls" / "imex.crt").read_bytes())


def counters(vms: list[Vm]) -> dict[str, tuple[int, int, int]]:
    """vmi -> (SIGUSR1 received, IMEX starts, agent restarts of IMEX)."""
    out = {}
    for vm in vms:
        st = vm.imex_state()
        out[vm.vmi] = (int(st.get("signals_received", 0)), int(st.get("starts", 0)),
                       int(vm.status().get("restarts", 0)))
    return out


def domain_up_everywhere(rack: TlsRack) -> bool:
    return all(vm.domain().get("status") == "UP" for vm in rack.vms())


def test_the_domain_forms_over_mutual_tls(rack: TlsRack) -> None:
    rack.settle(180)
    ca = rack.ca()
    doc = rack.sbx.registry_json(rack.spec, strict=True)
    assert doc["tls"]["ca_sha256"] == ca.sha256
    svc = rack.sbx.api.get("v1", "Service", rack.spec.name, rack.spec.namespace)  # type: ignore[union-attr]
    assert svc["metadata"]["annotations"]["imex-ensemble.io/ca-sha256"] == ca.sha256
    for vm in rack.vms():
        assert doc["tls"]["ca_bundle_sha256"] == ca.bundle_sha256()
        leaf = leaf_of(vm)
        slot = rack.spec.id.slot(vm.index)
        assert leaf.subject.rfc4514_string() == f"CN={slot}"
        assert ca_mod.verify_signed_by(leaf, ca.current.cert)
        assert oct(os.stat(vm.dir / "tls" / "imex.key").st_mode & 0o777) == "0o600"
        cfg = vm.imex_cfg.read_text()
        for key, value in imex_tls_settings(str(vm.dir / "tls")):
            assert f"{key}={value}\n" in cfg  # the agent put the TLS keys into IMEX's config
        st = vm.imex_state()
        assert st["tls"] is True and st["starts"] == 1
        dom = vm.domain()
        own = dom["nodes"][str(vm.index)]["connections"]
        assert {i for i, c in own.items() if c["status"] == "CONNECTED"} == {
            str(o.index) for o in rack.vms() if o is not vm}
        assert vm.status()["tls"]["renewals"] >= 1


def _issue(ca: ca_mod.CaState, slot: str, d: Path) -> None:
    key = ec.generate_private_key(ec.SECP256R1())
    (d / "imex.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, slot)])).add_extension(
        x509.SubjectAlternativeName([x509.DNSName(slot)]), critical=False).sign(
        key, hashes.SHA256())
    leaf = ca_mod.issue_leaf(ca.current, csr, slot, dt.datetime.now(dt.UTC))
    (d / "imex.crt").write_text(ca_mod.cert_pem(leaf))
    (d / "ca.crt").write_text(ca_mod.cert_pem(ca.current.cert))


def test_an_intruder_on_a_deleted_members_address_is_refused_both_ways(rack: TlsRack) -> None:
    rack.settle()
    sbx, spec = rack.sbx, rack.spec
    assert sbx.fabric is not None
    victim = max(vm.index for vm in rack.vms())
    old_ip = sbx.vm(spec, rack.pool.vmi_name(victim)).ip
    members = [vm for vm in rack.vms() if vm.index != victim]
    entries = [spec.id.slot(i) for i in range(spec.max_members)]
    pins = {spec.id.slot(vm.index): vm.ip for vm in rack.vms()}
    # another tenant's ensemble, with its own CA, in its own namespace
    other = rack.ctl.create_ensemble("tenant-x", "other", max_members=8, auth_encryption=True)
    other_ca_sha = sbx.ca_sha256(other)
    assert other_ca_sha != rack.ca().sha256
    other_ca = ca_secret.parse_secret(
        sbx.api.get("v1", "Secret", ca_secret.secret_name(other.id), AGENT_NAMESPACE),  # type: ignore[union-attr]
        dt.datetime.now(dt.UTC))
    # peers keep pinning the old address: their registry and DNS are cut off first
    sbx.block_registry()
    sbx.block_dns()
    node = None
    try:
        rack.pool.delete(victim)
        intruder_ns = sbx.fabric.add_node(ip_addr=old_ip, hostname="intruder")
        node = intruder_ns
        intruder_ns.write_hosts(sbx.fabric.hosts_lines(pins))
        for vm in members:  # the address moved to another MAC
            ip("neigh", "flush", "all", netns=vm.node.name, check=False)
        cases: dict[str, ca_mod.CaState | None] = {
            "a valid certificate from the same CA for another slot": rack.ca(),
            "a valid certificate from another ensemble's CA": other_ca,
            "no certificate at all": None,
        }
        for n, (what, ca) in enumerate(cases.items()):
            d = sbx.workdir / f"intruder-{n}"  # type: ignore[operator]
            cfg = write_standin_files(d, entries)
            if ca is not None:
                (d / "tls").mkdir()
                # same CA: slot 0's name; the other CA: the victim's own slot name
                _issue(ca, spec.id.slot(0 if ca is not other_ca else victim), d / "tls")
                cfg.write_text(merge_imex_config(cfg.read_text(),
                                                 imex_tls_settings(str(d / "tls"))))
            imex = StandinProcess.start(cfg, node=intruder_ns)
            try:
                wait_for(f"{what}: intruder READY",
                         lambda imex=imex: imex.state().get("state") == "READY", 20, 0.2)
                for vm in members:
                    wait_for(f"{what}: {vm.vmi} refuses it", lambda vm=vm: (
                        p := vm.imex_state()["peers"][str(victim)])["status"] ==
                        "AUTHENTICATING" and p["ip"] == old_ip, 30, 0.2)
                time.sleep(3)  # a few more tries both ways
                for vm in members:
                    peer = vm.imex_state()["peers"][str(victim)]
                    assert peer["status"] != "CONNECTED" and "authentication" in \
                        peer["last_error"], (what, vm.vmi, peer)
                    own = vm.domain()["nodes"][str(vm.index)]["connections"][str(victim)]
                    assert own["status"] == "AUTHENTICATING", (what, own)  # A in -N's legend
                st = imex.state()
                assert not [i for i, p in st["peers"].items() if p["status"] == "CONNECTED"], \
                    (what, st["peers"])
                assert all(p["connects"] == 0 or p["status"] != "CONNECTED"
                           for p in st["peers"].values())
                for vm in members:
                    assert not [i for i, p in vm.imex_state()["peers"].items()
                                if p["status"] == "CONNECTED" and int(i) == victim]
            finally:
                imex.stop()
        # the members kept each other all along
        for vm in members:
            assert {int(i) for i, p in vm.imex_state()["peers"].items()
                    if p["status"] == "CONNECTED"} == {o.index for o in members} - {vm.index}
    finally:
        if node is not None:
            node.kill_processes()
            node.set_link(False)
        sbx.block_dns(False)
        sbx.block_registry(False)
    rack.pool.create(victim)
    rack.settle()


#: How long a link may stay down before it is an outage rather than a reconnect. After a
#: drop (an acted SIGUSR1, or a ping lost while a loaded machine starves the stand-in's
#: loop) the stand-in redials 0.5, 1.5, 3.5, 6.5 and 9.5 s later (500 ms doubling to 3 s),
#: so 10 s allows five tries. The earlier bound, 3 s after the member's own acted
#: SIGUSR1, failed once in a full CI run of 2026-12-03 (every link of one member down
#: outside it) and not in 5 runs beside stress-ng; with this one the module passed quiet
#: and beside stress-ng (2026-12-03).
OUTAGE_S = 10.0


def _down_links(vm: Vm) -> dict[str, str]:
    """This member's own links that are not CONNECTED, with their status."""
    dom = vm.domain()
    own = dom.get("nodes", {}).get(str(vm.index), {}).get("connections", {})
    return {i: str(c.get("status")) for i, c in own.items() if c.get("status") != "CONNECTED"}


def _watch_up(rack: TlsRack, until: Any, what: str, timeout: float) -> int:
    """Sample every member's links until ``until()``: a link may be down for a reconnect
    (shown as A while its TLS handshake is redone), never longer than ``OUTAGE_S`` in a
    row. A handshake the rotation really broke is the test's "authentication failed"
    check on every IMEX log."""
    deadline = time.monotonic() + timeout
    samples = 0
    since: dict[tuple[str, str], float] = {}
    while True:  # look at least once per step, however fast it goes
        now = time.monotonic()
        seen: set[tuple[str, str]] = set()
        for vm in rack.vms():
            for peer, status in _down_links(vm).items():
                key = (vm.vmi, peer)
                seen.add(key)
                first = since.setdefault(key, now)
                assert now - first <= OUTAGE_S, (
                    f"{what}: {vm.vmi}'s link to {peer} down ({status}) for "
                    f"{now - first:.1f} s, longer than a reconnect")
        since = {k: t for k, t in since.items() if k in seen}
        samples += 1
        if until():
            if not since:
                return samples
            # the step is reached: the links still down must come back within the bound
            assert time.monotonic() < deadline + OUTAGE_S, f"{what}: links down {since}"
        else:
            assert time.monotonic() < deadline, f"{what}: not reached within {timeout:g} s"
        time.sleep(0.3)


def _trusts(vm: Vm) -> set[str]:
    return {ca_mod.fingerprint(c) for c in x509.load_pem_x509_certificates(
        (vm.dir / "tls" / "ca.crt").read_bytes())}


def test_ca_rotation_keeps_the_domain_up_with_one_sigusr1_per_step(rack: TlsRack) -> None:
    rack.settle()
    wait_for("the domain UP everywhere", lambda: domain_up_everywhere(rack), 30, 0.5)
    # quiet first: no signal still on its way from the last membership change
    quiet = rack.sbx.settings.signal_interval + 2

    def still() -> bool:
        a = counters(rack.vms())
        time.sleep(quiet)
        return counters(rack.vms()) == a

    wait_for("no SIGUSR1 for a whole window", still, 60, 0.1)
    old = rack.ca()
    before = counters(rack.vms())
    starts = {vm.vmi: vm.status()["starts"] for vm in rack.vms()}
    logs = {vm.vmi: len(imex_log(vm)) for vm in rack.vms()}
    rack.annotate("imex-ensemble.io/ca-rotation", "2026-12-01 evict nothing")
    new = wait_for("the rotation", lambda: (s := rack.ca()).current.sha256 != old.sha256
                   and s, 30, 0.2)
    assert new.step == "trust" and new.previous == old.current.cert
    vms = rack.vms()
    samples = 0
    # step 1, trust: every guest trusts both CAs; certificates still come from the old one
    samples += _watch_up(rack, lambda: all(_trusts(vm) == {old.sha256, new.current.sha256}
                                           for vm in vms), "trust", 90)
    for vm in vms:
        assert (vm.dir / "tls" / "pinned-ca.sha256").read_text().strip() == new.current.sha256
    # step 2, switch: the new CA signs; every member moves to a new-CA certificate
    samples += _watch_up(rack, lambda: all(
        leaf_of(vm).issuer == new.current.cert.subject for vm in vms), "switch", 90)
    # step 3, done: the old CA leaves every bundle
    samples += _watch_up(rack, lambda: all(_trusts(vm) == {new.current.sha256} for vm in vms),
                         "done", 90)
    wait_for("a held signal gone out: no SIGUSR1 for a whole window", still, 120, 0.1)
    samples += _watch_up(rack, lambda: True, "after", 1)
    assert samples >= 4  # the links were looked at in every step
    after = counters(vms)
    for vmi, (sig, st, rs) in after.items():
        assert sig - before[vmi][0] <= 3, (vmi, "SIGUSR1s for three steps", sig - before[vmi][0])
        assert sig - before[vmi][0] >= 2, (vmi, "credentials were never reloaded")
        assert (st, rs) == before[vmi][1:], (vmi, "IMEX restarted")
    assert {vm.vmi: vm.status()["starts"] for vm in vms} == starts
    for vm in vms:
        assert "authentication failed" not in imex_log(vm)[logs[vm.vmi]:], vm.vmi
    assert rack.sbx.registry_json(rack.spec, strict=True)["tls"]["ca_sha256"] == \
        new.current.sha256
    rack.settle()


def test_every_member_renews_while_membership_changes(rack: TlsRack) -> None:
    """Short certificates (75 s, renewed at 50 s) while a member migrates."""
    sbx = rack.sbx
    sbx.stop_host_agent()
    sbx.settings = dataclasses.replace(sbx.settings, cert_lifetime=75.0)
    sbx.start_host_agent()
    # a rotation gives everyone a 75 s certificate now
    rack.annotate("imex-ensemble.io/ca-rotation", "short-lived")
    wait_for("the rotation to finish", lambda: rack.ca().step == "steady" and
             rack.ca().rotation == "short-lived", 90, 0.5)
    current = rack.ca()
    wait_for("short certificates from the new CA everywhere", lambda: all(
        leaf_of(vm).issuer == current.current.cert.subject and _trusts(vm) == {current.sha256}
        and (leaf_of(vm).not_valid_after_utc - dt.datetime.now(dt.UTC)).total_seconds() < 80
        for vm in rack.vms()), 60, 0.5)
    rack.settle()
    serials = {vm.vmi: leaf_of(vm).serial_number for vm in rack.vms()}
    first_after = {vm.vmi: leaf_of(vm).not_valid_after_utc for vm in rack.vms()}
    logs = {vm.vmi: len(imex_log(vm)) for vm in rack.vms()}
    before = counters(rack.vms())
    states = {vm.vmi: vm.imex_state() for vm in rack.vms()}
    # the renewals come due about 50 s after issue; a migration is in flight around then
    time.sleep(40)
    moving = rack.vms()[1]
    rack.pool.migrate(moving.index)
    wait_for("every member renewed", lambda: all(
        leaf_of(vm).serial_number != serials[vm.vmi] for vm in rack.vms()), 60, 0.5)
    rack.settle()
    signals_quiet(rack.vms, rack.sbx.settings.signal_interval + 1)  # held ones gone out
    after = counters(rack.vms())
    for vm in rack.vms():
        assert leaf_of(vm).not_valid_after_utc > first_after[vm.vmi]
        new_log = imex_log(vm)[logs[vm.vmi]:]
        assert "authentication failed" not in new_log, (vm.vmi, new_log[-2000:])
        if vm is moving:
            continue
        assert after[vm.vmi][1:] == before[vm.vmi][1:], (vm.vmi, "IMEX restarted")
        # no link drops beyond the SIGUSR1 reconnect: each acted SIGUSR1 redials every
        # link once, and nothing else does (links to the migrating member aside)
        st, was = vm.imex_state(), states[vm.vmi]
        acted = st["signals_acted"] - was["signals_acted"]
        assert acted >= 1, (vm.vmi, "no SIGUSR1 after the renewal")
        for i, p in st["peers"].items():
            if int(i) != moving.index:
                assert p["connects"] - was["peers"][i]["connects"] <= acted, (vm.vmi, i, p)
