"""A small HTTP/1.1 server on asyncio streams, with the knobs fault injection needs.

TEST STAND-IN, never product code. Why not uvicorn: the tests need to do to
connections what a failing apiserver or network does (reset every open
connection, stop accepting and accept again on the same port, hold requests
without answering, end a watch stream mid-way), which needs direct control
of sockets and transports.

Protocol: HTTP/1.1 keep-alive, request bodies by Content-Length or chunked,
plain responses with Content-Length, streamed responses (watch) with chunked
transfer encoding, one chunk per event. While a streamed response is open
the connection is watched for EOF so a client that goes away ends its
stream at once (and the watcher is released).

Outages: `refuse()` closes the listening socket and resets every open
connection (clients see "connection refused"); `hold()` keeps accepting but
answers nothing until `resume()` (clients see timeouts); `resume()` undoes
either on the same port.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from urllib.parse import parse_qs, urlsplit

log = logging.getLogger(__name__)

MAX_HEADER = 64 * 1024
MAX_BODY = 32 * 1024 * 1024

REASONS = {200: "OK", 201: "Created", 202: "Accepted", 204: "No Content", 400: "Bad Request",
           401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 405: "Method Not Allowed",
           406: "Not Acceptable", 409: "Conflict", 410: "Gone", 413: "Payload Too Large",
           415: "Unsupported Media Type", 422: "Unprocessable Entity",
           429: "Too Many Requests", 500: "Internal Server Error", 503: "Service Unavailable",
           504: "Gateway Timeout"}


class AbortConnection(Exception):
    """Raised by a stream body to reset the connection instead of ending cleanly."""


class BadHttp(Exception):
    """The peer sent something that is not HTTP/1.1 we can parse."""


@dataclass
class Request:
    method: str
    target: str
    path: str
    query: dict[str, str]
    headers: dict[str, str]
    body: bytes
    peer: str = ""


@dataclass
class Response:
    status: int
    body: bytes = b""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


@dataclass
class StreamResponse:
    status: int
    chunks: AsyncIterator[bytes]
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "application/json"


Handler = Callable[[Request], Awaitable[Response | StreamResponse]]


async def _read_request(reader: asyncio.StreamReader, peer: str) -> Request | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as e:
        if e.partial.strip():
            raise BadHttp("truncated request head") from e
        return None
    except asyncio.LimitOverrunError as e:
        raise BadHttp("request head too large") from e
    lines = head.decode("latin-1").split("\r\n")
    try:
        method, target, version = lines[0].split(" ", 2)
    except ValueError as e:
        raise BadHttp(f"bad request line {lines[0]!r}") from e
    if not version.startswith("HTTP/1."):
        raise BadHttp(f"unsupported protocol {version!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise BadHttp(f"bad header line {line!r}")
        headers[name.strip().lower()] = value.strip()
    body = b""
    if headers.get("transfer-encoding", "").lower() == "chunked":
        parts: list[bytes] = []
        size_total = 0
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                await reader.readuntil(b"\r\n")
                break
            size_total += size
            if size_total > MAX_BODY:
                raise BadHttp("request body too large")
            parts.append(await reader.readexactly(size))
            await reader.readexactly(2)
        body = b"".join(parts)
    elif "content-length" in headers:
        length = int(headers["content-length"])
        if length > MAX_BODY:
            raise BadHttp("request body too large")
        body = await reader.readexactly(length)
    split = urlsplit(target)
    query = {k: v[-1] for k, v in parse_qs(split.query, keep_blank_values=True).items()}
    return Request(method.upper(), target, split.path, query, headers, body, peer)


def _head(status: int, content_type: str, extra: dict[str, str], length: int | None,
          keep_alive: bool) -> bytes:
    lines = [f"HTTP/1.1 {status} {REASONS.get(status, 'Status')}",
             f"Content-Type: {content_type}",
             "Cache-Control: no-cache, private"]
    lines.append(f"Content-Length: {length}" if length is not None
                 else "Transfer-Encoding: chunked")
    if not keep_alive:
        lines.append("Connection: close")
    lines.extend(f"{k}: {v}" for k, v in extra.items())
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


class HttpServer:
    """Serves `handler` on host:port; see the module docstring for outages."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0) -> None:
        self.handler = handler
        self.host = host
        self.port = port
        self._server: asyncio.Server | None = None
        self._writers: set[asyncio.StreamWriter] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self._open = asyncio.Event()
        self._open.set()

    async def start(self) -> None:
        self._server = await asyncio.start_server(
            self._serve, self.host, self.port, limit=MAX_HEADER, reuse_address=True)
        sock = self._server.sockets[0]
        self.port = sock.getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        self.reset_connections()
        self._open.set()
        if self._tasks:
            # aborted transports end the handlers; cancel only what is stuck (a delay)
            _, pending = await asyncio.wait(set(self._tasks), timeout=1.0)
            for task in pending:
                task.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)

    @property
    def accepting(self) -> bool:
        return self._server is not None

    def reset_connections(self) -> int:
        """Reset (RST) every open client connection."""
        n = len(self._writers)
        for w in list(self._writers):
            w.transport.abort()
        return n

    async def refuse(self) -> None:
        """Stop listening and reset connections: clients get "connection refused"."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self.reset_connections()

    def hold(self) -> None:
        """Accept connections but answer nothing until resume()."""
        self._open.clear()

    async def resume(self) -> None:
        self._open.set()
        if self._server is None:
            await self.start()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(writer)
        peername = writer.get_extra_info("peername")
        peer = str(peername[0]) if peername else ""
        try:
            while True:
                try:
                    req = await _read_request(reader, peer)
                except BadHttp as e:
                    writer.write(_head(400, "text/plain", {}, len(str(e)), False)
                                 + str(e).encode())
                    await writer.drain()
                    break
                if req is None:
                    break
                await self._open.wait()
                resp = await self.handler(req)
                keep = req.headers.get("connection", "").lower() != "close"
                if isinstance(resp, Response):
                    writer.write(_head(resp.status, resp.content_type, resp.headers,
                                       len(resp.body), keep) + resp.body)
                    await writer.drain()
                elif not await self._stream(reader, writer, resp):
                    break
                if not keep:
                    break
        except (ConnectionError, asyncio.IncompleteReadError, ValueError, OSError):
            pass  # the peer went away or sent something unparseable mid-request
        except Exception:  # never let one connection's failure escape into asyncio's logs
            log.exception("sandbox HTTP connection from %s failed", peer)
            writer.transport.abort()
        except asyncio.CancelledError:
            # Only stop() cancels these tasks; asyncio.streams would log a re-raised
            # cancellation as an error, so end quietly.
            writer.transport.abort()
        finally:
            self._writers.discard(writer)
            self._tasks.discard(task)
            writer.close()

    async def _stream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                      resp: StreamResponse) -> bool:
        """Write a chunked response; False when the connection must close."""
        writer.write(_head(resp.status, resp.content_type, resp.headers, None, True))
        await writer.drain()
        eof = asyncio.ensure_future(reader.read(1))
        chunks = resp.chunks
        try:
            while True:
                nxt = asyncio.ensure_future(anext(chunks))
                done, _ = await asyncio.wait({nxt, eof}, return_when=asyncio.FIRST_COMPLETED)
                if nxt not in done:
                    nxt.cancel()
                    with contextlib.suppress(asyncio.CancelledError, StopAsyncIteration):
                        await nxt
                    return False  # client went away (or sent junk mid-stream)
                try:
                    chunk = nxt.result()
                except StopAsyncIteration:
                    break
                except AbortConnection:
                    writer.transport.abort()
                    return False
                await self._open.wait()
                writer.write(b"%x\r\n%s\r\n" % (len(chunk), chunk))
                await writer.drain()
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            return True
        finally:
            # The EOF probe must be gone before the connection reads its next request
            # (StreamReader allows one reader at a time): cancel it and wait for that.
            eof.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await eof
            aclose = getattr(chunks, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()
