"""An ensemble's CA as its Secret: the bytes written, and the Secret read back (pure).

The Secret (``imex-ca-<namespace>.<name>``) holds ``ca.crt`` and ``ca.key``
(PEM), during a rotation ``previous.crt`` and ``cross.crt`` (and, in the
*trust* step only, ``previous.key``); annotations record the rotation value
that produced the current CA, when the *switch* comes and when the overlap
ends (authority.py has the rotation's steps). A Secret that does not parse into
exactly that is an error (``CaSecretError``), never a reason to mint a new CA:
a second CA would split the domain. secret_io.py reads and writes it.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
from collections.abc import Mapping
from typing import Final

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from host_agent.ca.authority import (
    MIN_RSA_BITS,
    CaKeyPair,
    CaState,
    SigningKey,
    _key_pem,
    _public_der,
    _utc,
    cert_pem,
    verify_signed_by,
)
from imex_shared.model import EnsembleId

SECRET_PREFIX: Final = "imex-ca-"


CA_CERT_KEY: Final = "ca.crt"


CA_KEY_KEY: Final = "ca.key"


PREVIOUS_CERT_KEY: Final = "previous.crt"


PREVIOUS_KEY_KEY: Final = "previous.key"


CROSS_CERT_KEY: Final = "cross.crt"


ROTATION_ANNOTATION: Final = "imex-ensemble.io/ca-rotation"


OVERLAP_ANNOTATION: Final = "imex-ensemble.io/ca-overlap-until"


SWITCH_ANNOTATION: Final = "imex-ensemble.io/ca-switch-at"


ENSEMBLE_ANNOTATION: Final = "imex-ensemble.io/ensemble"


class CaSecretError(ValueError):
    """The CA Secret exists but does not hold a usable CA; the message says what is wrong."""


def secret_name(ens: EnsembleId) -> str:
    """``imex-ca-<namespace>.<name>``: unique per ensemble (a '.' is in no label)."""
    return f"{SECRET_PREFIX}{ens.namespace}.{ens.name}"


def secret_data(state: CaState) -> dict[str, str]:
    """The Secret's ``data`` (base64 of PEM), the whole of it."""
    raw = {CA_CERT_KEY: cert_pem(state.current.cert), CA_KEY_KEY: _key_pem(state.current.key)}
    if state.previous is not None:
        raw[PREVIOUS_CERT_KEY] = cert_pem(state.previous)
    if state.cross is not None:
        raw[CROSS_CERT_KEY] = cert_pem(state.cross)
    if state.previous is not None and state.previous_key is not None:
        raw[PREVIOUS_KEY_KEY] = _key_pem(state.previous_key)
    return {k: base64.b64encode(v.encode("ascii")).decode("ascii") for k, v in raw.items()}


def secret_annotations(state: CaState, ens: EnsembleId) -> dict[str, str]:
    out = {ROTATION_ANNOTATION: state.rotation, ENSEMBLE_ANNOTATION: ens.key}
    if state.overlap_until is not None:
        out[OVERLAP_ANNOTATION] = _iso(state.overlap_until)
    if state.switch_at is not None and state.previous_key is not None:
        out[SWITCH_ANNOTATION] = _iso(state.switch_at)
    return out


def _iso(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _parse_iso(text: object) -> dt.datetime:
    for fmt in ("%Y-%m-%dT%H:%M:%S.%fZ", "%Y-%m-%dT%H:%M:%SZ"):
        try:
            return dt.datetime.strptime(str(text), fmt).replace(tzinfo=dt.UTC)
        except ValueError:
            continue
    raise ValueError(f"{text!r} is not an RFC 3339 UTC time")


def _load_key(raw: bytes, key: str, where: str) -> SigningKey:
    try:
        loaded = serialization.load_pem_private_key(raw, password=None)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:
        raise CaSecretError(f"{where}: {key} is not an unencrypted PEM private key "
                            f"({exc})") from exc
    if isinstance(loaded, ec.EllipticCurvePrivateKey):
        if not isinstance(loaded.curve, ec.SECP256R1):
            raise CaSecretError(f"{where}: {key} is ECDSA on {loaded.curve.name}, not P-256")
    elif isinstance(loaded, rsa.RSAPrivateKey):
        if loaded.key_size < MIN_RSA_BITS:
            raise CaSecretError(f"{where}: {key} is RSA {loaded.key_size} (< {MIN_RSA_BITS})")
    else:
        raise CaSecretError(f"{where}: {key} is {type(loaded).__name__}; "
                            "ECDSA P-256 or RSA only")
    return loaded


def _field(data: Mapping[str, object], key: str, where: str) -> bytes | None:
    value = data.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise CaSecretError(f"{where}: data[{key!r}] is not a string")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise CaSecretError(f"{where}: data[{key!r}] is not base64") from exc


def _load_cert(raw: bytes, key: str, where: str) -> x509.Certificate:
    try:
        return x509.load_pem_x509_certificate(raw)
    except ValueError as exc:
        raise CaSecretError(f"{where}: {key} is not a PEM certificate ({exc})") from exc


def _check_ca_cert(cert: x509.Certificate, key: str, where: str, now: dt.datetime) -> None:
    try:
        bc = cert.extensions.get_extension_for_class(x509.BasicConstraints).value
    except (x509.ExtensionNotFound, ValueError):
        bc = None
    if bc is None or not bc.ca:
        raise CaSecretError(f"{where}: {key} is not a CA certificate (basicConstraints CA:TRUE)")
    if not cert.not_valid_before_utc <= now <= cert.not_valid_after_utc:
        raise CaSecretError(
            f"{where}: {key} is valid {cert.not_valid_before_utc:%Y-%m-%d} to "
            f"{cert.not_valid_after_utc:%Y-%m-%d}, not now; rotate the CA"
        )


def parse_secret(obj: Mapping[str, object], now: dt.datetime) -> CaState:
    """The CA a Secret holds, or ``CaSecretError`` saying exactly what is wrong with it.

    A site's own CA may be put here before first use: ``ca.crt`` (a CA
    certificate) and ``ca.key`` (its key, PKCS#8 or traditional PEM, ECDSA
    P-256 or RSA >= 2048, unencrypted); the annotations may be absent.
    """
    now = _utc(now)
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, Mapping) else {}
    where = f"Secret {meta.get('namespace', '?')}/{meta.get('name', '?')}"
    data = obj.get("data")
    data = data if isinstance(data, Mapping) else {}
    raw_cert = _field(data, CA_CERT_KEY, where)
    raw_key = _field(data, CA_KEY_KEY, where)
    if raw_cert is None or raw_key is None:
        missing = [k for k, v in ((CA_CERT_KEY, raw_cert), (CA_KEY_KEY, raw_key)) if v is None]
        raise CaSecretError(f"{where}: missing {' and '.join(missing)}")
    cert = _load_cert(raw_cert, CA_CERT_KEY, where)
    key = _load_key(raw_key, CA_KEY_KEY, where)
    if _public_der(key.public_key()) != _public_der(cert.public_key()):
        raise CaSecretError(f"{where}: {CA_KEY_KEY} is not the key of {CA_CERT_KEY}")
    _check_ca_cert(cert, CA_CERT_KEY, where, now)
    annotations = meta.get("annotations")
    annotations = annotations if isinstance(annotations, Mapping) else {}
    rotation = annotations.get(ROTATION_ANNOTATION, "")
    rotation = rotation if isinstance(rotation, str) else ""
    previous = cross = None
    previous_key: SigningKey | None = None
    overlap_until = switch_at = None
    raw_prev = _field(data, PREVIOUS_CERT_KEY, where)
    raw_cross = _field(data, CROSS_CERT_KEY, where)
    raw_prev_key = _field(data, PREVIOUS_KEY_KEY, where)
    if raw_prev is not None:
        previous = _load_cert(raw_prev, PREVIOUS_CERT_KEY, where)
        try:
            overlap_until = _parse_iso(annotations.get(OVERLAP_ANNOTATION))
        except ValueError as exc:
            raise CaSecretError(f"{where}: {PREVIOUS_CERT_KEY} is present but annotation "
                                f"{OVERLAP_ANNOTATION}: {exc}") from None
        if raw_cross is not None:
            cross = _load_cert(raw_cross, CROSS_CERT_KEY, where)
            if not verify_signed_by(cross, previous) or _public_der(
                    cross.public_key()) != _public_der(cert.public_key()):
                raise CaSecretError(f"{where}: {CROSS_CERT_KEY} is not {CA_CERT_KEY}'s key "
                                    f"signed by {PREVIOUS_CERT_KEY}")
        if raw_prev_key is not None:
            previous_key = _load_key(raw_prev_key, PREVIOUS_KEY_KEY, where)
            if _public_der(previous_key.public_key()) != _public_der(previous.public_key()):
                raise CaSecretError(f"{where}: {PREVIOUS_KEY_KEY} is not the key of "
                                    f"{PREVIOUS_CERT_KEY}")
            try:
                switch_at = _parse_iso(annotations.get(SWITCH_ANNOTATION))
            except ValueError as exc:
                raise CaSecretError(f"{where}: {PREVIOUS_KEY_KEY} is present but annotation "
                                    f"{SWITCH_ANNOTATION}: {exc}") from None
    return CaState(CaKeyPair(key, cert), previous, cross, rotation, overlap_until,
                   previous_key, switch_at)
