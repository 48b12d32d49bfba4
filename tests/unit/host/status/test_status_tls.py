"""The CR status for authEncryption (issue 19): GuestCertExpiring when a guest's certificate
enters its last 24 h, CASecretInvalid for an unusable CA Secret, and the time at which the
expiry warning starts (status re-evaluated by time alone)."""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import replace
from pathlib import Path

from host_agent.state.snapshot import GuestReport
from host_agent.status.status import cert_expiring, desired_status, next_change
from tests.unit.host.status.test_status import ENS, STALE, T0, conditions, decl, ready_all, snapshot


def iso(ts: float) -> str:
    return dt.datetime.fromtimestamp(ts, dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def with_certs(not_after: dict[int, float]) -> object:
    snap = snapshot(reports=ready_all())
    state_reports = dict(snap.reports)
    for i, t in not_after.items():
        old = state_reports[i]
        state_reports[i] = GuestReport(old.received_at, old.from_ip,
                                       {**old.fields, "cert_not_after": iso(t)})
    return replace(snap, reports=state_reports)


def test_a_certificate_in_its_last_day_is_guest_cert_expiring() -> None:
    snap = with_certs({0: T0 + 5 * 86400, 1: T0 + 3600, 2: T0 + 86400 + 60})
    assert cert_expiring(snap, T0, STALE) == [1]  # type: ignore[arg-type]
    status = desired_status(decl(), snap, T0, STALE)  # type: ignore[arg-type]
    assert conditions(status)["Degraded"] == ("True", "GuestCertExpiring")
    degraded = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert "expires within 24 h" in degraded["message"]
    # slot 2 enters its last day in 60 s: the status must be looked at again then
    assert next_change(snap, T0, STALE) == T0 + 60  # type: ignore[arg-type]


def test_no_expiry_no_reason_and_a_broken_ca_secret_is_named() -> None:
    snap = with_certs({i: T0 + 5 * 86400 for i in range(3)})
    assert conditions(desired_status(decl(), snap, T0, STALE))["Degraded"] == (  # type: ignore[arg-type]
        "False", "AsExpected")
    bad = ("Secret imex-system/imex-ca-rack1.gb200: ca.crt is not a PEM certificate (x); not "
           "minting a new CA (that would split the domain): fix the Secret")
    status = desired_status(decl(), snapshot(reports=ready_all(), problems=(bad,)), T0, STALE)
    assert conditions(status)["Degraded"] == ("True", "CASecretInvalid")
    assert bad in status["problems"]
    assert ENS.key == "rack1/gb200"


def test_troubleshooting_shows_the_text_the_renderer_writes() -> None:
    """docs/troubleshooting.md's GuestCertExpiring block is this renderer's output."""
    doc = (Path(__file__).resolve().parents[4] / "docs" / "troubleshooting.md").read_text()
    block = re.search(r"<!-- rendered: guest-cert-expiring -->\n```text\n(.*?)\n```", doc, re.S)
    assert block is not None, "docs/troubleshooting.md: the guest-cert-expiring block is gone"
    snap = with_certs({0: T0 + 5 * 86400, 1: T0 + 3600, 2: T0 + 5 * 86400})
    status = desired_status(decl(), snap, T0, STALE)  # type: ignore[arg-type]
    c = next(c for c in status["conditions"] if c["type"] == "Degraded")
    assert block[1] == f"Condition Degraded={c['status']}  {c['reason']}: {c['message']}"
