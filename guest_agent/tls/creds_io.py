"""The guest's IMEX credentials on disk: a local key, a certificate from the registry.

Imported only when ``auth_encryption`` is on (it needs ``cryptography``, which a guest
without auth never loads). What is trusted and why is :mod:`guest_agent.tls.creds`
(pure); this module makes the key, posts the CSR and writes what passed the checks.

Files (docs/guest-agent.md "TLS files"), all in ``tls_dir`` and written with the
safe writer: ``imex.key`` (0600, made here, never sent anywhere), ``imex.crt``,
``ca.crt`` (the trusted CA certificates only) and ``pinned-ca.sha256`` (0644, the CA
a cross-signature vouched for). The key is written before the certificate that needs
it, the CA file before the certificate (a peer's new certificate verifies as soon as
ours does).

This module runs as a short-lived child of the agent (``main``: ``inspect`` at
start, ``request`` for each certificate); the agent's own side, with the renewal
schedule and backoff, is guest_agent/tls/keeper_io.py, which never imports
``cryptography``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from guest_agent import http
from guest_agent.files.safewrite import FileWriteError, read_bytes, write_file
from guest_agent.registry_trust import RegistryTrust
from guest_agent.tls.creds import (
    BundleRefused,
    TlsError,
    cert_facts,
    check_leaf,
    key_pem,
    make_csr,
    make_key,
    public_der,
    sha256_hex,
    verify_bundle,
)
from guest_agent.tls.imex_config import CA_FILE, CERT_FILE, KEY_FILE, PIN_FILE

log = logging.getLogger("guest_agent.tls")  # logger name pinned


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


def inspect(paths: TlsPaths) -> dict[str, object]:
    """The key (made here, 0600, when missing) and what the certificate on disk says."""
    key = load_or_make_key(paths)
    cert = load_cert(paths)
    if cert is not None and public_der(cert) != public_der(key):
        cert = None  # a certificate for another key is no credential
    return {"ok": True, "cert": cert_facts(cert) if cert is not None else None,
            "ca": paths.ca.exists()}


async def request(paths: TlsPaths, pins: set[str], url: str, token: str | None, slot: str,
                  timeout: float = 10.0, registry_ca_sha256: str | None = None
                  ) -> dict[str, object]:
    """One certificate: CSR from our key, POST, checks, files written. Raises TlsError.

    An ``https://`` registry is checked against ``registry_ca_sha256`` (the pinned
    registry CA, guest_agent/registry_trust.py) before the CSR and the token are sent."""
    key = load_or_make_key(paths)
    csr = make_csr(key, slot)
    trust = RegistryTrust(url, registry_ca_sha256, timeout=min(5.0, timeout))
    try:
        answer = (await http.json_request("POST", url, {"csr": csr}, token=token,
                                          connect_timeout=min(5.0, timeout),
                                          read_timeout=timeout,
                                          ssl_context=await trust.context())).json()
    except http.HttpStatusError as exc:
        raise TlsError(f"certificate request failed: {exc}", status=exc.status) from exc
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
    p.add_argument("--registry-ca-sha256")
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
                                      args.timeout, args.registry_ca_sha256))
    except (TlsError, OSError) as exc:
        out = {"ok": False, "error": str(exc), "refused": isinstance(exc, BundleRefused),
               "http_status": getattr(exc, "status", None)}
    sys.stdout.write(json.dumps(out) + "\n")
    return 0 if out.get("ok") else 1

