"""The registry over HTTPS in the sandbox, beside plain HTTP, with guests of two releases.

One sandbox, the host agent with ``--tls-self-issued`` (a short-lived serving
certificate, so it is renewed during the module) and plain HTTP still on:

* 0.1.0 guests (commit 8503169's wheel, tests/sandbox/releases.py) keep working over
  plain HTTP: they converge, report and ride out a crash and a rejoin (the skew matrix's
  "old guests, this host agent");
* a boot storm of this release's guests with authEncryption, over HTTPS pinned to the
  registry CA, while a raw-socket capture on the bridge records every frame: their token
  and their CSRs never cross it in clear (the 0.1.0 guests' token does: the capture
  works);
* every pinned guest sees the renewed serving certificate without a restart;
* a guest pinned to another CA refuses the registry's certificate, says why, and
  converges through DNS.
"""

from __future__ import annotations

import base64
import hashlib
import os
import ssl
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest

from tests.e2e.conftest import running
from tests.e2e.skew_support import SkewRack, reports_in
from tests.sandbox.capture import BridgeCapture, streams
from tests.sandbox.ensemble import AGENT_NAMESPACE, EnsembleSpec, Sandbox, SandboxSettings, wait_for
from tests.sandbox.releases import PREVIOUS_VERSION, Release, previous_release
from tests.sandbox.virt_controller import VirtController

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(300)]
#: the serving certificate's lifetime here (renewed at two thirds: every 30 s)
SERVING_LIFETIME = 45.0
OLD_VMS = 3
SEALED_VMS = 4


@dataclass
class TlsSandbox:
    sbx: Sandbox
    ctl: VirtController
    release: Release
    old: SkewRack
    #: the serving certificate's fingerprint when the sandbox came up
    first_cert: str
    notes: dict[str, object] = field(default_factory=dict)


def serving_cert_sha256(sbx: Sandbox) -> str | None:
    assert sbx.api is not None
    try:
        obj = sbx.api.get("v1", "Secret", "imex-registry-tls", AGENT_NAMESPACE)
    except Exception:
        return None
    pem = base64.b64decode(obj["data"]["tls.crt"]).decode()
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


@pytest.fixture(scope="module")
def tls() -> Iterator[TlsSandbox]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the e2e sandbox builds network namespaces and a bridge")
    release = previous_release()
    tuning = {**SandboxSettings().host_tuning, "registry_cert_lifetime": SERVING_LIFETIME,
              "tls_recheck": 1.0}
    sbx = Sandbox(SandboxSettings(prefix="tlsreg", registry_tls=True, host_tuning=tuning))
    with running(sbx) as ctl:
        first = wait_for("the registry's serving certificate", lambda: serving_cert_sha256(sbx),
                         30)
        spec = ctl.create_ensemble("rack-o", "gb200", max_members=4)
        pool = ctl.pool(spec)
        for i in range(OLD_VMS + 1):  # the rejoin's VM too
            sbx.guest_releases[(spec.namespace, pool.vmi_name(i))] = release
        pool.scale(OLD_VMS)
        yield TlsSandbox(sbx, ctl, release, SkewRack(sbx, ctl, spec, pool), first)


def test_0_1_guests_keep_working_over_http_beside_https(tls: TlsSandbox) -> None:
    rack = tls.old
    rack.settle()
    got = reports_in(rack, PREVIOUS_VERSION)
    assert {g["transport"] for g in got.values()} == {"http"}
    assert all(g["registry_ca_sha256"] is None for g in got.values())
    rack.pool.crash(0)
    rack.settle()
    before = time.time()
    rack.pool.restore(0)
    rack.settle()
    got = reports_in(rack, PREVIOUS_VERSION, since=before)
    assert got[0]["from_ip"] == rack.sbx.vm(rack.spec, rack.pool.vmi_name(0)).ip


def test_a_boot_storm_over_https_puts_no_token_and_no_csr_on_the_bridge(
        tls: TlsSandbox) -> None:
    sbx = tls.sbx
    assert sbx.fabric is not None
    spec = tls.ctl.create_ensemble("rack-s", "gb300", max_members=SEALED_VMS,
                                   auth_encryption=True, form="cr")
    pool = tls.ctl.pool(spec)
    pin = sbx.registry_ca_sha256()
    out = sbx.workdir / "bridge.cap"
    t0 = time.monotonic()
    with BridgeCapture(sbx.fabric.fabric_ns, out):
        pool.scale(SEALED_VMS)
        with sbx.diagnostics_on_failure():
            sbx.wait_converged(spec, 180)  # every member's certificate came over HTTPS
        # the 0.1.0 guests' heartbeat (every report_interval) is in the capture too
        time.sleep(max(0.0, sbx.settings.report_interval + 1 - (time.monotonic() - t0)))
    tls.notes["sealed"] = spec
    flows = streams(out)
    to_tls = [b for (_, _, _, dport), b in flows.items() if dport == sbx.registry_tls_port]
    to_http = [b for (_, _, _, dport), b in flows.items() if dport == sbx.registry_port]
    everything = b"".join(flows.values())
    tls.notes["capture"] = (len(flows), len(to_tls), len(everything))
    print(f"\ncapture on the bridge: {len(flows)} TCP streams, {len(to_tls)} to the HTTPS "
          f"port, {len(to_http)} to plain HTTP, {len(everything)} payload bytes; sealed "
          f"token found: {spec.token.encode() in everything}; CSR found: "
          f"{b'CERTIFICATE REQUEST' in everything}; 0.1.0 token found over HTTP: "
          f"{any(tls.old.spec.token.encode() in b for b in to_http)}")
    assert len(to_tls) >= 3 * SEALED_VMS  # CA fetch, long-polls, reports, CSRs: all TLS
    assert all(b[:1] == b"\x16" for b in to_tls)  # each stream opens with a TLS handshake
    assert spec.token.encode() not in everything
    assert b"CERTIFICATE REQUEST" not in everything and b'"csr"' not in everything
    # the capture sees clear text where there is some: the 0.1.0 guests' bearer token
    assert any(tls.old.spec.token.encode() in b for b in to_http)
    # every sealed guest reports over HTTPS, pinned; the status shows what they pin
    status = tls.ctl.get_ensemble(spec).get("status") or {}
    assert status.get("registryCASHA256") == pin

    def pinned_reports() -> bool:
        members = sbx.registry_json(spec).get("members", [])
        return len(members) == SEALED_VMS and all(
            (m.get("guest") or {}).get("transport") == "https"
            and (m.get("guest") or {}).get("registry_ca_sha256") == pin for m in members)

    wait_for("every sealed guest's report over HTTPS", pinned_reports, 60, 0.5)


def test_rotation_is_seen_by_every_guest_without_a_restart(tls: TlsSandbox) -> None:
    sbx = tls.sbx
    spec = tls.notes["sealed"]
    assert isinstance(spec, EnsembleSpec)
    vms = sbx.vms_of(spec)
    pids = {vm.vmi: vm.agent.pid for vm in vms if vm.agent is not None}
    boots = {vm.vmi: vm.boots for vm in vms}
    renewed = wait_for("a renewal of the serving certificate",
                       lambda: (c := serving_cert_sha256(sbx)) != tls.first_cert and c,
                       SERVING_LIFETIME + 15, 0.5)

    def everyone_sees_it() -> bool:
        current = serving_cert_sha256(sbx)
        return all(((vm.status().get("registry") or {}).get("server_cert") or {}).get(
            "sha256") == current for vm in vms)

    wait_for("every guest on the renewed certificate", everyone_sees_it,
             sbx.settings.report_interval * 3, 0.5)
    assert renewed != tls.first_cert
    assert {vm.vmi: vm.agent.pid for vm in vms if vm.agent is not None} == pids
    assert {vm.vmi: vm.boots for vm in vms} == boots
    for vm in vms:  # the registry never went away for them: no fallback to DNS
        assert "DNS takes over" not in vm.log_tail(400_000)
    sbx.wait_converged(spec, 60)


def test_a_guest_pinned_to_another_ca_refuses_it_and_converges_through_dns(
        tls: TlsSandbox) -> None:
    sbx = tls.sbx
    spec = tls.ctl.create_ensemble("rack-d", "gb100", max_members=3)
    pool = tls.ctl.pool(spec)
    wrong = hashlib.sha256(b"another CA entirely").hexdigest()
    sbx.guest_config[(spec.namespace, pool.vmi_name(1))] = {"registry_ca_sha256": wrong}
    pool.scale(2)
    with sbx.diagnostics_on_failure():
        sbx.wait_converged(spec, 120)
    good, bad = sbx.vm(spec, pool.vmi_name(0)), sbx.vm(spec, pool.vmi_name(1))
    assert good.status().get("source") == "registry"
    assert bad.status().get("source") == "dns"
    log = bad.log_tail(200_000)
    assert "registry unreachable, DNS takes over" in log
    assert "is not the pinned registry CA" in log and wrong[:16] in log
    members = {m["index"]: m for m in sbx.registry_json(spec).get("members", [])}
    assert members[1].get("guest") is None  # it never reported: its token stayed home
