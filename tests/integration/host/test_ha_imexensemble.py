"""Electing replicas and ImexEnsembles: the generation lives in the CR's status.

Two real HostAgents (their own lightkube clients, Lease loops, informers and registries
on loopback) against the API double, which serves the CRD from manifests/base, answers
stale writes with 409 and garbage-collects (or orphans) by ownerReference. A watcher
samples every replica's served generation every 10 ms, as a guest moving between
replicas would see it, and the tests assert it never goes backwards, also while an
ensemble moves between the two kinds of source (a CR adopting a Service that carries an
annotation pair, and back with ``--cascade=orphan``).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from host_agent.persist.pair import MEMBERSHIP_ANNOTATION, decode
from imex_shared.model import EnsembleId
from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS, AgentFactory, RunningAgent, eventually
from tests.integration.host.test_leader_election import ELECT, leaders
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(120)

ENS = EnsembleId(NS, "gb200")
CR = ("imex-ensemble.io/v1alpha1", "ImexEnsemble")
SVC = ("v1", "Service")
TOKEN_SHA = hashlib.sha256(b"t").hexdigest()


def cr(max_members: int = 4) -> dict[str, Any]:
    return {"apiVersion": CR[0], "kind": CR[1], "metadata": {"name": "gb200", "namespace": NS},
            "spec": {"maxMembers": max_members, "tokenSHA256": TOKEN_SHA}}


def status(api: KubeApiHandle) -> dict[str, Any]:
    try:
        return api.get(*CR, "gb200", NS).get("status") or {}
    except Exception:
        return {}


def annotation(api: KubeApiHandle) -> Any:
    svc = api.get(*SVC, "gb200", NS)
    text = (svc["metadata"].get("annotations") or {}).get(MEMBERSHIP_ANNOTATION)
    return decode(text) if text is not None else None


def served(agent: RunningAgent) -> int | None:
    snap = agent.agent.state.get(ENS)
    return snap.generation if snap is not None else None


def pins(agent: RunningAgent) -> dict[int, str]:
    snap = agent.agent.state.get(ENS)
    return snap.pins() if snap is not None else {}


class Watcher:
    """What guests would see: every replica's served generation, sampled every 10 ms
    (each replica must only ever go up), and a guest-like client that long-polls the
    replicas in turn with ``wait=`` the number it holds, as a guest moved between
    replicas by the Service does. A lagging replica may answer a timed-out long-poll
    below that number (the guest ignores it and asks again); two such answers in a row
    would make a guest believe it (docs/guest-agent.md), so those are counted."""

    def __init__(self) -> None:
        self.agents: list[RunningAgent] = []
        self.per_replica: dict[str, list[int]] = {}
        self.answers: list[tuple[str, int, int]] = []  # (replica, held, answered)

    async def sample(self) -> None:
        while True:
            for a in list(self.agents):
                g = served(a)
                seen = self.per_replica.setdefault(a.agent.settings.identity, [])
                if g is not None and (not seen or seen[-1] != g):
                    seen.append(g)
            await asyncio.sleep(0.01)

    async def guest(self) -> None:
        held, turn = 0, 0
        async with httpx.AsyncClient(timeout=5) as client:
            while True:
                live = [a for a in self.agents if a.agent.address is not None]
                if not live:
                    await asyncio.sleep(0.05)
                    continue
                a = live[turn % len(live)]
                turn += 1
                host, port = a.agent.address  # type: ignore[misc]
                try:
                    r = await client.get(f"http://{host}:{port}/v1/ensembles/{ENS.key}",
                                         params={"wait": held, "timeout": 0.5})
                except httpx.HTTPError:
                    continue  # a replica stopping: the guest asks the next one
                if r.status_code != 200:
                    await asyncio.sleep(0.05)
                    continue
                g = int(r.json()["generation"])
                self.answers.append((a.agent.settings.identity, held, g))
                held = max(held, g)

    def backwards(self) -> list[str]:
        out = [f"{who}: {seen}" for who, seen in self.per_replica.items()
               if seen != sorted(seen)]
        below = [g < held for _, held, g in self.answers]
        out += [f"believed {self.answers[i + 1]}" for i in range(len(below) - 1)
                if below[i] and below[i + 1]]
        return out


@contextlib.asynccontextmanager
async def watching() -> AsyncIterator[Watcher]:
    w = Watcher()
    tasks = [asyncio.create_task(w.sample()), asyncio.create_task(w.guest())]
    try:
        yield w
    finally:
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert len(w.answers) >= 3, "the guest-like client got answers"


async def replicas(start_agent: AgentFactory, n: int, prefix: str) -> list[RunningAgent]:
    agents = [await start_agent(identity=f"{prefix}{i}", **ELECT) for i in range(n)]
    for a in agents:
        await a.settled(20)
    await eventually(lambda: len(leaders(agents)) == 1, 15, "one leader")
    return agents


def setup(api: KubeApiHandle) -> None:
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    for i in range(3):
        api.put(vmi(f"gb200-{i}", namespace=NS, ip=f"10.244.0.{i + 1}"))


async def test_a_cr_keeps_its_generation_in_status_and_every_replica_serves_it(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup(api)
    api.put(cr())
    async with watching() as w:
        agents = await replicas(start_agent, 2, "r")
        w.agents += agents
        (leader,) = leaders(agents)
        (follower,) = [a for a in agents if a is not leader]
        st = await eventually(lambda: status(api).get("membersPublished") == 3 and status(api),
                              20, "the status")
        gen = st["membershipGeneration"]
        assert {m["index"]: m["ip"] for m in st["members"]} == {
            0: "10.244.0.1", 1: "10.244.0.2", 2: "10.244.0.3"}
        assert all(m["since"].endswith("Z") for m in st["members"])
        await eventually(lambda: served(follower) == gen == served(leader), 10, "both serve it")
        assert annotation(api) is None  # the pair is in the status only
        before = api.writes("imexensembles")
        api.put(vmi("gb200-1", namespace=NS, ip="10.244.0.42"))
        await eventually(lambda: status(api).get("membershipGeneration") == gen + 1, 10,
                         "the next generation in status")
        await eventually(lambda: served(follower) == gen + 1 == served(leader), 10,
                         "served by both")
        assert pins(follower)[1] == "10.244.0.42" == pins(leader)[1]
        # the new pair and the rest of the status: one write
        assert api.writes("imexensembles") - before == 1
        assert annotation(api) is None
        snap_l, snap_f = leader.agent.state.get(ENS), follower.agent.state.get(ENS)
        assert snap_l is not None and snap_f is not None
        assert [p.since for p in snap_l.members] == [p.since for p in snap_f.members]
        assert follower.agent.metrics.membership_writes.labels("ok")._value.get() == 0
        assert follower.agent.metrics.status_writes.labels("written")._value.get() == 0
        # a leader that stops: the other one carries on from the status
        await leader.stop()
        w.agents.remove(leader)
        await eventually(lambda: leaders([follower]), 10, "the follower leads")
        api.put(vmi("gb200-2", namespace=NS, ip="10.244.0.43"))
        await eventually(lambda: served(follower) == gen + 2, 15, "its own next generation")
        assert status(api)["membershipGeneration"] == gen + 2
    assert w.backwards() == []


async def orphan(api: KubeApiHandle) -> None:
    async with httpx.AsyncClient(timeout=5) as client:
        r = await client.request(
            "DELETE", f"{api.url}/apis/imex-ensemble.io/v1alpha1/namespaces/{NS}/imexensembles"
            "/gb200", headers={"Authorization": f"Bearer {api.token}"},
            json={"propagationPolicy": "Orphan"})
        assert r.status_code == 200, r.text


async def test_switching_between_annotation_and_status_never_goes_backwards(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    setup(api)
    api.put(service("gb200", namespace=NS, annotations={
        "imex-ensemble.io/max-members": "4", "imex-ensemble.io/token-sha256": TOKEN_SHA}))
    async with watching() as w:
        agents = await replicas(start_agent, 2, "s")
        w.agents += agents
        pair = await eventually(lambda: annotation(api), 10, "the annotation pair")
        await eventually(lambda: all(served(a) == pair.generation for a in agents), 10,
                         "served")
        slice_writes = api.writes("endpointslices")
        # a CR adopts the Service: its pair moves into the status, same number
        api.put(cr())
        await eventually(lambda: status(api).get("membershipGeneration") == pair.generation,
                         20, "the pair in status")
        await eventually(lambda: annotation(api) is None, 10, "the annotation removed")
        assert [served(a) for a in agents] == [pair.generation] * 2  # no guest woke up
        assert api.writes("endpointslices") == slice_writes
        api.put(vmi("gb200-0", namespace=NS, ip="10.244.0.50"))
        await eventually(lambda: all(served(a) == pair.generation + 1 for a in agents), 15,
                         "the next one, from the status")
        assert status(api)["membershipGeneration"] == pair.generation + 1
        assert annotation(api) is None
        # back to Service-only: the CR deleted with --cascade=orphan
        await orphan(api)
        await eventually(lambda: not api.get(*SVC, "gb200", NS)["metadata"].get(
            "ownerReferences"), 10, "the Service orphaned")
        again = await eventually(lambda: annotation(api), 15, "a Service pair again")
        assert again.generation > pair.generation + 1
        await eventually(lambda: all(served(a) == again.generation for a in agents), 10,
                         "served")
        # every replica restarted: the numbers still only grow
        for a in agents:
            await a.stop()
            w.agents.remove(a)
        fresh = await replicas(start_agent, 2, "n")
        w.agents += fresh
        api.put(vmi("gb200-0", namespace=NS, ip="10.244.0.51"))
        await eventually(lambda: all((served(a) or 0) > again.generation for a in fresh), 15,
                         "after a restart of every replica")
    assert w.backwards() == []
