"""The per-ensemble CA: keys, certificates, CSR checks and rotation (pure).

No I/O and no clock of its own: every function takes ``now``. Everything
X.509 goes through ``cryptography``; nothing here builds ASN.1 by hand.

Profiles (issue 19, "X.509 profile"):
- the CA: ECDSA P-256, self-signed, ``CA:TRUE`` with pathLen 0 (it signs
  leaves only), KU keyCertSign + cRLSign, SKI; ten years, from 5 minutes
  before its creation;
- a leaf: CN and exactly one DNS SAN, both the member's slot name; EKU
  serverAuth + clientAuth (one certificate is IMEX's server and its client
  certificate), KU digitalSignature, ``CA:FALSE``, SKI and AKI; valid from 5
  minutes before issue (clock skew) for ``lifetime`` (7 days by default).

Rotation: a new CA key and self-signed certificate, plus the new CA's
certificate cross-signed by the **old** key (same subject and key as the new
CA, issuer the old CA). A guest that pins the old CA's fingerprint verifies
the cross-signature with the old CA's key, and from it the new CA, before it
trusts it. Three steps keep every link up (a member must trust a CA before any
peer presents a certificate from it):
1. *trust* (first half of the overlap): bundles are [old, new, cross] and the
   old key still signs, so every member learns to trust the new CA while all
   certificates are still old-CA ones;
2. *switch* (second half): the old key is dropped; bundles are [new, old,
   cross] and the new key signs, so members move to new-CA certificates that
   every peer already trusts, while old-CA ones stay trusted;
3. *done*: the old CA leaves the Secret and every bundle.
The first certificate of a bundle is always the one that signs now, and its
fingerprint is what ``status.caSHA256`` publishes.

The CA's Secret, written and read back, is secret.py's.

The registry's own TLS (``--tls-self-issued``, ca/registry_tls.py) is this machinery
too: a CA made by :func:`new_ca` under its own name (:func:`registry_ca_name`) and a
serving certificate from :func:`issue_server`, the leaf profile with the registry
Service's DNS names (and any IP the operator adds) and EKU serverAuth only.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import ipaddress
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, padding, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from imex_shared.model import EnsembleId

CA_LIFETIME: Final = dt.timedelta(days=3650)
LEAF_LIFETIME: Final = dt.timedelta(days=7)
#: Certificates are valid from this long before they are made (clock skew).
BACKDATE: Final = dt.timedelta(minutes=5)
MIN_RSA_BITS: Final = 2048


SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


class CsrError(ValueError):
    """A CSR that does not parse, has a bad signature or a wrong key (HTTP 422)."""


class CsrNameError(ValueError):
    """A CSR that parses but names anything other than exactly its own slot (HTTP 403)."""


def fingerprint(cert: x509.Certificate) -> str:
    """Hex sha256 of the certificate's DER (what ``status.caSHA256`` publishes)."""
    return cert.fingerprint(hashes.SHA256()).hex()


def cert_pem(cert: x509.Certificate) -> str:
    return cert.public_bytes(serialization.Encoding.PEM).decode("ascii")


def _key_pem(key: SigningKey) -> str:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ).decode("ascii")


def _serial() -> int:
    return secrets.randbits(159) | 1  # positive, at most 20 octets, never 0


def _utc(now: dt.datetime) -> dt.datetime:
    return now.astimezone(dt.UTC) if now.tzinfo else now.replace(tzinfo=dt.UTC)


@dataclass(frozen=True, slots=True)
class CaKeyPair:
    """One CA: its key and its self-signed certificate."""

    key: SigningKey
    cert: x509.Certificate

    @property
    def sha256(self) -> str:
        return fingerprint(self.cert)


@dataclass(frozen=True, slots=True)
class CaState:
    """What the Secret holds: the current CA and, during a rotation, the previous one."""

    current: CaKeyPair
    #: the previous CA's certificate, trusted until ``overlap_until``.
    previous: x509.Certificate | None = None
    #: the current CA's certificate signed by the previous CA's key.
    cross: x509.Certificate | None = None
    #: the rotation value (``spec.caRotation`` / annotation) that made ``current``.
    rotation: str = ""
    overlap_until: dt.datetime | None = None
    #: the previous CA's key, kept only during the *trust* step (it still signs).
    previous_key: SigningKey | None = None
    #: when the *trust* step ends (the new key starts signing).
    switch_at: dt.datetime | None = None

    @property
    def step(self) -> str:
        if self.previous is None:
            return "steady"
        return "trust" if self.previous_key is not None else "switch"

    @property
    def signer(self) -> CaKeyPair:
        """The CA that signs leaves now (the old one during the *trust* step)."""
        if self.previous is not None and self.previous_key is not None:
            return CaKeyPair(self.previous_key, self.previous)
        return self.current

    @property
    def sha256(self) -> str:
        """The signing CA's fingerprint (``status.caSHA256``, what new guests pin)."""
        return self.signer.sha256

    def bundle(self) -> tuple[x509.Certificate, ...]:
        """The CA certificates guests get, the signing one first (see the module docstring)."""
        if self.previous is None:
            return (self.current.cert,)
        cross = (self.cross,) if self.cross is not None else ()
        if self.previous_key is not None:
            return (self.previous, self.current.cert, *cross)
        return (self.current.cert, self.previous, *cross)

    def bundle_pem(self) -> str:
        return "".join(cert_pem(c) for c in self.bundle())

    def bundle_sha256(self) -> str:
        """Changes exactly when the bundle does (it feeds the guests' generation)."""
        return hashlib.sha256(self.bundle_pem().encode("ascii")).hexdigest()

    def next_step_at(self) -> dt.datetime | None:
        if self.step == "trust":
            return self.switch_at
        if self.step == "switch":
            return self.overlap_until
        return None


def _ca_name(ens: EnsembleId, rotation: str) -> x509.Name:
    # The subject differs per rotation so a verifier never confuses two CAs of one
    # ensemble by name; the rotation value itself may be any string, so it is hashed.
    tag = hashlib.sha256(rotation.encode()).hexdigest()[:8] if rotation else "0"
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "imex-ensemble"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"imex-ca {ens.key} {ens.domain_id}-{tag}"),
    ])


def _ca_extensions(builder: x509.CertificateBuilder, public: ec.EllipticCurvePublicKey
                   ) -> x509.CertificateBuilder:
    return (
        builder.add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=False, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=True,
                crl_sign=True, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
    )


def registry_ca_name(namespace: str) -> x509.Name:
    """The registry CA's subject: one per host agent namespace (all its replicas)."""
    return x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "imex-ensemble"),
        x509.NameAttribute(NameOID.COMMON_NAME, f"imex-registry-ca {namespace}"),
    ])


def new_ca(ens: EnsembleId | None, now: dt.datetime, rotation: str = "", *,
           name: x509.Name | None = None) -> CaKeyPair:
    """A fresh ECDSA P-256 CA for ``ens`` (self-signed), or under ``name`` (the registry's)."""
    now = _utc(now)
    key = ec.generate_private_key(ec.SECP256R1())
    if name is None:
        assert ens is not None
        name = _ca_name(ens, rotation)
    builder = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(_serial())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(now + CA_LIFETIME)
    )
    cert = _ca_extensions(builder, key.public_key()).sign(key, hashes.SHA256())
    return CaKeyPair(key, cert)


def cross_sign(new: CaKeyPair, old: CaKeyPair, now: dt.datetime) -> x509.Certificate:
    """The new CA's certificate issued by the old CA's key (same subject, key, SKI)."""
    now = _utc(now)
    public = new.cert.public_key()
    assert isinstance(public, ec.EllipticCurvePublicKey)
    builder = (
        x509.CertificateBuilder()
        .subject_name(new.cert.subject)
        .issuer_name(old.cert.subject)
        .public_key(public)
        .serial_number(_serial())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(min(new.cert.not_valid_after_utc, old.cert.not_valid_after_utc))
        .add_extension(_aki(old.cert), critical=False)
    )
    return _ca_extensions(builder, public).sign(old.key, hashes.SHA256())


def first_state(ens: EnsembleId, now: dt.datetime, rotation: str = "") -> CaState:
    """The CA an ensemble gets on first need."""
    return CaState(new_ca(ens, now, rotation), rotation=rotation)


def rotate(state: CaState, ens: EnsembleId, rotation: str, now: dt.datetime,
           overlap: dt.timedelta) -> CaState:
    """A new CA, cross-signed by the current one, with the current one kept for ``overlap``."""
    new = new_ca(ens, now, rotation)
    old = state.current  # a rotation during a rotation starts from the newest CA
    return CaState(
        current=new,
        previous=old.cert,
        cross=cross_sign(new, old, now),
        rotation=rotation,
        overlap_until=_utc(now) + overlap,
        previous_key=old.key,
        switch_at=_utc(now) + overlap / 2,
    )


def advance(state: CaState, now: dt.datetime) -> CaState:
    """The rotation's next step once its time has come (the same state otherwise)."""
    now = _utc(now)
    if state.step == "trust" and state.switch_at is not None and now >= state.switch_at:
        return replace(state, previous_key=None, switch_at=None)
    if state.step == "switch" and state.overlap_until is not None and \
            now >= state.overlap_until:
        return replace(state, previous=None, cross=None, overlap_until=None)
    return state


# -- leaves ---------------------------------------------------------------------------


def _aki(issuer: x509.Certificate) -> x509.AuthorityKeyIdentifier:
    try:
        ski = issuer.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
        return x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ski)
    except x509.ExtensionNotFound:
        public = issuer.public_key()
        assert isinstance(public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)
        return x509.AuthorityKeyIdentifier.from_issuer_public_key(public)


def load_csr(pem: str) -> x509.CertificateSigningRequest:
    """Parse and check a CSR's signature and key (``CsrError``: 422)."""
    try:
        csr = x509.load_pem_x509_csr(pem.encode("utf-8", "surrogateescape"))
    except (ValueError, UnsupportedAlgorithm, TypeError) as exc:
        raise CsrError(f"the CSR does not parse as a PEM certificate request: {exc}") from exc
    try:
        valid = csr.is_signature_valid
    except (ValueError, UnsupportedAlgorithm, InvalidSignature) as exc:
        raise CsrError(f"the CSR's signature cannot be checked: {exc}") from exc
    if not valid:
        raise CsrError("the CSR's signature does not match its public key")
    try:
        public = csr.public_key()
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise CsrError(f"the CSR's public key is not usable: {exc}") from exc
    if isinstance(public, ec.EllipticCurvePublicKey):
        if not isinstance(public.curve, ec.SECP256R1):
            raise CsrError(f"the CSR's key is ECDSA on {public.curve.name}; use P-256 "
                           "(secp256r1) or RSA of at least 2048 bits")
    elif isinstance(public, rsa.RSAPublicKey):
        if public.key_size < MIN_RSA_BITS:
            raise CsrError(f"the CSR's key is RSA {public.key_size}; at least {MIN_RSA_BITS} "
                           "bits, or ECDSA P-256")
    else:
        raise CsrError(f"the CSR's key is {type(public).__name__}; use ECDSA P-256 or RSA "
                       f"of at least {MIN_RSA_BITS} bits")
    return csr


def check_csr_names(csr: x509.CertificateSigningRequest, slot: str) -> None:
    """The subject is exactly CN=<slot> and the only SAN is DNS:<slot> (``CsrNameError``: 403)."""
    attrs = list(csr.subject)
    if len(attrs) != 1 or attrs[0].oid != NameOID.COMMON_NAME or attrs[0].value != slot:
        raise CsrNameError(
            f"the CSR's subject must be exactly CN={slot} (this member's slot), not "
            f"{csr.subject.rfc4514_string() or 'empty'}"
        )
    try:
        san = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        raise CsrNameError(
            f"the CSR has no subjectAltName; it needs exactly one, DNS:{slot}"
        ) from None
    except ValueError as exc:  # duplicated or malformed extensions
        raise CsrNameError(f"the CSR's extensions are malformed: {exc}") from exc
    names = list(san)
    if len(names) != 1 or not isinstance(names[0], x509.DNSName) or names[0].value != slot:
        shown = ", ".join(_general_name(n) for n in names[:5])
        more = f" and {len(names) - 5} more" if len(names) > 5 else ""
        raise CsrNameError(
            f"the CSR's subjectAltName must be exactly DNS:{slot}, not {shown}{more}"
        )


def _general_name(name: x509.GeneralName) -> str:
    kind = {x509.DNSName: "DNS", x509.IPAddress: "IP", x509.RFC822Name: "email",
            x509.UniformResourceIdentifier: "URI"}.get(type(name), type(name).__name__)
    return f"{kind}:{name.value}"


def issue_leaf(ca: CaKeyPair, csr: x509.CertificateSigningRequest, slot: str,
               now: dt.datetime, lifetime: dt.timedelta = LEAF_LIFETIME) -> x509.Certificate:
    """The member's certificate for a checked CSR (see the module docstring's profile)."""
    public = csr.public_key()
    return _leaf(ca, public, slot, [x509.DNSName(slot)],
                 [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH],
                 now, lifetime)


def issue_server(ca: CaKeyPair, public: object, dns_names: Sequence[str],
                 ips: Sequence[str], now: dt.datetime,
                 lifetime: dt.timedelta) -> x509.Certificate:
    """A TLS server's certificate (the registry's): CN the first DNS name, every name and
    address a SAN, EKU serverAuth; the leaf profile otherwise."""
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns_names]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    cn = dns_names[0] if dns_names else ips[0]
    return _leaf(ca, public, cn, sans, [ExtendedKeyUsageOID.SERVER_AUTH], now, lifetime)


def _leaf(ca: CaKeyPair, public: object, cn: str, sans: Sequence[x509.GeneralName],
          usages: Sequence[x509.ObjectIdentifier], now: dt.datetime,
          lifetime: dt.timedelta) -> x509.Certificate:
    now = _utc(now)
    assert isinstance(public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)
    not_after = min(now + lifetime, ca.cert.not_valid_after_utc)
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)]))
        .issuer_name(ca.cert.subject)
        .public_key(public)
        .serial_number(_serial())
        .not_valid_before(now - BACKDATE)
        .not_valid_after(not_after)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, content_commitment=False, key_encipherment=False,
                data_encipherment=False, key_agreement=False, key_cert_sign=False,
                crl_sign=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage(list(usages)), critical=False)
        .add_extension(x509.SubjectAlternativeName(list(sans)), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(_aki(ca.cert), critical=False)
    )
    return builder.sign(ca.key, hashes.SHA256())


# -- the Secret -------------------------------------------------------------------------


def _public_der(public: object) -> bytes:
    assert isinstance(public, ec.EllipticCurvePublicKey | rsa.RSAPublicKey)
    return public.public_bytes(serialization.Encoding.DER,
                               serialization.PublicFormat.SubjectPublicKeyInfo)


def verify_signed_by(cert: x509.Certificate, issuer: x509.Certificate) -> bool:
    """Whether ``issuer``'s key signed ``cert`` (and the names chain)."""
    if cert.issuer != issuer.subject:
        return False
    public = issuer.public_key()
    try:
        if isinstance(public, ec.EllipticCurvePublicKey):
            assert cert.signature_hash_algorithm is not None
            public.verify(cert.signature, cert.tbs_certificate_bytes,
                          ec.ECDSA(cert.signature_hash_algorithm))
        elif isinstance(public, rsa.RSAPublicKey):
            assert cert.signature_hash_algorithm is not None
            public.verify(cert.signature, cert.tbs_certificate_bytes, padding.PKCS1v15(),
                          cert.signature_hash_algorithm)
        else:
            return False
    except (InvalidSignature, AssertionError, ValueError):
        return False
    return True
