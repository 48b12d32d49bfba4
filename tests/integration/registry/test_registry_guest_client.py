"""The guest agent's own registry client and reporter against the real registry.

Both sides are built separately (guest_agent/peers/registry_io.py and
guest_agent/report/report_io.py on one side, host_agent/registry/ensemble_routes.py and
report_routes.py on the other); this checks they agree on the wire: the document
the guest parses, the long-poll it holds, and the report body it sends.
"""

from __future__ import annotations

import asyncio
import hashlib
from pathlib import Path

from guest_agent.config import Settings
from guest_agent.peers.registry_io import RegistryClient
from guest_agent.report.report import Report
from guest_agent.report.report_io import Reporter
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import (
    ENS,
    MEMBERS,
    SPEC,
    TOKEN,
    Running,
    serve,
)


async def test_guest_client_reads_and_long_polls(registry: Running) -> None:
    settings = Settings(ensemble="gb200", namespace="gpu", max_members=4, registry_url=registry.url)
    client = RegistryClient(settings, ENS)
    first = await client.fetch()
    assert first.pins == {m.index: m.ip for m in MEMBERS}
    assert (first.max_members, first.port) == (4, 50000)
    poll = asyncio.create_task(client.fetch(wait=first.generation))
    await registry.until(lambda: registry.sample("imex_registry_longpoll_waiters") == 1)
    registry.state.set(SPEC, [*MEMBERS, Member(3, "10.213.0.13")], [])
    later = await asyncio.wait_for(poll, 5)
    assert later.generation == first.generation + 1
    assert later.pins[3] == "10.213.0.13"


async def test_guest_reporter_body_is_accepted(tmp_path: Path) -> None:
    # The guest's HTTP client cannot pick its source address, so this member is
    # published at the loopback address it will call from (the address check
    # with real, distinct addresses is in test_registry_netns).
    ens = EnsembleId("gpu", "lo")
    state = State()
    token_sha = hashlib.sha256(TOKEN.encode()).hexdigest()
    state.set(EnsembleSpec(ens, 2, 50000, token_sha256=token_sha), [Member(1, "127.0.0.1")], [])
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    async with serve(state) as reg:
        settings = Settings(
            ensemble="lo",
            namespace="gpu",
            max_members=2,
            registry_url=reg.url,
            token_file=str(token_file),
        )
        body = {
            "imex_state": "READY",
            "generation_applied": 1795973999097,
            "nodes_config_sha256": hashlib.sha256(b"n").hexdigest(),
            "hosts_sha256": hashlib.sha256(b"h").hexdigest(),
            "signals": 2,
            "restarts": 1,
            "agent_version": "0.1.0",
        }
        await Reporter(settings).send(Report(1, body))
    snap = state.get(ens)
    assert snap is not None
    assert dict(snap.reports[1].fields) == {
        **body, "cert_not_after": None, "fabric": None, "imex_channel0": None,  # optional
        "imex_channels": None, "preflight": None, "registry_ca_sha256": None,
        "transport": "http"}
    assert snap.reports[1].from_ip == "127.0.0.1"
