"""Serving the registry: the uvicorn config and server the agent runs its app with.

Apart from the app (app.py) so that the agent can set up its listeners without
loading FastAPI, which it imports while its first lists are answered (main.py).
"""

from __future__ import annotations

import socket
from typing import Any

import uvicorn

from host_agent.state.store import State


def server_config(app: Any, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for the registry: proxy headers off (the app decides whom to trust).
    ``app`` may be None and set on the config before the server starts."""
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("timeout_graceful_shutdown", 5)
    return uvicorn.Config(app, host=host, port=port, proxy_headers=False, **kwargs)


class RegistryServer(uvicorn.Server):
    """uvicorn.Server that answers parked long-polls as soon as shutdown begins.

    Listening sockets handed in by the caller get TCP_NODELAY (inherited by
    accepted connections): asyncio sets it only on sockets created with
    ``proto=IPPROTO_TCP``, and without it the body of a long-poll answer on
    a kept-alive connection waits ~40 ms for a delayed ACK (Nagle).
    """

    def __init__(self, config: uvicorn.Config, state: State) -> None:
        super().__init__(config)
        self._state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        for sock in sockets or ():
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await super().startup(sockets)

    async def shutdown(self, sockets: Any = None) -> None:
        self._state.close()
        await super().shutdown(sockets)
