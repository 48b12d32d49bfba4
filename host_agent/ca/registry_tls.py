"""The registry's own TLS: its CA and serving certificate, and what the server loads (pure).

Two sources give the registry its certificate (docs/security.md, docs/install.md):

* **self-issued** (``--tls-self-issued``): the agent keeps a registry CA and a serving
  certificate in the Secret ``imex-registry-tls`` of its own namespace, made with the
  per-ensemble CA machinery (authority.py: :func:`~host_agent.ca.authority.new_ca` under
  :func:`~host_agent.ca.authority.registry_ca_name`,
  :func:`~host_agent.ca.authority.issue_server`) and read back with its parser
  (secret.py's ``parse_secret`` reads the ``ca.crt``/``ca.key`` half). The serving
  certificate names the registry Service's DNS names (:func:`service_names`) and is
  renewed at two thirds of its lifetime, counted from its issue (:func:`renewal_due`);
  the CA stays (ten years), so guests' pins stay right;
* **files** (``--tls-cert-file``/``--tls-private-key-file``: cert-manager, or a Secret
  the operator mounts): read as they are (:func:`material_from_files`); the CA whose
  fingerprint guests pin is ``--tls-ca-file``, else the ``ca.crt`` beside the
  certificate (cert-manager writes one), else the chain's last certificate when it
  is self-signed.

Either way the server gets :class:`Material`: the chain and key PEM it loads, the CA
certificate it publishes at ``/v1/registry-ca.crt`` and its fingerprint (the sha256 of
the DER, 64 lowercase hex digits, as ``caSHA256``), which every ImexEnsemble's status
shows as ``registryCASHA256``. The I/O is registry_tls_io.py.
"""

from __future__ import annotations

import base64
import binascii
import datetime as dt
import ipaddress
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Final

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec

from host_agent.ca.authority import (
    BACKDATE,
    CaKeyPair,
    CaState,
    SigningKey,
    _key_pem,
    _public_der,
    _utc,
    cert_pem,
    fingerprint,
    issue_server,
    new_ca,
    registry_ca_name,
)
from host_agent.ca.secret import CaSecretError, parse_secret, secret_data

SECRET_NAME: Final = "imex-registry-tls"
TLS_CERT_KEY: Final = "tls.crt"
TLS_KEY_KEY: Final = "tls.key"
#: the serving certificate's lifetime (renewed at two thirds of it)
SERVING_LIFETIME: Final = dt.timedelta(days=30)
DEFAULT_SERVICE: Final = "imex-host-agent"
DEFAULT_CLUSTER_DOMAIN: Final = "cluster.local"


class RegistryTlsError(ValueError):
    """Certificate material that cannot be served; the message says what is wrong."""


@dataclass(frozen=True, slots=True)
class Names:
    """What the serving certificate names: DNS names and IP addresses."""

    dns: tuple[str, ...]
    ips: tuple[str, ...] = ()


def service_names(service: str, namespace: str, extra: Sequence[str] = (),
                  cluster_domain: str = DEFAULT_CLUSTER_DOMAIN) -> Names:
    """The Service's four DNS names, then ``extra`` (``--tls-san``: names or addresses)."""
    dns = [service, f"{service}.{namespace}", f"{service}.{namespace}.svc",
           f"{service}.{namespace}.svc.{cluster_domain}"]
    ips: list[str] = []
    for item in extra:
        try:
            ips.append(str(ipaddress.ip_address(item)))
        except ValueError:
            dns.append(item.lower().rstrip("."))
    return Names(tuple(dict.fromkeys(dns)), tuple(dict.fromkeys(ips)))


def cert_names(cert: x509.Certificate) -> Names:
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return Names(())
    return Names(tuple(san.get_values_for_type(x509.DNSName)),
                 tuple(str(a) for a in san.get_values_for_type(x509.IPAddress)))


@dataclass(frozen=True, slots=True)
class Material:
    """What the TLS listener loads and publishes (see the module docstring)."""

    chain_pem: str
    key_pem: str
    ca_pem: str | None
    ca_sha256: str | None
    #: sha256 of the serving certificate's DER: tells a rotation apart
    cert_sha256: str
    not_after: dt.datetime


@dataclass(frozen=True, slots=True)
class SelfIssued:
    """The Secret's content: the registry CA and its serving certificate and key."""

    ca: CaKeyPair
    cert: x509.Certificate
    key: SigningKey

    def material(self) -> Material:
        ca = cert_pem(self.ca.cert)
        return Material(cert_pem(self.cert) + ca, _key_pem(self.key), ca, self.ca.sha256,
                        fingerprint(self.cert), self.cert.not_valid_after_utc)


def _serving(ca: CaKeyPair, names: Names, now: dt.datetime,
             lifetime: dt.timedelta) -> tuple[x509.Certificate, SigningKey]:
    key = ec.generate_private_key(ec.SECP256R1())
    return issue_server(ca, key.public_key(), names.dns, names.ips, now, lifetime), key


def first(namespace: str, names: Names, now: dt.datetime,
          lifetime: dt.timedelta = SERVING_LIFETIME) -> SelfIssued:
    """A new registry CA and its first serving certificate."""
    ca = new_ca(None, now, name=registry_ca_name(namespace))
    cert, key = _serving(ca, names, now, lifetime)
    return SelfIssued(ca, cert, key)


def renew(tls: SelfIssued, names: Names, now: dt.datetime,
          lifetime: dt.timedelta = SERVING_LIFETIME) -> SelfIssued:
    """A new serving key and certificate from the same CA (the guests' pin stays)."""
    cert, key = _serving(tls.ca, names, now, lifetime)
    return SelfIssued(tls.ca, cert, key)


def renewal_due(tls: SelfIssued, names: Names, now: dt.datetime) -> str | None:
    """Why the serving certificate must be renewed now (None: not yet)."""
    have = cert_names(tls.cert)
    if set(have.dns) != set(names.dns) or set(have.ips) != set(names.ips):
        return (f"it names {', '.join(have.dns + have.ips)}, the registry is "
                f"{', '.join(names.dns + names.ips)}")
    return None if _utc(now) < renew_at(tls.cert) else "two thirds of its lifetime have passed"


def renew_at(cert: x509.Certificate) -> dt.datetime:
    """Two thirds into the lifetime, counted from its issue (notBefore is backdated)."""
    issued = cert.not_valid_before_utc + BACKDATE
    end = cert.not_valid_after_utc
    return issued + (end - issued) * 2 / 3 if end > issued else end


def secret_body(tls: SelfIssued, namespace: str, resource_version: str | None = None
                ) -> dict[str, object]:
    data = secret_data(CaState(tls.ca))
    data[TLS_CERT_KEY] = _b64(cert_pem(tls.cert))
    data[TLS_KEY_KEY] = _b64(_key_pem(tls.key))
    meta: dict[str, object] = {
        "name": SECRET_NAME, "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "imex-host-agent",
                   "imex-ensemble.io/registry-tls": "true"},
        "annotations": {"imex-ensemble.io/registry-ca-sha256": tls.ca.sha256},
    }
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta,
            "type": "kubernetes.io/tls", "data": data}


def _b64(text: str) -> str:
    return base64.b64encode(text.encode("ascii")).decode("ascii")


def parse(obj: Mapping[str, object], now: dt.datetime) -> SelfIssued:
    """The Secret read back; RegistryTlsError naming what is wrong (never replaced by a
    new CA: the guests pin this one)."""
    try:
        ca = parse_secret(obj, now).current
    except CaSecretError as exc:
        raise RegistryTlsError(str(exc)) from exc
    data = obj.get("data")
    data = data if isinstance(data, Mapping) else {}
    where = f"Secret {SECRET_NAME}"
    try:
        cert = x509.load_pem_x509_certificate(base64.b64decode(str(data[TLS_CERT_KEY])))
        loaded = serialization.load_pem_private_key(base64.b64decode(str(data[TLS_KEY_KEY])),
                                                    password=None)
    except (KeyError, ValueError, TypeError, binascii.Error) as exc:
        raise RegistryTlsError(f"{where}: {TLS_CERT_KEY}/{TLS_KEY_KEY} missing or not PEM "
                               f"({exc})") from exc
    if not isinstance(loaded, ec.EllipticCurvePrivateKey):
        raise RegistryTlsError(f"{where}: {TLS_KEY_KEY} is not an ECDSA key")
    if _public_der(loaded.public_key()) != _public_der(cert.public_key()):
        raise RegistryTlsError(f"{where}: {TLS_KEY_KEY} is not the key of {TLS_CERT_KEY}")
    return SelfIssued(ca, cert, loaded)


# -- files (cert-manager, or a mounted Secret) ------------------------------------------


def material_from_files(chain: bytes, key: bytes, ca: bytes | None, now: dt.datetime,
                        what: str) -> Material:
    """The material of ``--tls-cert-file``/``--tls-private-key-file`` (``ca``: the CA file,
    if any); RegistryTlsError naming the problem (an expired certificate included)."""
    try:
        certs = x509.load_pem_x509_certificates(chain)
    except ValueError as exc:
        raise RegistryTlsError(f"{what}: the certificate file is not PEM ({exc})") from exc
    try:
        loaded = serialization.load_pem_private_key(key, password=None)
    except (ValueError, TypeError) as exc:
        raise RegistryTlsError(f"{what}: the key file is not an unencrypted PEM key "
                               f"({exc})") from exc
    leaf = certs[0]
    if _public_der(loaded.public_key()) != _public_der(leaf.public_key()):
        raise RegistryTlsError(f"{what}: the key is not the certificate's")
    now = _utc(now)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        raise RegistryTlsError(f"{what}: the certificate is valid "
                               f"{leaf.not_valid_before_utc:%Y-%m-%dT%H:%M:%SZ} to "
                               f"{leaf.not_valid_after_utc:%Y-%m-%dT%H:%M:%SZ}, not now")
    ca_cert = None
    if ca:
        try:
            ca_cert = x509.load_pem_x509_certificates(ca)[0]
        except ValueError as exc:
            raise RegistryTlsError(f"{what}: the CA file is not PEM ({exc})") from exc
    elif len(certs) > 1 and certs[-1].issuer == certs[-1].subject:
        ca_cert = certs[-1]
    chain_pem = "".join(cert_pem(c) for c in certs)
    return Material(chain_pem, key.decode("ascii", "replace"),
                    cert_pem(ca_cert) if ca_cert is not None else None,
                    fingerprint(ca_cert) if ca_cert is not None else None,
                    fingerprint(leaf), leaf.not_valid_after_utc)
