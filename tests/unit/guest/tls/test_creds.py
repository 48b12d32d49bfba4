"""Trust and names of the guest's credentials (guest_agent.tls.creds, pure): the pin check,
the cross-signature that vouches for a rotated CA, the issued certificate's checks.

The CAs here are made with ``cryptography`` directly, in the registry's profile (a
self-signed CA, a cross certificate carrying the new CA's subject and key); the registry's
own CA is exercised against these checks in tests/integration/guest/test_tls_keeper.py.
"""

from __future__ import annotations

import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from guest_agent.tls.creds import (
    BundleRefused,
    cert_facts,
    check_leaf,
    make_csr,
    make_key,
    sha256_hex,
    verify_bundle,
)

NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)
SLOT = "imex-93a7a316-0"
CA = tuple[ec.EllipticCurvePrivateKey, x509.Certificate]


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _cert(subject: x509.Name, public: ec.EllipticCurvePublicKey, issuer: x509.Name,
          signer: ec.EllipticCurvePrivateKey, ca: bool,
          dns: str | None = None) -> x509.Certificate:
    builder = (
        x509.CertificateBuilder().subject_name(subject).issuer_name(issuer)
        .public_key(public).serial_number(x509.random_serial_number())
        .not_valid_before(NOW - dt.timedelta(minutes=5))
        .not_valid_after(NOW + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if dns is not None:
        builder = builder.add_extension(x509.SubjectAlternativeName([x509.DNSName(dns)]),
                                        critical=False)
    return builder.sign(signer, hashes.SHA256())


def new_ca(cn: str) -> CA:
    key = make_key()
    return key, _cert(_name(cn), key.public_key(), _name(cn), key, ca=True)


def cross(new: CA, old: CA) -> x509.Certificate:
    """``new``'s subject and key, signed by ``old``'s key."""
    return _cert(new[1].subject, new[0].public_key(), old[1].subject, old[0], ca=True)


def pem(*certs: x509.Certificate) -> str:
    return "".join(c.public_bytes(serialization.Encoding.PEM).decode() for c in certs)


def leaf(ca: CA, key: ec.EllipticCurvePrivateKey, slot: str = SLOT) -> str:
    cert = _cert(_name(slot), key.public_key(), ca[1].subject, ca[0], ca=False, dns=slot)
    return pem(cert)


def test_a_pinned_ca_is_trusted_and_anything_else_refused() -> None:
    old = new_ca("old")
    trusted = verify_bundle(pem(old[1]), [sha256_hex(old[1]).upper()])
    assert trusted.cas == (old[1],) and trusted.current == old[1] and trusted.new_pin is None
    with pytest.raises(BundleRefused, match="no CA fingerprint is pinned"):
        verify_bundle(pem(old[1]), ["", ""])
    with pytest.raises(BundleRefused, match="has a pinned fingerprint"):
        verify_bundle(pem(old[1]), ["0" * 64])
    with pytest.raises(BundleRefused, match="does not parse"):
        verify_bundle("not a bundle", [sha256_hex(old[1])])


def test_a_cross_signature_vouches_for_the_new_ca_which_is_then_pinned() -> None:
    old, new = new_ca("old"), new_ca("new")
    pin = sha256_hex(old[1])
    # the switch step: the new CA signs, the old one and the cross certificate follow
    bundle = verify_bundle(pem(new[1], old[1], cross(new, old)), [pin])
    assert bundle.current == new[1] and bundle.cas == (new[1], old[1])
    assert bundle.new_pin == sha256_hex(new[1])
    # a new CA without the cross certificate is not trusted for signing
    with pytest.raises(BundleRefused, match="does not chain to the pinned CA"):
        verify_bundle(pem(new[1], old[1]), [pin])
    # nor one vouched for by a CA that is not pinned
    stranger = new_ca("stranger")
    with pytest.raises(BundleRefused, match="does not chain to the pinned CA"):
        verify_bundle(pem(new[1], old[1], cross(new, stranger)), [pin])
    # a guest that pins only the new CA trusts it alone and ignores the old one
    only_new = verify_bundle(pem(new[1], old[1], cross(new, old)), [sha256_hex(new[1])])
    assert only_new.cas == (new[1],) and only_new.new_pin is None


def test_the_issued_certificate_carries_our_key_our_slot_and_the_current_ca() -> None:
    ca, key = new_ca("ca"), make_key()
    bundle = verify_bundle(pem(ca[1]), [sha256_hex(ca[1])])
    cert = check_leaf(leaf(ca, key), key, SLOT, bundle)
    facts = cert_facts(cert)
    assert facts == {"cn": [SLOT], "not_before": "2026-12-01T11:55:00Z",
                     "not_after": "2026-12-02T12:00:00Z"}
    with pytest.raises(BundleRefused, match="does not carry this guest's key"):
        check_leaf(leaf(ca, make_key()), key, SLOT, bundle)
    with pytest.raises(BundleRefused, match="not signed by the bundle's current CA"):
        check_leaf(leaf(new_ca("other"), key), key, SLOT, bundle)
    with pytest.raises(BundleRefused, match="not imex-93a7a316-0"):
        check_leaf(leaf(ca, key, "imex-93a7a316-1"), key, SLOT, bundle)


def test_the_csr_names_exactly_the_slot_with_our_key() -> None:
    key = make_key()
    csr = x509.load_pem_x509_csr(make_csr(key, SLOT).encode())
    assert csr.is_signature_valid
    assert [a.value for a in csr.subject] == [SLOT]
    san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.DNSName) == [SLOT]
    assert csr.public_key() == key.public_key()
