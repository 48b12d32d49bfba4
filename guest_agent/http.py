"""A minimal HTTP/1.1 client on asyncio streams: the registry long-poll, the status PUT, the
certificate POST.

Why not httpx or aiohttp: the guest installs with a handful of small dependencies and
this is the only HTTP it speaks (DESIGN.md: the guest must install without the host's
stack). Scope is deliberately small:

* one request per connection (``Connection: close``): the long-poll holds a request for
  up to ``longpoll_timeout`` seconds and the status PUT is rare, so keep-alive buys
  nothing and a fresh connection can never carry a stale half-read response;
* ``http`` and ``https`` (the system trust store, or the caller's ``ssl_context``: the
  registry's pinned CA, guest_agent/registry_trust.py), JSON bodies (:func:`json_request`,
  the one helper the PUT and the POST share), ``Authorization: Bearer``;
* responses framed by ``Content-Length``, ``Transfer-Encoding: chunked`` or the end of
  the connection; every body is capped (``max_body``) and so are the status line and
  headers, so a hostile or broken server cannot make the agent buffer without bound.

Timeouts: ``connect_timeout`` bounds the TCP (and TLS) connect; ``read_timeout`` bounds
the whole exchange after that (sending the request and reading the full response), so a
server that accepts and then stalls is detected. Every failure raises one of the
:class:`HttpError` subclasses below, chained to the underlying cause.
"""

from __future__ import annotations

import asyncio
import json
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final
from urllib.parse import urlsplit

DEFAULT_MAX_BODY: Final = 1 << 20
MAX_HEAD: Final = 64 * 1024
USER_AGENT: Final = "imex-guest-agent"


class HttpError(Exception):
    """Any failure of an HTTP exchange; the message names the URL and what went wrong."""


class HttpUrlError(HttpError, ValueError):
    """The URL is not an absolute http(s) URL."""


class HttpConnectError(HttpError):
    """The TCP/TLS connection could not be established (refused, unreachable, timed out)."""


class HttpCertificateError(HttpConnectError):
    """https: the server's certificate was refused (another CA, expired, not yet valid,
    another host name); the request, token included, was never sent."""


class HttpTimeout(HttpError):
    """The server did not send the whole response within ``read_timeout``."""


class HttpProtocolError(HttpError):
    """The server's response is not valid HTTP/1.x (or the connection broke mid-response)."""


class HttpConnectionClosed(HttpProtocolError):
    """The connection ended (EOF, reset, keepalive timeout) before any byte of a response:
    what a client sees when the server closed or vanished while holding its request."""


class HttpTooLarge(HttpProtocolError):
    """The response head or body exceeds its size cap."""


class HttpStatusError(HttpError):
    """The server answered with a non-2xx status."""

    def __init__(self, message: str, status: int, body: bytes) -> None:
        super().__init__(message)
        self.status = status
        self.body = body


class HttpJsonError(HttpError):
    """The response body is not the JSON the caller expected."""


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    reason: str
    headers: Mapping[str, str]  # lower-case names; repeated headers joined with ", "
    body: bytes
    #: the request it answers (``"GET http://..."``), named by a ``json()`` error
    what: str = ""
    #: https: the server's certificate (``sha256`` of its DER, ``not_after``); else None
    server_cert: Mapping[str, str] | None = None

    def json(self) -> object:
        try:
            return json.loads(self.body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            where = f"{self.what}: " if self.what else ""
            raise HttpJsonError(f"{where}response body is not valid JSON: {exc}") from exc


@dataclass(frozen=True, slots=True)
class Keepalive:
    """TCP keepalive for one connection: probe after ``idle`` s of silence, every
    ``interval`` s, give up after ``count`` unanswered probes. Unacknowledged data is
    given up on after the same total (TCP_USER_TIMEOUT)."""

    idle: int = 2
    interval: int = 2
    count: int = 3

    @property
    def dead_after(self) -> int:
        return self.idle + self.interval * self.count

    def apply(self, sock: object) -> None:
        import socket

        setsockopt = getattr(sock, "setsockopt", None)
        if setsockopt is None:
            return
        try:
            setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for name, value in (("TCP_KEEPIDLE", self.idle), ("TCP_KEEPINTVL", self.interval),
                                ("TCP_KEEPCNT", self.count),
                                ("TCP_USER_TIMEOUT", self.dead_after * 1000)):
                opt = getattr(socket, name, None)
                if opt is not None:
                    setsockopt(socket.IPPROTO_TCP, opt, value)
        except OSError:
            pass  # not a TCP socket (a test's unix pair): nothing to tune


@dataclass(frozen=True, slots=True)
class _Target:
    scheme: str
    host: str
    port: int
    path: str  # path + query, never empty

    @property
    def host_header(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        default = 443 if self.scheme == "https" else 80
        return host if self.port == default else f"{host}:{self.port}"


def _target(url: str) -> _Target:
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        raise HttpUrlError(f"{url!r} is not a valid URL: {exc}") from exc
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise HttpUrlError(f"{url!r} is not an absolute http(s) URL")
    if port is None:
        port = 443 if parts.scheme == "https" else 80
    path = parts.path or "/"
    if parts.query:
        path += "?" + parts.query
    return _Target(parts.scheme, parts.hostname, port, path)


def _build_request(
    method: str, target: _Target, headers: Mapping[str, str], body: bytes | None
) -> bytes:
    lines = [f"{method} {target.path} HTTP/1.1", f"Host: {target.host_header}"]
    merged = {"User-Agent": USER_AGENT, "Accept": "application/json", "Connection": "close"}
    merged.update(headers)
    if body is not None:
        merged["Content-Length"] = str(len(body))
    for name, value in merged.items():
        if any(c in name + value for c in "\r\n"):
            raise HttpUrlError(f"header {name!r} contains a line break")
        lines.append(f"{name}: {value}")
    head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
    return head + (body or b"")


async def _read_line(reader: asyncio.StreamReader, budget: int, first: bool = False) -> bytes:
    try:
        line = await reader.readuntil(b"\n")
    except asyncio.LimitOverrunError as exc:
        raise HttpTooLarge("response line exceeds the size limit") from exc
    except asyncio.IncompleteReadError as exc:
        if first and not exc.partial:
            raise HttpConnectionClosed("connection closed before any response") from exc
        raise HttpProtocolError("connection closed in the middle of the response head") from exc
    except OSError as exc:
        if first:
            raise HttpConnectionClosed(f"connection lost before any response: {exc}") from exc
        raise
    if len(line) > budget:
        raise HttpTooLarge(f"response head exceeds {MAX_HEAD} bytes")
    return line


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, str, dict[str, str]]:
    budget = MAX_HEAD
    status_line = await _read_line(reader, budget, first=True)
    budget -= len(status_line)
    try:
        text = status_line.decode("latin-1").rstrip("\r\n")
        version, _, rest = text.partition(" ")
        code, _, reason = rest.partition(" ")
        if not version.startswith("HTTP/1.") or len(code) != 3 or not code.isdigit():
            raise ValueError(text)
        status = int(code)
    except ValueError as exc:
        raise HttpProtocolError(f"bad status line {status_line[:80]!r}") from exc
    headers: dict[str, str] = {}
    while True:
        line = await _read_line(reader, budget)
        budget -= len(line)
        if line in (b"\r\n", b"\n"):
            break
        name, sep, value = line.decode("latin-1").partition(":")
        if not sep or not name or name != name.strip():
            raise HttpProtocolError(f"bad header line {line[:80]!r}")
        key = name.lower()
        value = value.strip()
        headers[key] = f"{headers[key]}, {value}" if key in headers else value
    return status, reason, headers


async def _read_chunked(reader: asyncio.StreamReader, max_body: int) -> bytes:
    body = bytearray()
    while True:
        line = await _read_line(reader, 1024)
        size_text = line.split(b";", 1)[0].strip()
        try:
            size = int(size_text, 16)
        except ValueError as exc:
            raise HttpProtocolError(f"bad chunk size line {line[:40]!r}") from exc
        if size < 0:
            raise HttpProtocolError(f"bad chunk size line {line[:40]!r}")
        if size == 0:
            # trailers, up to the empty line
            budget = MAX_HEAD
            while True:
                trailer = await _read_line(reader, budget)
                budget -= len(trailer)
                if trailer in (b"\r\n", b"\n"):
                    return bytes(body)
        if len(body) + size > max_body:
            raise HttpTooLarge(f"response body exceeds {max_body} bytes")
        try:
            body += await reader.readexactly(size)
            crlf = await reader.readexactly(2)
        except asyncio.IncompleteReadError as exc:
            raise HttpProtocolError("connection closed in the middle of a chunk") from exc
        if crlf != b"\r\n":
            raise HttpProtocolError("chunk not terminated by CRLF")


async def _read_body(
    reader: asyncio.StreamReader,
    method: str,
    status: int,
    headers: Mapping[str, str],
    max_body: int,
) -> bytes:
    if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
        return b""
    encoding = headers.get("transfer-encoding", "").lower()
    if encoding:
        if encoding.split(",")[-1].strip() != "chunked":
            raise HttpProtocolError(f"unsupported Transfer-Encoding {encoding!r}")
        return await _read_chunked(reader, max_body)
    if "content-length" in headers:
        text = headers["content-length"]
        if not text.isdigit():
            raise HttpProtocolError(f"bad Content-Length {text!r}")
        length = int(text)
        if length > max_body:
            raise HttpTooLarge(f"response body of {length} bytes exceeds {max_body} bytes")
        try:
            return await reader.readexactly(length)
        except asyncio.IncompleteReadError as exc:
            raise HttpProtocolError(
                f"connection closed after {len(exc.partial)} of {length} body bytes"
            ) from exc
    body = await reader.read(max_body + 1)
    while body and len(body) <= max_body:
        more = await reader.read(max_body + 1 - len(body))
        if not more:
            break
        body += more
    if len(body) > max_body:
        raise HttpTooLarge(f"response body exceeds {max_body} bytes")
    return body


async def request(
    method: str,
    url: str,
    *,
    json_body: object = None,
    token: str | None = None,
    headers: Mapping[str, str] | None = None,
    connect_timeout: float = 5.0,
    read_timeout: float = 10.0,
    max_body: int = DEFAULT_MAX_BODY,
    keepalive: Keepalive | None = None,
    ssl_context: ssl.SSLContext | None = None,
) -> Response:
    """Send one request and return the response, whatever its status.

    ``ssl_context`` (https only): how the server's certificate is checked; None: the
    system trust store. The request (and its token) is written only after the handshake
    verified the server: a refused certificate is an :class:`HttpConnectError` naming why.

    ``keepalive`` turns on TCP keepalive (and TCP_USER_TIMEOUT) for this connection,
    so a request held by a server whose node vanished (no FIN, no RST ever comes)
    fails within ``keepalive.dead_after`` seconds instead of at ``read_timeout``.

    Raises HttpUrlError, HttpConnectError, HttpTimeout, HttpProtocolError/HttpTooLarge
    (HttpConnectionClosed when the connection ended before any byte of a response).
    """
    target = _target(url)
    extra = dict(headers or {})
    body: bytes | None = None
    if json_body is not None:
        body = json.dumps(json_body, separators=(",", ":")).encode()
        extra.setdefault("Content-Type", "application/json")
    if token is not None:
        extra["Authorization"] = f"Bearer {token}"
    wire = _build_request(method.upper(), target, extra, body)
    ssl_ctx = None
    if target.scheme == "https":
        ssl_ctx = ssl_context if ssl_context is not None else ssl.create_default_context()
    try:
        async with asyncio.timeout(connect_timeout):
            reader, writer = await asyncio.open_connection(
                target.host, target.port, ssl=ssl_ctx, limit=MAX_HEAD
            )
    except TimeoutError as exc:
        raise HttpConnectError(
            f"{method} {url}: connect timed out after {connect_timeout:g} s"
        ) from exc
    except ssl.SSLCertVerificationError as exc:
        raise HttpCertificateError(f"{method} {url}: {certificate_problem(exc)}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise HttpConnectError(f"{method} {url}: cannot connect: {exc}") from exc
    server_cert = _server_cert(writer) if ssl_ctx is not None else None
    if keepalive is not None:
        keepalive.apply(writer.get_extra_info("socket"))
    try:
        async with asyncio.timeout(read_timeout):
            writer.write(wire)
            await writer.drain()
            status, reason, resp_headers = await _read_head(reader)
            data = await _read_body(reader, method.upper(), status, resp_headers, max_body)
    except TimeoutError as exc:
        raise HttpTimeout(
            f"{method} {url}: no complete response within {read_timeout:g} s"
        ) from exc
    except HttpError as exc:
        raise type(exc)(f"{method} {url}: {exc}") from exc
    except (OSError, ssl.SSLError) as exc:
        raise HttpProtocolError(f"{method} {url}: connection failed: {exc}") from exc
    finally:
        writer.close()
        try:
            async with asyncio.timeout(1.0):
                await writer.wait_closed()
        except (OSError, ssl.SSLError, TimeoutError):
            pass
    return Response(status, reason.strip(), resp_headers, data, f"{method} {url}", server_cert)


def certificate_problem(exc: ssl.SSLCertVerificationError) -> str:
    """What is wrong with a refused server certificate, in words (OpenSSL's own reason)."""
    reason = (exc.verify_message or exc.reason or str(exc)).rstrip(".")
    if exc.verify_code in (2, 18, 19, 20, 21):  # no issuer / self-signed: another CA
        reason = f"{reason}: the server's certificate does not chain to the trusted CA"
    return f"refused the server's certificate ({reason}); nothing was sent"


def _server_cert(writer: asyncio.StreamWriter) -> dict[str, str] | None:
    sslobj = writer.get_extra_info("ssl_object")
    if sslobj is None:
        return None
    der = sslobj.getpeercert(binary_form=True)
    if not der:
        return None
    import hashlib

    out = {"sha256": hashlib.sha256(der).hexdigest()}
    info = sslobj.getpeercert()
    if isinstance(info, dict) and isinstance(info.get("notAfter"), str):
        out["not_after"] = info["notAfter"]
    return out


def _checked(method: str, url: str, resp: Response) -> Response:
    if not 200 <= resp.status < 300:
        snippet = resp.body[:200].decode("utf-8", "replace")
        raise HttpStatusError(
            f"{method} {url}: HTTP {resp.status} {resp.reason}: {snippet}".rstrip(": "),
            resp.status,
            resp.body,
        )
    return resp


async def json_request(
    method: str,
    url: str,
    body: object = None,
    *,
    token: str | None = None,
    connect_timeout: float = 5.0,
    read_timeout: float = 10.0,
    max_body: int = DEFAULT_MAX_BODY,
    ssl_context: ssl.SSLContext | None = None,
) -> Response:
    """``method`` ``url`` with ``body`` as JSON (None: no body); non-2xx raises
    HttpStatusError (with ``.status`` and ``.body``). The answer's ``json()`` names the
    request in its error."""
    resp = await request(
        method,
        url,
        json_body=body,
        token=token,
        connect_timeout=connect_timeout,
        read_timeout=read_timeout,
        max_body=max_body,
        ssl_context=ssl_context,
    )
    return _checked(method, url, resp)
