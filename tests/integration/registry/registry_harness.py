"""A real registry: the app under a real uvicorn server, in the test's event loop.

The server runs as a task of the test's event loop (so the test mutates the
same ``State`` the handlers read, on the same thread) behind a socket bound to
an ephemeral port. Teardown shuts it down through ``RegistryServer`` and
waits for the task, also when the test failed.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import prometheus_client
import pytest

from host_agent.registry.app import create_app
from host_agent.registry.config import RegistryConfig
from host_agent.registry.serving import RegistryServer, server_config
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member

TOKEN = "correct horse battery staple"
ENS = EnsembleId("gpu", "gb200")
SPEC = EnsembleSpec(ENS, 4, 50000, token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
MEMBERS = (
    Member(0, "10.213.0.10", "gb200-0", "node-a", "Running", True),
    Member(2, "10.213.0.12", "gb200-2", "node-b", "Running", False),
)


@dataclass
class Running:
    state: State
    metrics: prometheus_client.CollectorRegistry
    server: RegistryServer
    task: asyncio.Task[None]
    host: str
    port: int

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def sample(self, name: str, **labels: str) -> float:
        value = self.metrics.get_sample_value(name, labels)
        return 0.0 if value is None else value

    async def until(self, what: Callable[[], bool], within: float = 5.0) -> None:
        """Await a condition the server reaches on its own (bounded)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + within
        while not what():
            assert loop.time() < deadline, "condition not reached in time"
            await asyncio.sleep(0.005)


def seeded_state() -> State:
    state = State()
    state.set(SPEC, MEMBERS, ["VMI gb200-9 has index 9, beyond max-members 4"])
    state.mark_synced()
    return state


@asynccontextmanager
async def serve(
    state: State, config: RegistryConfig | None = None, host: str = "127.0.0.1",
    **app_kwargs: Any,
) -> AsyncIterator[Running]:
    metrics = prometheus_client.CollectorRegistry()
    app = create_app(state, config or RegistryConfig(), metrics, **app_kwargs)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    port = sock.getsockname()[1]
    server = RegistryServer(server_config(app, host, port, lifespan="on"), state)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    running = Running(state, metrics, server, task, host, port)
    try:
        await running.until(lambda: server.started or task.done())
        assert not task.done(), "uvicorn did not start"
        yield running
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 10)
        sock.close()


@pytest.fixture
async def registry() -> AsyncIterator[Running]:
    async with serve(seeded_state()) as running:
        yield running
