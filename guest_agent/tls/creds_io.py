"""The guest's IMEX credentials: a local key, a CSR, a certificate from the registry, renewal.

Imported only when ``auth_encryption`` is on (it needs ``cryptography``, which a guest
without auth never loads).

Trust (issue 19, "Trust bootstrap"): the registry is reached over plain HTTP on the
very network this feature distrusts, so nothing it sends is trusted for coming from
it. Every CA bundle is checked against the pinned fingerprints (``ca_sha256`` from
the user-data, plus the one pinned locally after a rotation): a CA certificate of
the bundle is trusted when its sha256 is pinned, or when a cross certificate in the
same bundle, signed by a trusted CA's key, carries its subject and key. A bundle
whose signing CA (its first certificate) is not trusted so is refused and reported,
and the current files stay; any other certificate without such a chain is simply not
trusted (a guest pinned to a new CA during a rotation). Once the bundle's signing CA
is trusted through a cross-signature,
its fingerprint is pinned locally (``pinned-ca.sha256``), so the guest keeps trusting
it after the old CA is dropped. The issued certificate must be signed by the
bundle's current CA, carry our own public key and name exactly our slot.

Files (docs/guest-agent.md "TLS files"), all in ``tls_dir`` and written with the
safe writer: ``imex.key`` (0600, made here, never sent anywhere), ``imex.crt``,
``ca.crt`` (the trusted CA certificates only) and ``pinned-ca.sha256`` (0644). The
key is written before the certificate that needs it, the CA file before the
certificate (a peer's new certificate verifies as soon as ours does).

This module runs as a short-lived child of the agent (``main``: ``inspect`` at
start, ``request`` for each certificate); the agent's own side, with the renewal
schedule and backoff, is guest_agent/tls/keeper_io.py, which never imports
``cryptography``.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import logging
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from guest_agent import http
from guest_agent.files.safewrite import FileWriteError, read_bytes, write_file
from guest_agent.tls.imex_config import CA_FILE, CERT_FILE, KEY_FILE, PIN_FILE, ensure_imex_config

log = logging.getLogger("guest_agent.tls")  # logger name pinned

#: Expiry closer than this is a warning in the status (and GuestCertExpiring on the CR).
EXPIRY_WARNING: Final = dt.timedelta(hours=24)
BACKOFF_FIRST: Final = 2.0
BACKOFF_MAX: Final = 300.0


__all__ = ["BundleRefused", "TlsError", "ensure_imex_config", "main", "verify_bundle"]


class TlsError(RuntimeError):
    """Credentials could not be obtained or were refused; the message says why."""


class BundleRefused(TlsError):
    """A CA bundle (or a certificate) that does not chain to the pinned fingerprint."""


def sha256_hex(cert: x509.Certificate) -> str:
    return cert.fingerprint(hashes.SHA256()).hex()


def _public_der(cert_or_key: x509.Certificate | ec.EllipticCurvePrivateKey) -> bytes:
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
        if any(x.subject == cand.subject and _public_der(x) == _public_der(cand)
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
    if _public_der(cert) != _public_der(key):
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
    return {"cn": cns, "not_before": _iso(cert.not_valid_before_utc),
            "not_after": _iso(cert.not_valid_after_utc)}


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class TlsPaths:
    """The files under ``tls_dir`` (docs/guest-agent.md "TLS files")."""

    directory: Path

    @property
    def key(self) -> Path:
        return self.directory / KEY_FILE

    @property
    def cert(self) -> Path:
        return self.directory / CERT_FILE

    @property
    def ca(self) -> Path:
        return self.directory / CA_FILE

    @property
    def pin(self) -> Path:
        return self.directory / PIN_FILE


def load_or_make_key(paths: TlsPaths) -> ec.EllipticCurvePrivateKey:
    """The guest's key: from ``imex.key`` if it is a usable P-256 key, else a new one (0600)."""
    raw = read_bytes(paths.key)
    if raw is not None:
        try:
            key = serialization.load_pem_private_key(raw, password=None)
        except (ValueError, TypeError) as exc:
            log.warning("%s is not a usable key (%s); making a new one", paths.key, exc)
        else:
            if isinstance(key, ec.EllipticCurvePrivateKey) and isinstance(key.curve,
                                                                          ec.SECP256R1):
                os.chmod(paths.key, 0o600)
                return key
            log.warning("%s is not an ECDSA P-256 key; making a new one", paths.key)
    paths.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    key = make_key()
    write_file(paths.key, key_pem(key), default_mode=0o600)
    os.chmod(paths.key, 0o600)  # an existing file keeps its mode in the safe writer
    return key


def load_cert(paths: TlsPaths) -> x509.Certificate | None:
    raw = read_bytes(paths.cert)
    if raw is None:
        return None
    try:
        return x509.load_pem_x509_certificate(raw)
    except ValueError:
        return None


def load_pins(paths: TlsPaths, configured: str | None) -> set[str]:
    pins = {configured.lower()} if configured else set()
    raw = read_bytes(paths.pin)
    if raw is not None:
        text = raw.decode("ascii", "replace").strip().lower()
        if len(text) == 64 and all(c in "0123456789abcdef" for c in text):
            pins.add(text)
    return pins


def inspect(paths: TlsPaths) -> dict[str, object]:
    """The key (made here, 0600, when missing) and what the certificate on disk says."""
    key = load_or_make_key(paths)
    cert = load_cert(paths)
    if cert is not None and _public_der(cert) != _public_der(key):
        cert = None  # a certificate for another key is no credential
    return {"ok": True, "cert": cert_facts(cert) if cert is not None else None,
            "ca": paths.ca.exists()}


async def request(paths: TlsPaths, pins: set[str], url: str, token: str | None, slot: str,
                  timeout: float = 10.0) -> dict[str, object]:
    """One certificate: CSR from our key, POST, checks, files written. Raises TlsError."""
    key = load_or_make_key(paths)
    csr = make_csr(key, slot)
    try:
        answer = (await http.json_request("POST", url, {"csr": csr}, token=token,
                                          connect_timeout=min(5.0, timeout),
                                          read_timeout=timeout)).json()
    except http.HttpError as exc:
        raise TlsError(f"certificate request failed: {exc}") from exc
    if not isinstance(answer, dict) or not all(
            isinstance(answer.get(k), str) for k in ("certificate", "ca")):
        raise TlsError("the registry's certificate answer lacks certificate/ca")
    bundle = verify_bundle(str(answer["ca"]), pins)
    cert = check_leaf(str(answer["certificate"]), key, slot, bundle)
    try:
        if bundle.new_pin is not None:
            write_file(paths.pin, (bundle.new_pin + "\n").encode())
        write_file(paths.ca, bundle.ca_pem())
        write_file(paths.cert, cert.public_bytes(serialization.Encoding.PEM))
    except FileWriteError as exc:
        raise TlsError(f"cannot write the credentials: {exc}") from exc
    return {"ok": True, "cert": cert_facts(cert), "bundle_sha256": bundle.bundle_sha256,
            "ca_sha256": sha256_hex(bundle.current), "new_pin": bundle.new_pin}


def main(argv: list[str] | None = None) -> int:
    """``python -m guest_agent.tls inspect|request ...``: one JSON object on stdout.

    The daemon runs this as a short-lived child, so ``cryptography`` (about 13 MB of
    RSS) is never resident in the agent itself (docs/guest-agent.md, footprint).
    """
    import argparse
    import json
    import sys

    p = argparse.ArgumentParser(prog="python -m guest_agent.tls")
    p.add_argument("command", choices=("inspect", "request"))
    p.add_argument("--tls-dir", required=True)
    p.add_argument("--pin", action="append", default=[])
    p.add_argument("--url")
    p.add_argument("--token-file")
    p.add_argument("--slot")
    p.add_argument("--timeout", type=float, default=10.0)
    args = p.parse_args(argv)
    paths = TlsPaths(Path(args.tls_dir))
    try:
        if args.command == "inspect":
            out = inspect(paths)
        else:
            token = None
            if args.token_file:
                try:
                    token = Path(args.token_file).read_text(encoding="utf-8").strip() or None
                except OSError as exc:
                    raise TlsError(f"token_file {args.token_file}: {exc.strerror}") from exc
            if not args.url or not args.slot:
                raise TlsError("request needs --url and --slot")
            import asyncio

            out = asyncio.run(request(paths, set(args.pin), args.url, token, args.slot,
                                      args.timeout))
    except (TlsError, OSError) as exc:
        out = {"ok": False, "error": str(exc), "refused": isinstance(exc, BundleRefused)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out.get("ok") else 1

