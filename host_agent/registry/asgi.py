"""ASGI middleware of the registry: body size limits and per-route request metrics.

Both sit outside FastAPI, so a refused body is never parsed and every answer,
errors included, is counted by its route template (bounded label values).
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable, MutableMapping, Sequence
from typing import Any, Final, Protocol

from fastapi.responses import JSONResponse
from starlette.routing import Match

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

#: Request methods counted by name; anything else is "other" (bounded label values).
_METHODS: Final = frozenset({"GET", "HEAD", "PUT", "POST", "PATCH", "DELETE", "OPTIONS"})


class RequestCounter(Protocol):
    def labels(self, *values: str) -> Any: ...




async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    response = JSONResponse(body, status_code=status)
    await send({"type": "http.response.start", "status": status, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})


class BodyLimit:
    """Refuse request bodies over the path's limit with 413 before the app parses them.

    ``limit`` applies to every path but those matching a regex of ``per_path``
    (first match wins), which get their own limit. A declared Content-Length
    over the limit is refused at once; a body without one (chunked) is read up
    to the limit and refused as soon as it exceeds it. A body within the limit
    is handed to the app unchanged.
    """

    def __init__(self, app: ASGIApp, limit: int,
                 per_path: Sequence[tuple[str, int]] = ()) -> None:
        self.app = app
        self.limit = limit
        self.per_path = tuple((re.compile(rx), n) for rx, n in per_path)

    def limit_for(self, path: str) -> int:
        for rx, n in self.per_path:
            if rx.match(path):
                return n
        return self.limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        length = headers.get(b"content-length")
        if length is None and b"transfer-encoding" not in headers:
            await self.app(scope, receive, send)
            return
        limit = self.limit_for(str(scope.get("path", "")))
        too_big = {"error": f"request body larger than {limit} bytes; "
                   "refused before it was read"}
        if length is not None and (not length.isdigit() or int(length) > limit):
            await send_json(send, 413, too_big)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await send_json(send, 413, too_big)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)


class RequestMetrics:
    """Count every response by route template, method and status code."""

    def __init__(self, app: ASGIApp, requests: RequestCounter, routes: Any) -> None:
        self.app = app
        self.requests = requests
        self.routes = routes

    def _route(self, scope: Scope) -> str:
        route = scope.get("route")
        if route is not None and hasattr(route, "path"):
            return str(route.path)
        for candidate in self.routes:
            match, _ = candidate.matches(scope)
            if match == Match.FULL:
                return str(candidate.path)
        return "unmatched"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counting_send)
        finally:
            method = scope["method"] if scope["method"] in _METHODS else "other"
            self.requests.labels(self._route(scope), method, str(status)).inc()
