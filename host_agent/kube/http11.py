"""A lean HTTP/1.1 path for the agent's API requests: one-shot calls, lists and watches.

Why: at 10,000 VMIs the agent's first sync makes about 2,000 writes and a steady
update two, and each request through lightkube's HTTP stack (URL model, header
validation, connection-pool bookkeeping, anyio streams) cost more CPU than the
rest of the agent's work for it (tests/bench ``host``, docs/benchmarks.md). This
module speaks the small part of HTTP/1.1 the Kubernetes API needs: keep-alive
connections over asyncio streams for one-shot calls (``request``), a connection of
its own for a streamed watch (``lines``), bodies framed by Content-Length, chunked
or the connection's close.

It reuses what lightkube already built from the configuration: the base URL, the
TLS context (CA, client certificate) and the bearer token. ``for_client`` returns
None when the configuration needs more (an exec or auth-provider plugin, basic
auth, a proxy): those clients keep the full stack for every request.
"""

from __future__ import annotations

import asyncio
import ssl
import weakref
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol
from urllib.parse import quote, urlencode

import msgspec

#: connections kept open per client (the reconciler runs ``settings.workers`` = 8)
MAX_CONNECTIONS: Final = 16
#: a response header block larger than this is refused (the API's are < 1 KiB)
MAX_HEADER_BYTES: Final = 64 * 1024


class ProtocolError(OSError):
    """The server's answer is not HTTP/1.1 this module can read."""


class StatusError(Exception):
    """A stream (``lines``) was answered with an error status instead of a stream."""

    def __init__(self, status: int, body: bytes) -> None:
        super().__init__(f"HTTP {status}: {body[:200].decode('utf-8', 'replace')}")
        self.status = status
        self.body = body


@dataclass(frozen=True)
class Answer:
    """One response: status, lower-cased headers, the whole body."""

    status: int
    headers: Mapping[str, str]
    body: bytes


class _Conn:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def close(self) -> None:
        self.writer.close()


Bearer = Callable[[bool], str | None]
"""The Authorization value; called with True after a 401 to read a rotated token."""


class Http11Pool:
    """Keep-alive HTTP/1.1 connections to one API server."""

    def __init__(self, scheme: str, host: str, port: int, prefix: str, *,
                 ssl_context: ssl.SSLContext | None, bearer: Bearer,
                 user_agent: str, timeout: float) -> None:
        self._host, self._port = host, port
        self._ssl = ssl_context if scheme == "https" else None
        literal = f"[{host}]" if ":" in host and not host.startswith("[") else host
        self._host_header = f"{literal}:{port}"
        self._prefix = prefix.rstrip("/")
        self._bearer = bearer
        self.user_agent = user_agent
        self.timeout = timeout
        self._idle: list[_Conn] = []
        self._slots = asyncio.Semaphore(MAX_CONNECTIONS)

    async def request(self, method: str, path: str, *, body: bytes | None = None,
                      params: Mapping[str, str] | None = None,
                      headers: Mapping[str, str] | None = None,
                      timeout: float | None = None) -> Answer:
        """Send one request and read its whole answer; a 401 re-reads the token once."""
        target = self._target(path, params)
        async with self._slots, asyncio.timeout(timeout or self.timeout):
            answer = await self._exchange(method, target, body, headers, self._bearer(False))
            if answer.status == 401:
                fresh = self._bearer(True)
                if fresh is not None:
                    answer = await self._exchange(method, target, body, headers, fresh)
            return answer

    async def _exchange(self, method: str, target: str, body: bytes | None,
                        headers: Mapping[str, str] | None, auth: str | None) -> Answer:
        head = self._head(method, target, body, headers, auth)
        # A kept-alive connection may have been closed by the server while idle: such a
        # failure before any byte of the answer is retried once on a new connection, as
        # Go's transport does. Not for a POST, which a server that read it may have acted
        # on; every other write the agent makes is idempotent or carries a precondition.
        while True:
            conn, reused = await self._checkout()
            try:
                conn.writer.write(head + (body or b""))
                await conn.writer.drain()
                answer, keep = await _read_answer(conn.reader, method)
            except (ConnectionError, asyncio.IncompleteReadError) as exc:
                conn.close()
                if reused and method != "POST" and _nothing_read(exc):
                    continue
                raise
            except BaseException:
                conn.close()
                raise
            if keep:
                self._idle.append(conn)
            else:
                conn.close()
            return answer

    async def lines(self, path: str, params: Mapping[str, str], *,
                    connect_timeout: float | None = None) -> AsyncGenerator[bytes, None]:
        """The body of a streamed GET (a watch), line by line, on a connection of its own.

        A non-200 answer raises ``StatusError`` with its body; a 401 re-reads the token
        once. The caller bounds the silence between lines; the stream ends when the
        server ends it.
        """
        target = self._target(path, params)
        for again in (False, True):
            auth = self._bearer(again)
            if again and auth is None:
                break
            conn = await self._open()
            try:
                async with asyncio.timeout(connect_timeout or self.timeout):
                    conn.writer.write(self._head("GET", target, None, None, auth))
                    await conn.writer.drain()
                    status, headers = await _read_head(conn.reader)
                    if status != 200:
                        body = await _read_body(conn.reader, "GET", status, headers)
                if status == 401 and not again:
                    continue
                if status != 200:
                    raise StatusError(status, body)
                async for line in _body_lines(conn.reader, headers):
                    yield line
                return
            finally:
                conn.close()

    def _target(self, path: str, params: Mapping[str, str] | None) -> str:
        """The request target: the server's path prefix, the path, the query."""
        target = quote(self._prefix + path, safe="/:@-._~!$&'()*+,;=")
        return f"{target}?{urlencode(params)}" if params else target

    def _head(self, method: str, target: str, body: bytes | None,
              headers: Mapping[str, str] | None, auth: str | None) -> bytes:
        lines = [f"{method} {target} HTTP/1.1", f"Host: {self._host_header}",
                 f"User-Agent: {self.user_agent}", "Accept-Encoding: identity"]
        if auth:
            lines.append(f"Authorization: {auth}")
        for name, value in (headers or {}).items():
            lines.append(f"{name}: {value}")
        if body is not None or method in ("POST", "PUT", "PATCH"):
            lines.append(f"Content-Length: {len(body or b'')}")
        return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")

    async def _open(self) -> _Conn:
        reader, writer = await asyncio.open_connection(
            self._host, self._port, ssl=self._ssl,
            server_hostname=self._host if self._ssl is not None else None,
            limit=MAX_HEADER_BYTES)
        return _Conn(reader, writer)

    async def _checkout(self) -> tuple[_Conn, bool]:
        while self._idle:
            conn = self._idle.pop()
            if not conn.reader.at_eof() and not conn.writer.is_closing():
                return conn, True
            conn.close()
        return await self._open(), False

    async def aclose(self) -> None:
        idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()


def _nothing_read(exc: BaseException) -> bool:
    return not isinstance(exc, asyncio.IncompleteReadError) or not exc.partial


async def _read_answer(reader: asyncio.StreamReader, method: str) -> tuple[Answer, bool]:
    """The status, headers and body of one response; and whether the connection stays."""
    status, headers = await _read_head(reader)
    keep = headers.get(":version") == "HTTP/1.1" and \
        headers.get("connection", "").lower() != "close"
    if not _framed(method, status, headers):
        keep = False
    body = await _read_body(reader, method, status, headers)
    return Answer(status, headers, body), keep


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    """The status and the lower-cased headers (the version under ``:version``)."""
    try:
        block = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError(f"response headers larger than {MAX_HEADER_BYTES} bytes") from exc
    status_line, *header_lines = block[:-4].decode("latin-1").split("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise ProtocolError(f"not an HTTP/1.1 status line: {status_line[:80]!r}")
    headers: dict[str, str] = {":version": parts[0]}
    for line in header_lines:
        name, sep, value = line.partition(":")
        if not sep:
            raise ProtocolError(f"malformed response header: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


def _no_body(method: str, status: int) -> bool:
    return method == "HEAD" or status in (204, 304) or 100 <= status < 200


def _framed(method: str, status: int, headers: Mapping[str, str]) -> bool:
    """The body's end is known without closing the connection."""
    return _no_body(method, status) or "content-length" in headers or \
        "chunked" in headers.get("transfer-encoding", "").lower()


async def _read_body(reader: asyncio.StreamReader, method: str, status: int,
                     headers: Mapping[str, str]) -> bytes:
    if _no_body(method, status):
        return b""
    if "chunked" in headers.get("transfer-encoding", "").lower():
        return await _read_chunked(reader)
    if "content-length" in headers:
        length = headers["content-length"]
        if not length.isdigit():
            raise ProtocolError(f"bad Content-Length {length[:40]!r}")
        return await reader.readexactly(int(length))
    return await reader.read()


async def _body_lines(reader: asyncio.StreamReader, headers: Mapping[str, str]
                      ) -> AsyncIterator[bytes]:
    """A streamed body's lines (without the newline), as the chunks arrive."""
    if "chunked" not in headers.get("transfer-encoding", "").lower():
        body = await _read_body(reader, "GET", 200, headers)
        for line in body.split(b"\n"):
            if line:
                yield line
        return
    pending = b""
    async for chunk in _chunks(reader):
        pending += chunk
        if b"\n" in pending:
            *complete, pending = pending.split(b"\n")
            for line in complete:
                yield line
    if pending:
        yield pending


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    out = bytearray()
    async for chunk in _chunks(reader):
        out += chunk
    return bytes(out)


async def _chunks(reader: asyncio.StreamReader) -> AsyncIterator[bytes]:
    """The data of each chunk of a chunked body, up to and including its end."""
    while True:
        size_line = (await reader.readuntil(b"\r\n"))[:-2].split(b";", 1)[0].strip()
        try:
            size = int(size_line, 16)
        except ValueError as exc:
            raise ProtocolError(f"bad chunk size {size_line[:40]!r}") from exc
        if size == 0:
            while await reader.readuntil(b"\r\n") != b"\r\n":  # trailers, then the end
                pass
            return
        yield await reader.readexactly(size)
        if await reader.readexactly(2) != b"\r\n":
            raise ProtocolError("a chunk does not end with CRLF")


class Response(Protocol):
    """What api_call reads of a response (httpx's, or ``LeanResponse``)."""

    @property
    def status_code(self) -> int: ...

    @property
    def text(self) -> str: ...

    def json(self) -> Any: ...


@dataclass(frozen=True)
class LeanResponse:
    """An ``Answer`` as api_call reads a response."""

    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        try:
            return msgspec.json.decode(self.content)
        except msgspec.DecodeError as exc:
            raise ValueError(str(exc)) from exc


_POOLS: weakref.WeakKeyDictionary[Any, Http11Pool | None] = weakref.WeakKeyDictionary()


def for_client(client: Any) -> Http11Pool | None:
    """The lean path for a lightkube ``AsyncClient``, built once from what it holds;
    None when its configuration needs the full stack (see the module docstring)."""
    try:
        return _POOLS[client]
    except KeyError:
        pool = _build(client)
        _POOLS[client] = pool
        return pool


def _build(client: Any) -> Http11Pool | None:
    inner = getattr(getattr(client, "_client", None), "_client", None)
    if inner is None or any(m is not None for m in getattr(inner, "_mounts", {}).values()):
        return None  # no HTTP client, or a proxy configured (a None mount is NO_PROXY)
    url = inner.base_url
    if url.scheme not in ("http", "https") or not url.host:
        return None
    bearer = _bearer_of(getattr(inner, "auth", None))
    if bearer is None:
        return None
    transport = getattr(inner, "_transport", None)
    transport = getattr(transport, "_inner", transport)  # under the request counter
    context = getattr(getattr(transport, "_pool", None), "_ssl_context", None)
    if url.scheme == "https" and not isinstance(context, ssl.SSLContext):
        return None
    timeout = getattr(getattr(inner, "timeout", None), "read", None) or 10.0
    return Http11Pool(url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80),
                      url.path, ssl_context=context, bearer=bearer,
                      user_agent=str(inner.headers.get("User-Agent", "imex-host-agent")),
                      timeout=float(timeout))


def _bearer_of(auth: Any) -> Bearer | None:
    """How to authenticate like lightkube's auth object does, if it is a simple one."""
    if auth is None:
        return lambda _again: None
    kind = type(auth).__name__
    if kind == "BearerAuth" and isinstance(getattr(auth, "_bearer", None), str):
        value: str = auth._bearer
        return lambda _again: value
    if kind == "BearerTokenFileAuth" and callable(getattr(auth, "_read_token", None)):
        def token_file(again: bool) -> str | None:
            # the same cache lightkube's own flow keeps: read once, again after a 401
            if again or getattr(auth, "_last_bearer", None) is None:
                auth._last_bearer = auth._read_token()
            return str(auth._last_bearer)
        return token_file
    return None
