"""A level-triggered agent writes what differs and nothing else (issue 27), counted at the
API double: the first sync of Service-only ensembles never published is the generation
pair on each Service and each slice, and no Event; a restarted agent over the published,
unchanged fleet writes nothing at all.

The Service writes (the pair) are held 0.2 s at the API, so the status writer's first
evaluation of each ensemble comes while its pass still waits for the pair: the timing in
which every member of the fleet used to become a "MemberJoined" Event.
"""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS, AgentFactory
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(90)

ENSEMBLES, PER = 20, 3
WRITES = ("services", "endpointslices", "events", "imexensembles", "configmaps", "leases")


def writes(api: KubeApiHandle) -> dict[str, int]:
    return {r: n for r in WRITES if (n := api.writes(r, served_only=True))}


async def quiet(api: KubeApiHandle, seconds: float = 2.0, timeout: float = 60.0
                ) -> dict[str, int]:
    """The writes once none has come for ``seconds`` (the status writer, the Events)."""
    deadline = time.monotonic() + timeout
    last, since = writes(api), time.monotonic()
    while time.monotonic() < deadline:
        await asyncio.sleep(0.1)
        now = writes(api)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return now
    raise AssertionError(f"writes never stopped: {last}")


async def test_first_sync_writes_the_pair_and_the_slice_and_a_restart_nothing(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    for e in range(ENSEMBLES):
        api.put(service(f"e{e}", namespace=NS, uid=f"00000000-0000-4000-8000-{e:012d}"))
        for i in range(PER):
            api.put(vmi(f"e{e}-{i}", ensemble=f"e{e}", ip=f"10.1.{e}.{i + 1}"))
    api.delay(0.2, verbs=["patch"], resources=["services"])
    first = await start_agent()
    await first.settled(timeout=60)
    assert await quiet(api) == {"services": ENSEMBLES, "endpointslices": ENSEMBLES}
    assert first.agent.reconciler is not None
    assert first.agent.reconciler.passes == ENSEMBLES  # the writes' echoes cost no pass
    await first.stop()
    api.clear_faults()

    second = await start_agent()
    await second.settled(timeout=60)
    assert await quiet(api) == {"services": ENSEMBLES, "endpointslices": ENSEMBLES}
