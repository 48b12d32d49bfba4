"""The guest's side of the registry's TLS, against real TLS servers on loopback.

A pinned guest fetches the registry CA once (no token), believes it only by its sha256,
then verifies every connection before a byte of a request, token included, is written.
Each refused certificate (another CA, expired, not yet valid, another host name) is
refused with OpenSSL's reason; the report it was carrying is not lost; an ``https://``
registry is never spoken to in clear. The certificates are the host agent's own
(host_agent/ca: the registry CA and its serving certificates).
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from guest_agent import http
from guest_agent.config import ConfigError, settings_from_mapping
from guest_agent.registry_trust import (
    RegistryTrust,
    RegistryTrustError,
    der_sha256,
    origin,
    pem_certificates,
)
from guest_agent.report.report_io import Reporter
from host_agent.ca import registry_tls as rt
from host_agent.ca.registry_tls import Material, Names
from host_agent.registry.tls_server import server_context
from imex_shared.version import version_doc

NOW = dt.datetime.now(dt.UTC)
LOOPBACK = Names(("registry.test",), ("127.0.0.1",))
TOKEN = "s3cret-registry-token"


def material(names: Names = LOOPBACK, start: dt.datetime = NOW,
             lifetime: dt.timedelta = dt.timedelta(days=1), ns: str = "imex-system") -> Material:
    return rt.first(ns, names, start, lifetime).material()


@dataclass
class TlsRegistry:
    """A TLS server: the registry's CA route, /version, and a status PUT that records."""

    material: Material
    #: what the CA route hands out (default: the material's CA)
    ca_pem: str | None = None
    version: dict[str, str] | None = None
    requests: list[bytes] = field(default_factory=list)
    port: int = 0
    _server: asyncio.base_events.Server | None = None

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            writer.close()
            return
        length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                       if line.lower().startswith(b"content-length:")), 0)
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        path = head.split(b" ")[1].decode()
        if path == "/v1/registry-ca.crt":
            status, out = 200, (self.ca_pem or self.material.ca_pem or "").encode()
        elif path == "/version":
            status, out = 200, json.dumps(self.version or version_doc("0.2.0")).encode()
        else:
            status, out = 200, b'{"generation": 1, "received_at": "x"}'
        writer.write(f"HTTP/1.1 {status} OK\r\nContent-Length: {len(out)}\r\n"
                     "Connection: close\r\n\r\n".encode() + out)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
        writer.close()

    def serve(self, material: Material) -> None:
        """Present another certificate from now on (the context is reloaded in place)."""
        server_context(material, self.context)
        self.material = material

    async def __aenter__(self) -> TlsRegistry:
        self.context = server_context(self.material)
        self._server = await asyncio.start_server(self._handle, "127.0.0.1", 0,
                                                  ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    def tokens_seen(self) -> int:
        return sum(TOKEN.encode() in r for r in self.requests)


@contextlib.asynccontextmanager
async def registry(m: Material, **kw: Any) -> AsyncIterator[TlsRegistry]:
    async with TlsRegistry(m, **kw) as reg:
        yield reg


async def get(trust: RegistryTrust, url: str) -> http.Response:
    return await http.request("GET", url, token=TOKEN, ssl_context=await trust.context(),
                              connect_timeout=5, read_timeout=5)


async def test_a_pinned_registry_is_verified_and_its_certificate_recorded() -> None:
    m = material()
    async with registry(m) as reg:
        trust = RegistryTrust(reg.url + "/", m.ca_sha256)
        resp = await get(trust, f"{reg.url}/version")
        trust.observe(resp)
    assert resp.status == 200 and trust.server_cert is not None
    assert trust.server_cert["sha256"] == m.cert_sha256
    assert trust.describe()["transport"] == "https"
    ca_fetch, request = reg.requests
    assert ca_fetch.startswith(b"GET /v1/registry-ca.crt ") and TOKEN.encode() not in ca_fetch
    assert TOKEN.encode() in request  # only ever inside a verified connection


@pytest.mark.parametrize(("bad", "reason"), [
    ("another CA", "does not chain to the trusted CA"),
    ("expired", "certificate has expired"),
    ("not yet valid", "certificate is not yet valid"),
    ("another host", "mismatch, certificate is not valid for '127.0.0.1'"),
])
async def test_a_bad_registry_certificate_is_refused_by_name_and_nothing_is_sent(
        bad: str, reason: str) -> None:
    day = dt.timedelta(days=1)
    pinned = rt.first("imex-system", LOOPBACK, NOW - 3 * day, 30 * day)
    presented = {
        "another CA": lambda: rt.first("intruder", LOOPBACK, NOW),
        "expired": lambda: rt.renew(pinned, LOOPBACK, NOW - 3 * day, day),
        "not yet valid": lambda: rt.renew(pinned, LOOPBACK, NOW + 2 * day, day),
        "another host": lambda: rt.renew(pinned, Names(("elsewhere.test",), ("10.9.9.9",)),
                                         NOW, day),
    }[bad]().material()
    # the CA route hands out the pinned CA, as a man in the middle could
    async with registry(presented, ca_pem=pinned.material().ca_pem) as reg:
        trust = RegistryTrust(reg.url, pinned.ca.sha256)
        with pytest.raises(http.HttpCertificateError) as err:
            await get(trust, f"{reg.url}/v1/ensembles/gpu/gb200")
        await asyncio.sleep(0.1)
    assert reason in str(err.value) and "nothing was sent" in str(err.value)
    assert reg.tokens_seen() == 0
    assert [r.split(b" ")[1] for r in reg.requests] == [b"/v1/registry-ca.crt"]


async def test_a_ca_that_is_not_the_pin_is_refused_before_any_request() -> None:
    m = material()
    async with registry(m) as reg:
        trust = RegistryTrust(reg.url, "ab" * 32)
        with pytest.raises(RegistryTrustError, match="is not the pinned registry CA"):
            await get(trust, f"{reg.url}/version")
    assert reg.tokens_seen() == 0


async def test_an_https_registry_is_never_spoken_to_in_clear() -> None:
    """A plain HTTP server behind an https:// URL sees a TLS handshake, never a request."""
    seen: list[bytes] = []

    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen.append(await reader.read(4096))
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        writer.close()

    server = await asyncio.start_server(plain, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        trust = RegistryTrust(f"https://127.0.0.1:{port}", None)  # system trust store
        with pytest.raises(http.HttpConnectError):
            await get(trust, f"https://127.0.0.1:{port}/v1/ensembles/gpu/gb200")
    finally:
        server.close()
        await server.wait_closed()
    assert seen and all(chunk[:1] == b"\x16" for chunk in seen if chunk)  # TLS records
    assert not any(b"GET " in chunk or TOKEN.encode() in chunk for chunk in seen)


async def test_a_refused_certificate_loses_no_report(tmp_path: Path) -> None:
    """The reporter keeps the report through a bad certificate and delivers it after."""
    pinned = rt.first("imex-system", LOOPBACK, NOW)
    wrong_host = rt.renew(pinned, Names(("elsewhere.test",)), NOW, dt.timedelta(days=1))
    token = tmp_path / "token"
    token.write_text(TOKEN)
    async with registry(wrong_host.material(), ca_pem=pinned.material().ca_pem) as reg:
        settings = settings_from_mapping({
            "ensemble": "gb200", "namespace": "gpu", "registry_url": reg.url,
            "registry_ca_sha256": pinned.ca.sha256, "token_file": str(token),
            "imex_control": "none"})
        errors: list[str | None] = []
        rep = Reporter(settings, initial_wait=0.05, max_wait=0.2, on_error=errors.append,
                       agent_version="0.2.0")
        task = asyncio.create_task(rep.run())
        try:
            rep.submit(0, {"imex_state": "READY"})
            async with asyncio.timeout(10):
                while rep.failures < 2:  # noqa: ASYNC110 - the object under test counts
                    await asyncio.sleep(0.02)
            assert reg.tokens_seen() == 0 and rep.delivered == 0
            assert any("certificate is not valid for '127.0.0.1'" in str(e) for e in errors)
            reg.serve(rt.renew(pinned, LOOPBACK, NOW, dt.timedelta(days=1)).material())
            async with asyncio.timeout(10):
                while rep.delivered < 1:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    put = [r for r in reg.requests if r.startswith(b"PUT ")]
    assert len(put) == 1 and TOKEN.encode() in put[0]
    assert json.loads(put[0].split(b"\r\n\r\n", 1)[1])["registry_ca_sha256"] == \
        pinned.ca.sha256


async def test_a_host_too_old_for_this_guest_is_said_and_reports_still_go(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    caplog.set_level(logging.INFO, logger="guest_agent.reporter")
    m = material()
    token = tmp_path / "token"
    token.write_text(TOKEN)
    async with registry(m, version=version_doc("0.2.0")) as reg:
        settings = settings_from_mapping({
            "ensemble": "gb200", "namespace": "gpu", "registry_url": reg.url,
            "registry_ca_sha256": m.ca_sha256, "token_file": str(token),
            "imex_control": "none"})
        seen: list[dict[str, Any]] = []
        errors: list[str | None] = []
        rep = Reporter(settings, on_error=errors.append, on_registry=seen.append,
                       agent_version="0.4.0")
        task = asyncio.create_task(rep.run())
        try:
            rep.submit(0, {"imex_state": "READY"})
            async with asyncio.timeout(10):
                # the report first; /version is asked after it, never in its way
                while rep.delivered < 1 or rep.host is None:  # noqa: ASYNC110
                    await asyncio.sleep(0.02)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    host = seen[-1]["host"]
    assert host["skew"] == "host_too_old" and host["version"] == "0.2.0"
    assert "too old for this guest" in host["note"]
    assert errors and "upgrade the host agent first" in str(errors[0])
    assert seen[-1]["server_cert"]["sha256"] == m.cert_sha256
    said = [r for r in caplog.records if "too old for this guest" in r.getMessage()]
    assert len(said) == 1 and said[0].levelname == "ERROR"


def test_pem_helpers_and_the_config_key() -> None:
    m = material()
    pems = pem_certificates("junk\n" + (m.ca_pem or "") + m.chain_pem)
    assert len(pems) == 3 and der_sha256(pems[0]) == m.ca_sha256
    assert der_sha256("not pem") is None
    assert origin("https://r.example:8443/prefix/v1/ensembles/a/b/members/0/certificate") \
        == "https://r.example:8443/prefix"
    base = {"ensemble": "a", "namespace": "b"}
    ok = settings_from_mapping({**base, "registry_url": "https://r:8443",
                                "registry_ca_sha256": "AB" * 32})
    assert ok.registry_ca_sha256 == "ab" * 32
    for bad, words in (({"registry_url": "http://r:8080", "registry_ca_sha256": "ab" * 32},
                        "must be an https:// URL"),
                       ({"registry_url": "https://r", "registry_ca_sha256": "xyz"},
                        "64 hex digits")):
        with pytest.raises(ConfigError, match=words):
            settings_from_mapping({**base, **bad})
