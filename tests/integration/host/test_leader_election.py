"""Several electing host agents against the API double: one writes, all serve, one number.

Each agent is a real HostAgent (its own lightkube client, Lease loop, informers and
registry on loopback) in this event loop; the Lease, the Service annotation and the
slices live in the double, which answers stale writes with 409 as the apiserver does.
Timing is test-sized (lease 3 s, renew deadline 2 s, retry 0.5 s). The process-level
faults (SIGKILL, SIGSTOP, SIGTERM) are in tests/realk8s/test_ha.py.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from typing import Any

import httpx
import pytest

from host_agent.persist.pair import MEMBERSHIP_ANNOTATION, decode
from imex_shared.model import EnsembleId
from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS, AgentFactory, RunningAgent, eventually
from tests.sandbox.kube_api.fixtures import KubeApiHandle
from tests.timing import measured

pytestmark = pytest.mark.timeout(90)

ENS = EnsembleId(NS, "gb200")
LEASE = ("coordination.k8s.io/v1", "Lease")
ELECT: dict[str, Any] = {
    "leader_elect": True, "leader_elect_lease_duration": 3.0,
    "leader_elect_renew_deadline": 2.0, "leader_elect_retry_period": 0.5,
    "agent_namespace": "imex-system", "shutdown_drain": 0.5,
}


def setup(api: KubeApiHandle, n: int = 3) -> None:
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    api.put(service("gb200", namespace=NS))
    for i in range(n):
        api.put(vmi(f"gb200-{i}", ensemble="gb200", ip=f"10.244.0.{i + 1}"))


def url(agent: RunningAgent, path: str) -> str:
    assert agent.agent.address is not None
    host, port = agent.agent.address
    return f"http://{host}:{port}{path}"


def leaders(agents: list[RunningAgent]) -> list[RunningAgent]:
    return [a for a in agents if a.agent.election is not None and a.agent.election.may_write()]


def persisted(api: KubeApiHandle) -> Any:
    svc = api.get("v1", "Service", "gb200", NS)
    text = (svc["metadata"].get("annotations") or {}).get(MEMBERSHIP_ANNOTATION)
    return decode(text) if text is not None else None


async def elected(api: KubeApiHandle, agents: list[RunningAgent]) -> RunningAgent:
    """The one leader, once it has persisted the ensemble's pair."""
    for a in agents:
        await a.settled(20)
    await eventually(lambda: len(leaders(agents)) == 1, 10, "one leader")
    await eventually(lambda: persisted(api) is not None, 10, "the pair persisted")
    (leader,) = leaders(agents)
    for a in agents:  # every replica has observed it
        await eventually(lambda a=a: a.agent.state.get(ENS) is not None, 10, "observed")
    return leader


async def serve_json(client: httpx.AsyncClient, agent: RunningAgent) -> dict[str, Any]:
    r = await client.get(url(agent, f"/v1/ensembles/{ENS.key}"))
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


def comparable(doc: dict[str, Any]) -> dict[str, Any]:
    """The JSON without what each process takes from its own clock (docs/host-agent.md)."""
    out = json.loads(json.dumps(doc))
    for m in out["members"]:
        if m.get("guest"):
            m["guest"].pop("age_s", None)
            m["guest"].pop("stale", None)
    return out


async def test_one_leader_writes_every_replica_serves_one_generation(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup(api)
    agents = [await start_agent(identity=f"r{i}", **ELECT) for i in range(3)]
    leader = await elected(api, agents)
    lease = api.get(*LEASE, "imex-host-agent", "imex-system")
    assert lease["spec"]["holderIdentity"] == leader.agent.settings.identity
    pair = persisted(api)
    async with httpx.AsyncClient(timeout=5) as client:
        docs = [await serve_json(client, a) for a in agents]
        assert {d["generation"] for d in docs} == {pair.generation}
        assert comparable(docs[0]) == comparable(docs[1]) == comparable(docs[2])
        metrics = [(await client.get(url(a, "/metrics"))).text for a in agents]
    assert sum("imex_host_agent_leader 1.0" in m for m in metrics) == 1
    for a in agents:  # followers wrote no pair and no slice
        if a is not leader:
            assert a.agent.metrics.membership_writes.labels("ok")._value.get() == 0
            assert a.agent.metrics.applies.labels("apply")._value.get() == 0
            # and answer /readyz like the leader (once their start-up checks are done)
            async with httpx.AsyncClient(timeout=5) as client:
                for _ in range(100):
                    readyz = await client.get(url(a, "/readyz"))
                    if readyz.status_code == 200:
                        break
                    await asyncio.sleep(0.1)
                assert readyz.status_code == 200, readyz.text


async def test_graceful_stop_hands_over_and_answers_parked_long_polls(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup(api)
    agents = [await start_agent(identity=f"r{i}", **ELECT) for i in range(2)]
    leader = await elected(api, agents)
    (follower,) = [a for a in agents if a is not leader]
    gen = persisted(api).generation
    async with httpx.AsyncClient(timeout=10) as client:
        parked = asyncio.create_task(
            client.get(url(leader, f"/v1/ensembles/{ENS.key}?wait={gen}&timeout=30")))
        await eventually(lambda: leader.agent.state.waiters() == 1, 10, "the long-poll parked")
        t0 = time.monotonic()
        stopping = asyncio.create_task(leader.stop())
        answer = await parked
        answered_after = measured("host.stop.parked_answered", time.monotonic() - t0)
        assert answer.status_code == 200 and answer.json()["generation"] == gen
        assert answer.headers["x-imex-registry"] == "closing"
        # not at the poll's 30 s: measured max 20 ms, 30 ms beside stress-ng (8 runs each,
        # 2026-12-02): bound 0.5 s
        assert answered_after < 0.5, answered_after
        await eventually(lambda: leaders([follower]), 3, "the follower takes over")
        took = measured("host.stop.released_taken", time.monotonic() - t0)
        # released, not expired: within about one jittered retry, far below the 3 s lease;
        # measured max 57 ms, 86 ms beside stress-ng (8 runs each, 2026-12-02)
        assert took < 0.5 * 2.2 + 0.5, took
        await stopping
        lease = api.get(*LEASE, "imex-host-agent", "imex-system")
        assert lease["spec"]["holderIdentity"] == follower.agent.settings.identity
        # the new leader publishes a change; its registry serves the next number
        api.put(vmi("gb200-1", ensemble="gb200", ip="10.244.0.99"))
        await eventually(lambda: persisted(api).generation == gen + 1, 10, "next generation")
        doc = await serve_json(client, follower)
        assert doc["generation"] == gen + 1
        assert {m["index"]: m["ip"] for m in doc["members"]}[1] == "10.244.0.99"


async def test_long_poll_answers_only_above_wait(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    """A guest holding a number from a replica that is ahead waits, instead of looping."""
    setup(api)
    agent = await start_agent(identity="solo", **ELECT)
    await elected(api, [agent])
    gen = persisted(api).generation
    async with httpx.AsyncClient(timeout=10) as client:
        ahead = asyncio.create_task(
            client.get(url(agent, f"/v1/ensembles/{ENS.key}?wait={gen + 1}&timeout=20")))
        await eventually(lambda: agent.agent.state.waiters() == 1, 10, "the long-poll parked")
        await asyncio.sleep(0.5)  # a window: an answer, were one due, would come in it
        assert not ahead.done()  # gen < wait: held
        api.put(vmi("gb200-2", ensemble="gb200", ip="10.244.0.77"))
        await eventually(lambda: (s := agent.agent.state.get(ENS)) is not None
                         and s.generation == gen + 1, 10, "generation gen + 1 served")
        await asyncio.sleep(0.5)  # the same window after the change
        assert not ahead.done()  # gen + 1 == wait: still held, nothing new for that guest
        api.put(vmi("gb200-2", ensemble="gb200", ip="10.244.0.78"))
        r = await asyncio.wait_for(ahead, 10)
        assert r.json()["generation"] == gen + 2
        old = await client.get(url(agent, f"/v1/ensembles/{ENS.key}?wait={gen}&timeout=20"))
        assert old.json()["generation"] == gen + 2  # behind: answered at once


async def test_a_hand_deleted_annotation_never_lowers_the_generation(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup(api)
    agent = await start_agent(identity="solo", **ELECT)
    await elected(api, [agent])
    gen = persisted(api).generation
    svc = api.get("v1", "Service", "gb200", NS)
    del svc["metadata"]["annotations"][MEMBERSHIP_ANNOTATION]
    svc.pop("status", None)
    api.put(svc)
    await eventually(lambda: MEMBERSHIP_ANNOTATION in (
        api.get("v1", "Service", "gb200", NS)["metadata"].get("annotations") or {}), 10,
        "annotation rewritten")
    assert persisted(api).generation > gen


TOKEN = "t0k3n"


def setup_reported(api: KubeApiHandle, n: int) -> None:
    import hashlib

    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    svc = service("gb200", namespace=NS)
    svc["metadata"].setdefault("annotations", {})["imex-ensemble.io/token-sha256"] = \
        hashlib.sha256(TOKEN.encode()).hexdigest()
    api.put(svc)
    for i in range(n):
        api.put(vmi(f"gb200-{i}", ensemble="gb200", ip=f"10.244.0.{i + 1}"))


#: the boot id of a stamped report (``put_report(..., sent_ns=)``)
BOOT = "6f1c2a4e-0000-4000-8000-00000000abcd"


async def put_report(client: httpx.AsyncClient, agent: RunningAgent, index: int,
                     state: str, sent_ns: int | None = None) -> httpx.Response:
    """Member ``index``'s report; with ``sent_ns``, stamped as a 0.2 guest does."""
    body: dict[str, object] = {"imex_state": state, "generation_applied": 1}
    if sent_ns is not None:
        body["sent"] = {"boot_id": BOOT, "boottime_ns": sent_ns}
    return await client.put(
        url(agent, f"/v1/ensembles/{ENS.key}/members/{index}/status"),
        json=body,
        headers={"Authorization": f"Bearer {TOKEN}",
                 "X-Forwarded-For": f"10.244.0.{index + 1}"})


async def shown(client: httpx.AsyncClient, agent: RunningAgent, index: int) -> str | None:
    doc = await serve_json(client, agent)
    for m in doc["members"]:
        if m["index"] == index and m["guest"]:
            return str(m["guest"]["imex_state"])
    return None


async def test_reports_land_on_any_replica_show_everywhere_and_survive_restarts(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup_reported(api, 18)
    opts = {**ELECT, "trusted_proxies": ("127.0.0.1/32",)}
    agents = [await start_agent(identity=f"r{i}", **opts) for i in range(2)]
    leader = await elected(api, agents)
    (follower,) = [a for a in agents if a is not leader]
    async with httpx.AsyncClient(timeout=10) as client:
        # to the follower: authenticated there, stored in the API, shown by the leader
        r = await put_report(client, follower, 3, "READY")
        assert r.status_code == 200, r.text
        t0 = time.monotonic()
        while await shown(client, leader, 3) != "READY":
            # measured max 17 ms, 27 ms beside stress-ng (8 runs each, 2026-12-02)
            assert time.monotonic() - t0 < 2.0, "the leader must show it within 2 s"
            await asyncio.sleep(0.05)
        measured("host.report.shown_by_leader", time.monotonic() - t0)
        # a boot storm of 18 reports to one replica: the first written at once, the rest
        # together, at most one write per 0.5 s (persist/reports.py). Two writes when the
        # 18 come within 0.5 s; a loaded machine may stretch them: one more per 0.5 s
        before = api.writes("configmaps", served_only=True)
        t_storm = time.monotonic()
        answers = await asyncio.gather(*(put_report(client, leader, i, "WAITING_FOR_PEERS")
                                         for i in range(18)))
        span = measured("host.report.storm_span", time.monotonic() - t_storm)
        assert {a.status_code for a in answers} == {200}
        writes = api.writes("configmaps", served_only=True) - before
        assert 1 <= writes <= 2 + math.floor(span / 0.5), (writes, span)
        t0 = time.monotonic()  # shown everywhere within 2.5 s: measured max 1 ms (16 runs)
        for a in agents:
            await eventually(lambda a=a: a.agent.state.get(ENS) is not None and all(
                (rep.fields.get("imex_state") == "WAITING_FOR_PEERS")
                for rep in a.agent.state.get(ENS).reports.values())  # type: ignore[union-attr]
                and len(a.agent.state.get(ENS).reports) == 18, 2.5,  # type: ignore[union-attr]
                "every replica shows all 18")
        measured("host.report.storm_shown_everywhere", time.monotonic() - t0)
    # restart every replica: nothing is lost
    for a in agents:
        await a.stop()
    fresh = [await start_agent(identity=f"n{i}", **opts) for i in range(2)]
    await elected(api, fresh)
    async with httpx.AsyncClient(timeout=10) as client:
        for a in fresh:
            await eventually(lambda a=a: len(a.agent.state.get(ENS).reports) == 18,  # type: ignore[union-attr]
                             10, "reports back after a restart of every replica")
            assert await shown(client, a, 7) == "WAITING_FOR_PEERS"


#: candidates sleep 5-11 s between reads: only the Lease watch can hand over quickly
SLOW_RETRY: dict[str, Any] = {**ELECT, "leader_elect_lease_duration": 30.0,
                              "leader_elect_renew_deadline": 20.0,
                              "leader_elect_retry_period": 5.0}


async def test_a_released_lease_is_taken_through_the_watch_not_the_next_read(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup(api)
    first = await start_agent(identity="r0", **SLOW_RETRY)
    await elected(api, [first])
    second = await start_agent(identity="r1", **SLOW_RETRY)
    await second.settled(20)
    el = second.agent.election
    assert el is not None and second.agent.lease_watch is not None
    await eventually(lambda: second.agent.lease_watch is not None
                     and second.agent.lease_watch.synced.is_set(), 10, "lease watch listed")
    steps = el.steps
    await eventually(lambda: el.steps > steps, 15, "a follower read")  # next read 5 s on
    t0 = time.monotonic()
    await first.stop()
    await eventually(lambda: el.may_write(), 3, "the follower takes over")
    took = measured("host.lease.released_taken_via_watch", time.monotonic() - t0)
    # not at the next read 5-11 s on: measured max 0.70 s, 0.75 s beside stress-ng (8 runs
    # each, 2026-12-02): bound 1.5 s
    assert took < 1.5, took
    lease = api.get(*LEASE, "imex-host-agent", "imex-system")
    assert lease["spec"]["holderIdentity"] == "r1"

