"""When the guest asks for a certificate (guest_agent.tls.keeper, pure): a table."""

from __future__ import annotations

import datetime as dt

import pytest

from guest_agent.tls.keeper import (
    CertFacts,
    KeeperError,
    expiring,
    iso,
    renew_at,
    renewal_due,
)

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SLOT = "imex-93a7a316-0"
CERT = CertFacts((SLOT,), NOW - dt.timedelta(hours=1), NOW + dt.timedelta(hours=29))
BUNDLE = "b" * 64


@pytest.mark.parametrize(
    ("cert", "slot", "registry_bundle", "now", "reason"),
    [
        (None, None, None, NOW, None),  # own slot not known yet: nothing to ask for
        (None, SLOT, None, NOW, "no certificate yet"),
        (CertFacts(("imex-93a7a316-1",), CERT.not_before, CERT.not_after), SLOT, None, NOW,
         f"the certificate names ['imex-93a7a316-1'], this guest is {SLOT}"),
        (CERT, SLOT, "c" * 64, NOW, "the registry's CA bundle changed (rotation)"),
        (CERT, SLOT, BUNDLE, NOW, None),
        (CERT, SLOT, None, NOW, None),  # a registry that says nothing about its bundle
        (CERT, SLOT, BUNDLE, NOW + dt.timedelta(hours=19), "two thirds of its lifetime "
         "have passed"),
        (CERT, SLOT, BUNDLE, NOW + dt.timedelta(hours=18, minutes=59), None),
    ],
)
def test_renewal_due(cert: CertFacts | None, slot: str | None, registry_bundle: str | None,
                     now: dt.datetime, reason: str | None) -> None:
    index = 0 if slot is not None else None
    assert renewal_due(cert, None, slot, index, registry_bundle, BUNDLE, now) == reason


def test_renew_at_two_thirds_from_when_it_came_within_its_validity() -> None:
    assert renew_at(CERT) == NOW + dt.timedelta(hours=19)
    assert renew_at(CERT, NOW + dt.timedelta(hours=2)) == NOW + dt.timedelta(hours=20)
    # an obtained time outside the validity is clamped into it
    assert renew_at(CERT, NOW - dt.timedelta(days=1)) == renew_at(CERT)
    assert renew_at(CERT, NOW + dt.timedelta(days=9)) == CERT.not_after


def test_expiring_within_a_day_and_the_facts_from_the_childs_answer() -> None:
    assert not expiring(None, NOW) and not expiring(CERT, NOW)
    assert expiring(CERT, NOW + dt.timedelta(hours=5))
    facts = CertFacts.of({"cn": [SLOT], "not_before": iso(CERT.not_before),
                          "not_after": iso(CERT.not_after)})
    assert facts == CERT and iso(NOW) == "2026-12-01T12:00:00Z"
    with pytest.raises(KeeperError, match="no certificate facts"):
        CertFacts.of(None)
    with pytest.raises(KeeperError, match="malformed"):
        CertFacts.of({"cn": [SLOT], "not_before": "yesterday"})


def test_a_404_is_asked_again_slowly_never_in_a_tight_loop() -> None:
    from guest_agent.tls.keeper import BACKOFF_FIRST, BACKOFF_MAX, KeeperError, retry_delay

    assert retry_delay(KeeperError("HTTP 503"), BACKOFF_FIRST) == (BACKOFF_FIRST,
                                                                    2 * BACKOFF_FIRST)
    assert retry_delay(KeeperError("HTTP 503"), BACKOFF_MAX) == (BACKOFF_MAX, BACKOFF_MAX)
    assert retry_delay(KeeperError("no route", status=404), BACKOFF_FIRST) == (
        BACKOFF_MAX, BACKOFF_MAX)
