"""The registry's TLS trust: the pinned registry CA, fetched once and checked, then used.

An ``https://`` registry URL with ``registry_ca_sha256`` set is trusted exactly as the
ensemble CA is (``ca_sha256``, guest_agent/tls/creds.py): by its fingerprint, the sha256
of the CA certificate's DER. The guest can only verify what it holds, so before its first
request it asks for the CA certificate itself (``GET /v1/registry-ca.crt``, over TLS
without checking the server yet, and without a token: the answer is public and is
believed only if its sha256 is the pin). From then on every registry connection is
verified against that one CA and the URL's host name, by OpenSSL, before a byte of the
request (the bearer token) is written. A certificate that does not chain to the pinned
CA, has expired, is not yet valid or names another host is refused with OpenSSL's reason
(:class:`http.HttpCertificateError`, a connect error: discovery falls back to DNS and
says why; the reporter keeps the report and tries again).

Never a downgrade: an ``https://`` URL is only ever spoken to over TLS; nothing here or
in its callers retries over ``http://``. Without a pin, ``https://`` uses the system
trust store (a registry certificate from a public CA). ``http://`` is plain, as before.

One :class:`RegistryTrust` per (registry URL, pin) in a process (:func:`trust_for`), so
discovery and the reporter share the fetched CA and the facts of the last server
certificate seen (status.json's ``registry``). Standard library only: the daemon never
loads ``cryptography`` (docs/guest-agent.md, footprint).
"""

from __future__ import annotations

import asyncio
import hashlib
import ssl
from collections.abc import Mapping
from typing import Final
from urllib.parse import urlsplit

from guest_agent import http

#: Where the registry publishes its CA certificate (host_agent/registry/tls_routes.py).
CA_PATH: Final = "/v1/registry-ca.crt"
MAX_CA_BYTES: Final = 64 * 1024
_BEGIN, _END = "-----BEGIN CERTIFICATE-----", "-----END CERTIFICATE-----"


class RegistryTrustError(http.HttpCertificateError):
    """The pinned registry CA could not be established; the message says why."""


def pem_certificates(text: str) -> list[str]:
    """Every PEM certificate block of ``text``, in order."""
    out: list[str] = []
    rest = text
    while (start := rest.find(_BEGIN)) >= 0:
        end = rest.find(_END, start)
        if end < 0:
            break
        out.append(rest[start:end + len(_END)] + "\n")
        rest = rest[end + len(_END):]
    return out


def der_sha256(pem: str) -> str | None:
    """sha256 of a PEM certificate's DER (the pinned form); None when it is not PEM."""
    try:
        return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()
    except ValueError:
        return None


def pinned_ca(text: str, pin: str) -> str:
    """The one certificate of ``text`` whose sha256 is ``pin``; RegistryTrustError else."""
    certs = pem_certificates(text)
    if not certs:
        raise RegistryTrustError(f"the registry's {CA_PATH} holds no PEM certificate")
    shown = []
    for pem in certs:
        digest = der_sha256(pem)
        if digest == pin:
            return pem
        shown.append((digest or "unparsable")[:16])
    raise RegistryTrustError(
        f"the registry's CA ({', '.join(shown)}) is not the pinned registry CA "
        f"(registry_ca_sha256 {pin[:16]}); refusing the registry, nothing sent")


def origin(url: str) -> str:
    """``scheme://host:port`` plus any path before ``/v1/``: where ``CA_PATH`` lives."""
    base = url.split("/v1/", 1)[0].rstrip("/")
    parts = urlsplit(base)
    return f"{parts.scheme}://{parts.netloc}{parts.path}"


class RegistryTrust:
    """How this guest checks the registry's certificate (see the module docstring)."""

    def __init__(self, base_url: str, pin: str | None, *, timeout: float = 5.0) -> None:
        self.base = origin(base_url)
        self.https = self.base.startswith("https://")
        self.pin = pin.lower() if pin else None
        self.timeout = timeout
        self._context: ssl.SSLContext | None = None
        self._lock = asyncio.Lock()
        #: the last server certificate a verified connection saw (sha256, not_after)
        self.server_cert: Mapping[str, str] | None = None

    @property
    def transport(self) -> str:
        return "https" if self.https else "http"

    def describe(self) -> dict[str, object]:
        """status.json's view of it (the reporter adds the host agent's version)."""
        return {"transport": self.transport, "ca_sha256": self.pin,
                "server_cert": dict(self.server_cert) if self.server_cert else None}

    async def context(self) -> ssl.SSLContext | None:
        """The context every registry request uses; None for ``http://``."""
        if not self.https:
            return None
        if self.pin is None:
            if self._context is None:
                self._context = ssl.create_default_context()
            return self._context
        async with self._lock:
            if self._context is None:
                self._context = await self._pinned_context()
        return self._context

    def observe(self, resp: http.Response) -> None:
        if resp.server_cert is not None:
            self.server_cert = resp.server_cert

    async def _pinned_context(self) -> ssl.SSLContext:
        assert self.pin is not None
        unverified = ssl.create_default_context()
        unverified.check_hostname = False
        unverified.verify_mode = ssl.CERT_NONE
        url = self.base + CA_PATH
        try:  # no token: the answer is public, and believed only by its fingerprint
            resp = await http.request("GET", url, connect_timeout=self.timeout,
                                      read_timeout=self.timeout, max_body=MAX_CA_BYTES,
                                      ssl_context=unverified,
                                      headers={"Accept": "application/x-pem-file"})
        except http.HttpError as exc:
            raise RegistryTrustError(f"cannot fetch the registry's CA to check the pin: "
                                     f"{exc}") from exc
        if resp.status == 404:
            raise RegistryTrustError(
                f"GET {url}: 404: this registry does not publish its CA (a host agent "
                "before 0.2, or --tls-cert-file without a CA): the pinned registry CA "
                "cannot be checked; refusing the registry, nothing sent")
        if resp.status != 200:
            raise RegistryTrustError(f"GET {url}: HTTP {resp.status} {resp.reason}")
        pem = pinned_ca(resp.body.decode("ascii", "replace"), self.pin)
        ctx = ssl.create_default_context(cadata=pem)
        ctx.check_hostname = True
        ctx.verify_mode = ssl.CERT_REQUIRED
        return ctx


_SHARED: dict[tuple[str, str | None], RegistryTrust] = {}


def trust_for(url: str, pin: str | None) -> RegistryTrust:
    """The process's one :class:`RegistryTrust` for this registry and pin."""
    key = (origin(url), pin.lower() if pin else None)
    trust = _SHARED.get(key)
    if trust is None:
        trust = _SHARED[key] = RegistryTrust(url, pin)
    return trust
