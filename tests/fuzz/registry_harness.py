"""The registry the HTTP fuzzer drives: a real uvicorn in its own thread and event loop,
listening on the gateway of a sandbox fabric (tests/sandbox/netns.py), so that a request
sent from inside a member's network namespace arrives from the member's own address and
one sent from the test's namespace arrives from outside (the gateway address).

Two ensembles: ``gpu/gb200`` (token, no TLS) and ``gpu/tls`` (authEncryption, with a CA,
so the certificate endpoint parses what it gets instead of answering 409). Member 0 of
each is the fabric node; member 2 of ``gb200`` is an address nobody holds.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import hashlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from host_agent.ca import authority as ca_mod
from host_agent.registry.config import CertConfig, RegistryConfig
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import serve
from tests.sandbox.netns import Fabric, in_netns

TOKEN = "fuzz token"
PLAIN = EnsembleId("gpu", "gb200")
TLS = EnsembleId("gpu", "tls")
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class FixedCa:
    """The CA Secret's stand-in: one CA made at start."""

    def __init__(self) -> None:
        self.state = ca_mod.first_state(TLS, dt.datetime.now(dt.UTC))

    async def load(self, ens: EnsembleId) -> ca_mod.CaState:
        return self.state


def state_for(member_ip: str) -> State:
    state = State()
    sha = hashlib.sha256(TOKEN.encode()).hexdigest()
    state.set(EnsembleSpec(PLAIN, 4, 50000, token_sha256=sha),
              [Member(0, member_ip, "gb200-0", "node-a", "Running", True),
               Member(2, "10.255.0.12", "gb200-2", "node-b", "Running", False)], ["a problem"])
    state.set(EnsembleSpec(TLS, 4, 50000, token_sha256=sha, auth_encryption=True),
              [Member(0, member_ip, "tls-0", "node-a", "Running", True)], [])
    state.mark_synced()
    return state


@dataclass
class Served:
    url: str
    member_ip: str
    netns: str

    @contextlib.contextmanager
    def source(self, where: str) -> Iterator[None]:
        """Sockets opened in the block come from the member's address, or from outside."""
        if where in ("member", "stateful"):
            with in_netns(self.netns):
                yield
        else:
            yield


@contextlib.contextmanager
def registry_on_fabric() -> Iterator[Served]:
    with Fabric("fuzzreg", gateway=True) as fab:
        node = fab.add_node("m0")
        assert fab.gateway_ip is not None
        ready = threading.Event()
        box: dict[str, Any] = {}

        async def main() -> None:
            stop = asyncio.Event()
            box["stop"], box["loop"] = stop, asyncio.get_running_loop()
            async with _serve(node.ip, str(fab.gateway_ip)) as running:
                box["url"] = running.url
                ready.set()
                await stop.wait()

        thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
        thread.start()
        assert ready.wait(20), "the registry did not start"
        try:
            yield Served(box["url"], node.ip, node.name)
        finally:
            box["loop"].call_soon_threadsafe(box["stop"].set)
            thread.join(20)


def _serve(member_ip: str, host: str) -> Any:
    state = state_for(member_ip)
    return serve(state, RegistryConfig(longpoll_cap=0.2, longpoll_default=0.2), host=host,
                 ca_source=FixedCa(), cert_config=CertConfig(rate=10**9))
