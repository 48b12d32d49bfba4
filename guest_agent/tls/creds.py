"""Trust and names of the guest's IMEX credentials: the pin check, the CSR, the leaf check.

Pure (``cryptography``, no files, no network); the child that makes the key, asks the
registry and writes the files is :mod:`guest_agent.tls.creds_io`.

Trust (issue 19, "Trust bootstrap"): the registry is reached over plain HTTP on the
very network this feature distrusts, so nothing it sends is trusted for coming from
it. Every CA bundle is checked against the pinned fingerprints (``ca_sha256`` from
the user-data, plus the one pinned locally after a rotation): a CA certificate of
the bundle is trusted when its sha256 is pinned, or when a cross certificate in the
same bundle, signed by a trusted CA's key, carries its subject and key. A bundle
whose signing CA (its first certificate) is not trusted so is refused and reported,
and the current files stay; any other certificate without such a chain is simply not
trusted (a guest pinned to a new CA during a rotation). Once the bundle's signing CA
is trusted through a cross-signature, its fingerprint is pinned locally
(``TrustedBundle.new_pin``), so the guest keeps trusting it after the old CA is
dropped. The issued certificate must be signed by the bundle's current CA, carry our
own public key and name exactly our slot (:func:`check_leaf`).
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterable
from dataclasses import dataclass

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from guest_agent.tls.keeper import iso

log = logging.getLogger("guest_agent.tls")  # logger name pinned


class TlsError(RuntimeError):
    """Credentials could not be obtained or were refused; the message says why
    (``status``: the registry's HTTP status, when it answered with an error)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class BundleRefused(TlsError):
    """A CA bundle (or a certificate) that does not chain to the pinned fingerprint."""


def sha256_hex(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


def public_der(cert_or_key: x509.Certificate | ec.EllipticCurvePrivateKey) -> bytes:
    public = (cert_or_key.public_key())
    assert isinstance(public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)
    return public.public_bytes(serialization.Encoding.DER,
                               serialization.PublicFormat.SubjectPublicKeyInfo)


def signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``issuer``'s key made ``cert``'s signature (names must chain too)."""
    if cert.issuer != issuer.subject:
        return False
    try:
        cert.verify_directly_issued_by(issuer)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _is_ca(cert: x509.Certificate) -> bool:
    try:
        return bool(cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca)
    except (x509.ExtensionNotFound, ValueError):
        return False


@dataclass(frozen=True, slots=True)
class TrustedBundle:
    """A bundle that passed the pin check."""

    #: the self-signed CA certificates to trust (what ``ca.crt`` holds), current first.
    cas: tuple[x509.Certificate, ...]
    #: the bundle's current CA (its first certificate): leaves are signed by it.
    current: x509.Certificate
    #: a CA trusted through a cross-signature: pin it locally.
    new_pin: str | None
    #: sha256 of the bundle as the registry sent it (compared with the registry's digest).
    bundle_sha256: str

    def ca_pem(self) -> bytes:
        return b"".join(c.public_bytes(serialization.Encoding.PEM) for c in self.cas)


def verify_bundle(bundle_pem: str, pins: Iterable[str]) -> TrustedBundle:
    """Check a registry bundle against the pinned fingerprints (see the module docstring)."""
    pinned = {p.lower() for p in pins if p}
    if not pinned:
        raise BundleRefused("no CA fingerprint is pinned (config key ca_sha256)")
    try:
        certs = x509.load_pem_x509_certificates(bundle_pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise BundleRefused(f"the CA bundle does not parse: {exc}") from exc
    if not certs:
        raise BundleRefused("the CA bundle is empty")
    trusted = [c for c in certs if sha256_hex(c) in pinned]
    if not trusted:
        shown = ", ".join(sha256_hex(c)[:16] for c in certs)
        raise BundleRefused(
            f"no CA in the bundle ({shown}) has a pinned fingerprint "
            f"({', '.join(sorted(p[:16] for p in pinned))}); refusing it"
        )
    vouched: list[x509.Certificate] = []
    rest = [c for c in certs if c not in trusted]
    crosses = [c for c in rest if any(signed_by(c, t) for t in trusted) and _is_ca(c)]
    for cand in rest:
        if cand in crosses or not signed_by(cand, cand):
            continue
        if any(x.subject == cand.subject and public_der(x) == public_der(cand)
               for x in crosses):
            vouched.append(cand)
    current = certs[0]
    if current not in trusted and current not in vouched:
        raise BundleRefused(
            f"the bundle's signing CA {current.subject.rfc4514_string()} "
            f"({sha256_hex(current)[:16]}) does not chain to the pinned CA; refusing it"
        )
    ignored = [c for c in rest if c not in crosses and c not in vouched]
    if ignored:  # e.g. the old CA, for a guest that already pins only the new one
        log.info("CA bundle: not trusting %s (no chain to the pinned CA)",
                 ", ".join(c.subject.rfc4514_string() for c in ignored))
    cas = tuple(c for c in certs if c in trusted or c in vouched)
    # pin what the cross-signature vouched for at once: after the rotation only the new
    # CA is left, and the old pin could not vouch for it any more
    new_pin = sha256_hex(vouched[0]) if vouched else None
    digest = hashlib.sha256(bundle_pem.encode("ascii")).hexdigest()
    return TrustedBundle(cas, current, new_pin, digest)


def check_leaf(cert_pem: str, key: ec.EllipticCurvePrivateKey, slot: str,
               bundle: TrustedBundle) -> x509.Certificate:
    """The issued certificate, if it is ours: our key, our slot, signed by the current CA."""
    try:
        cert = x509.load_pem_x509_certificate(cert_pem.encode("ascii"))
    except (ValueError, UnicodeEncodeError) as exc:
        raise BundleRefused(f"the issued certificate does not parse: {exc}") from exc
    if public_der(cert) != public_der(key):
        raise BundleRefused("the issued certificate does not carry this guest's key")
    if not signed_by(cert, bundle.current):
        raise BundleRefused("the issued certificate is not signed by the bundle's current CA")
    cns = [a.value for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    try:
        sans = cert.extensions.get_extension_for_class(
            x509.SubjectAlternativeName).value.get_values_for_type(x509.DNSName)
    except x509.ExtensionNotFound:
        sans = []
    if cns != [slot] or sans != [slot]:
        raise BundleRefused(f"the issued certificate names {cns}/{sans}, not {slot}")
    return cert


def make_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def make_csr(key: ec.EllipticCurvePrivateKey, slot: str) -> str:
    """CN and the one DNS SAN are the slot name: exactly what the registry signs."""
    return (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, slot)]))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(slot)]), critical=False)
        .sign(key, hashes.SHA256())
        .public_bytes(serialization.Encoding.PEM)
        .decode("ascii")
    )


def cert_facts(cert: x509.Certificate) -> dict[str, object]:
    """What the daemon keeps of a certificate: its names and validity (no crypto needed)."""
    cns = [str(a.value) for a in cert.subject.get_attributes_for_oid(NameOID.COMMON_NAME)]
    return {"cn": cns, "not_before": iso(cert.not_valid_before_utc),
            "not_after": iso(cert.not_valid_after_utc)}
