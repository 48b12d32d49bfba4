"""ImexEnsembles end to end against the API double (real lightkube client, real HTTP).

The double serves the CRD from manifests/base as the apiextensions apiserver does
(defaults, the status subresource, list-map server-side apply), garbage-collects by
ownerReference, and counts writes per resource: so "one write per second per
ensemble", "no write when nothing changed" and "adoption rewrites no slice" are
measured at the API. Guest reports are real HTTP PUTs to the agent's registry,
through the trusted-proxy path (the test runs on loopback).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import time
from typing import Any

import httpx
import pytest

from host_agent.registry import views
from imex_shared.model import EnsembleId
from tests.host_support.ensembles import status_vs_registry
from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS, AgentFactory, RunningAgent
from tests.integration.host.conftest import eventually as _eventually
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(90)

CR = ("imex-ensemble.io/v1alpha1", "ImexEnsemble")
SVC = ("v1", "Service")
SLICES = ("discovery.k8s.io/v1", "EndpointSlice")
EVENTS = ("events.k8s.io/v1", "Event")
TOKEN = "guest-token-1"
TOKEN_SHA = hashlib.sha256(TOKEN.encode()).hexdigest()
ENS = EnsembleId(NS, "gb200")


async def eventually(check: Any, timeout: float = 30.0, what: str = "condition") -> Any:
    """Generous: these waits span several status evaluations on a shared machine."""
    return await _eventually(check, timeout, what)


def cr(name: str = "gb200", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": CR[0], "kind": CR[1], "metadata": {"name": name, "namespace": NS},
            "spec": {"tokenSHA256": TOKEN_SHA, **spec}}


def status(api: KubeApiHandle, name: str = "gb200") -> dict[str, Any]:
    return api.get(*CR, name, NS).get("status") or {}


def condition(st: dict[str, Any], ctype: str) -> tuple[str, str] | None:
    for c in st.get("conditions") or ():
        if c["type"] == ctype:
            return c["status"], c["reason"]
    return None


def events(api: KubeApiHandle, kind: str = "ImexEnsemble", name: str = "gb200"
           ) -> list[dict[str, Any]]:
    return sorted((e for e in api.list(*EVENTS, NS)
                   if e["regarding"]["kind"] == kind and e["regarding"]["name"] == name),
                  key=lambda e: e["eventTime"])


def reasons(api: KubeApiHandle, **kw: Any) -> list[str]:
    return [e["reason"] for e in events(api, **kw)]


async def report(agent: RunningAgent, index: int, ip: str, state: str = "READY",
                 name: str = "gb200", generation: int | None = None) -> None:
    snap = agent.agent.state.get(EnsembleId(NS, name))
    assert snap is not None and agent.agent.address is not None
    host, port = agent.agent.address
    async with httpx.AsyncClient(trust_env=False) as client:
        r = await client.put(
            f"http://{host}:{port}/v1/ensembles/{NS}/{name}/members/{index}/status",
            headers={"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": ip},
            json={"imex_state": state, "generation_applied":
                  snap.generation if generation is None else generation},
            timeout=5)
    assert r.status_code == 200, r.text


def registry(agent: RunningAgent, name: str = "gb200") -> dict[str, Any]:
    """The registry's JSON, rendered by the registry's own view from the same snapshot
    its HTTP route uses (a blocking HTTP GET would stall the agent's loop: same thread)."""
    snap = agent.agent.state.get(EnsembleId(NS, name))
    if snap is None:
        return {}
    return views.ensemble_json(snap, time.time(), agent.agent.settings.report_stale_after)


async def start(start_agent: AgentFactory, api: KubeApiHandle) -> RunningAgent:
    # the agent stores guest reports in ConfigMaps of its own namespace
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    agent = await start_agent(trusted_proxies=("127.0.0.0/8",), report_stale_after=30.0,
                              identity="agent-0")
    await agent.settled()
    return agent


async def test_a_cr_gets_its_service_slices_status_and_events(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(cr(maxMembers=4))
    for i in range(3):
        api.put(vmi(f"gb200-{i}", namespace=NS, ip=f"10.244.0.{i + 1}"))
    agent = await start(start_agent, api)
    svc = await eventually(lambda: api.get(*SVC, "gb200", NS), what="the owned Service")
    owner = api.get(*CR, "gb200", NS)
    assert svc["metadata"]["ownerReferences"] == [{
        "apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble", "name": "gb200",
        "uid": owner["metadata"]["uid"], "controller": True, "blockOwnerDeletion": True}]
    assert svc["metadata"]["labels"]["imex-ensemble.io/ensemble"] == "gb200"
    assert svc["metadata"]["annotations"]["imex-ensemble.io/max-members"] == "4"
    assert svc["spec"]["clusterIP"] == "None" and "selector" not in svc["spec"]
    sl = await eventually(lambda: {s["metadata"]["name"]: s for s in api.list(*SLICES, NS)}
                          .get("gb200-imex"), what="the slice")
    assert sl["metadata"]["ownerReferences"][0]["uid"] == svc["metadata"]["uid"]
    assert len(sl["endpoints"]) == 3

    st = await eventually(lambda: status(api).get("membersPublished") == 3 and status(api),
                          what="first status")
    assert st["publishedSummary"] == "3/4" and st["domainID"] == ENS.domain_id
    assert st["observedGeneration"] == owner["metadata"]["generation"]
    assert [m["imexState"] for m in st["members"]] == ["", "", ""]
    assert condition(st, "Ready") == ("False", "GuestNotReady")
    assert condition(st, "Published") == ("True", "EndpointsPublished")
    await agreed(api, agent)  # the guests report the generation the registry serves
    for i in range(3):
        await report(agent, i, f"10.244.0.{i + 1}")
    st = await eventually(lambda: condition(status(api), "Ready") == ("True", "AllMembersReady")
                          and status(api), what="Ready")
    assert st["imexReady"] == 3
    assert [m["imexState"] for m in st["members"]] == ["READY"] * 3
    assert {m["generationApplied"] for m in st["members"]} == {registry(agent)["generation"]}
    await agreed(api, agent)
    said = await eventually(lambda: {"ServiceCreated", "MemberJoined", "Ready"} <=
                            set(reasons(api)) and events(api), what="Events")
    for e in said:
        assert e["reportingController"] == "imex-ensemble.io/host-agent"
        assert e["reportingInstance"] == "agent-0"
        assert e["regarding"]["uid"] == owner["metadata"]["uid"]
        assert "deprecatedCount" not in e


async def agreed(api: KubeApiHandle, agent: RunningAgent) -> dict[str, Any]:
    """The status once the registry serves what it says: a new membership is written to
    the status first and served once the API has answered (issue 16), so the double can
    show it a moment before the agent's registry does."""
    def check() -> dict[str, Any] | None:
        st = status(api)
        try:
            return st if status_agrees_with_registry(st, registry(agent)) else None
        except (AssertionError, KeyError):
            return None
    got: dict[str, Any] = await eventually(check, 10, "status == registry JSON")
    return got


def status_agrees_with_registry(st: dict[str, Any], doc: dict[str, Any]) -> bool:
    """The CR's status says what the registry's JSON says."""
    assert status_vs_registry(st, doc) == []
    return True


async def test_a_boot_storm_costs_at_most_two_status_writes(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(cr(maxMembers=18))
    for i in range(18):
        api.put(vmi(f"gb200-{i}", namespace=NS, ip=f"10.244.1.{i + 1}"))
    agent = await start(start_agent, api)
    await eventually(lambda: status(api).get("membersPublished") == 18, what="18 published")
    await agreed(api, agent)  # the guests report the generation the registry serves
    await eventually(lambda: agent.agent.status is not None and
                     agent.agent.status.pending() <= 1, what="status writer idle")
    before = api.writes("imexensembles")
    t0 = time.monotonic()
    await asyncio.gather(*(report(agent, i, f"10.244.1.{i + 1}") for i in range(18)))
    took = time.monotonic() - t0
    await eventually(lambda: status(api).get("imexReady") == 18, what="all READY")
    # at most one write a second: 2 when the 18 reports land within one second
    assert api.writes("imexensembles") - before <= 1 + math.ceil(took), took
    if took < 1.0:
        assert api.writes("imexensembles") - before <= 2
    # the same reports again: nothing to write
    quiet = api.writes("imexensembles")
    for i in range(18):
        await report(agent, i, f"10.244.1.{i + 1}")
    await eventually(lambda: agent.agent.status is not None and
                     agent.agent.status.pending() <= 1, what="evaluated")
    assert api.writes("imexensembles") == quiet
    joined = [e for e in events(api) if e["reason"] == "MemberJoined"]
    assert 1 <= len(joined) <= 3  # one per evaluation, not one per VMI or pass


async def test_adoption_keeps_service_uid_slices_and_generation(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(service("gb200", namespace=NS, annotations={
        "imex-ensemble.io/max-members": "4", "imex-ensemble.io/token-sha256": TOKEN_SHA}))
    agent = await start(start_agent, api)
    await eventually(lambda: registry(agent) and agent.agent.status is not None
                     and agent.agent.status.evaluations > 0, what="the Service-only ensemble")
    for i in range(2):
        api.put(vmi(f"gb200-{i}", namespace=NS, ip=f"10.244.2.{i + 1}"))
    await eventually(lambda: len(registry(agent).get("members", [])) == 2, what="published")
    before = registry(agent)
    svc_uid = api.get(*SVC, "gb200", NS)["metadata"]["uid"]
    slice_writes = api.writes("endpointslices")
    await eventually(lambda: "MemberJoined" in reasons(api, kind="Service"),
                     what="Events on the hand-made Service")
    api.put(cr(maxMembers=4))
    svc = await eventually(lambda: (api.get(*SVC, "gb200", NS)["metadata"]
                                    .get("ownerReferences") and api.get(*SVC, "gb200", NS)),
                           what="adopted")
    assert svc["metadata"]["uid"] == svc_uid
    await eventually(lambda: "ServiceAdopted" in reasons(api), what="ServiceAdopted Event")
    after = registry(agent)
    assert after["generation"] == before["generation"]  # no guest wakes up
    assert after["domain_id"] == before["domain_id"] == ENS.domain_id
    assert api.writes("endpointslices") == slice_writes  # the slice was already right
    st = await eventually(lambda: status(api).get("membersPublished") == 2 and status(api),
                          what="status")
    assert st["membershipGeneration"] == before["generation"]


async def test_a_foreign_service_leaves_the_cr_degraded_and_others_untouched(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    foreign = service("gb200", namespace=NS)
    del foreign["metadata"]["labels"]
    api.put(foreign)
    api.put(service("other", namespace=NS))
    api.put(vmi("other-0", namespace=NS, ensemble="other", ip="10.244.3.1"))
    api.put(vmi("gb200-0", namespace=NS, ip="10.244.3.2"))
    agent = await start(start_agent, api)
    await eventually(lambda: len(registry(agent, "other").get("members", [])) == 1,
                     what="the other ensemble")
    other_writes = api.writes("endpointslices")
    api.put(cr())
    st = await eventually(lambda: condition(status(api), "Degraded") == ("True",
                                                                          "ServiceConflict")
                          and status(api), what="Degraded")
    assert condition(st, "Published") == ("False", "ServiceConflict")
    assert "is not labelled imex-ensemble.io/ensemble=gb200" in st["problems"][0]
    await eventually(lambda: "ServiceConflict" in reasons(api), what="the Event")
    assert "labels" not in api.get(*SVC, "gb200", NS)["metadata"]  # left alone
    assert "gb200-imex" not in {s["metadata"]["name"] for s in api.list(*SLICES, NS)}
    assert api.writes("endpointslices") == other_writes


async def test_deleting_the_cr_takes_service_and_slices(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(cr())
    api.put(vmi("gb200-0", namespace=NS, ip="10.244.4.1"))
    agent = await start(start_agent, api)
    await eventually(lambda: "gb200-imex" in {s["metadata"]["name"]
                                              for s in api.list(*SLICES, NS)}, what="slice")
    api.delete(*CR, "gb200", NS)
    await eventually(lambda: not any(s["metadata"]["name"] == "gb200" for s in api.list(*SVC, NS))
                     and not api.list(*SLICES, NS), what="garbage collection")
    await eventually(lambda: agent.agent.state.get(ENS) is None, what="ensemble dropped")


async def test_crash_and_rejoin_flip_ready_and_tell_the_story(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(cr(maxMembers=3))
    for i in range(3):
        api.put(vmi(f"gb200-{i}", namespace=NS, ip=f"10.244.5.{i + 1}"))
    agent = await start(start_agent, api)
    await eventually(lambda: status(api).get("membersPublished") == 3, what="published")
    await agreed(api, agent)  # the guests report the generation the registry serves
    for i in range(3):
        await report(agent, i, f"10.244.5.{i + 1}")
    await eventually(lambda: condition(status(api), "Ready") == ("True", "AllMembersReady"),
                     what="Ready")
    api.put(vmi("gb200-1", namespace=NS, ip="10.244.5.2", phase="Failed", ready=False))
    st = await eventually(lambda: condition(status(api), "Ready") == ("False",
                                                                      "MemberNotRunning")
                          and status(api), what="Ready lost")
    assert sorted(m["index"] for m in st["members"]) == [0, 2]
    await agreed(api, agent)
    api.delete(*("kubevirt.io/v1", "VirtualMachineInstance"), "gb200-1", NS)
    api.put(vmi("gb200-1", namespace=NS, ip="10.244.5.22"))
    await eventually(lambda: status(api).get("membersPublished") == 3, what="rejoined")
    await agreed(api, agent)  # the guests report the generation the registry serves
    for i, ip in ((0, "10.244.5.1"), (1, "10.244.5.22"), (2, "10.244.5.3")):
        await report(agent, i, ip)
    st = await eventually(lambda: condition(status(api), "Ready") == ("True", "AllMembersReady")
                          and status(api), what="Ready regained")
    await agreed(api, agent)
    story = await eventually(lambda: "ReadyRegained" in reasons(api) and reasons(api),
                             what="the whole story")
    for word in ("MemberLeft", "ReadyLost", "MemberJoined", "ReadyRegained"):
        assert word in story, story
    left = next(e for e in events(api) if e["reason"] == "MemberLeft")
    assert left["type"] == "Warning" and "VMI Failed" in left["note"]


async def test_a_selector_reaching_for_another_ensemble_is_refused_and_harmless(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(service("other", namespace=NS))
    for i in range(2):
        api.put(vmi(f"other-{i}", namespace=NS, ensemble="other", ip=f"10.244.6.{i + 1}"))
    agent = await start(start_agent, api)
    await eventually(lambda: len(registry(agent, "other").get("members", [])) == 2,
                     what="the other ensemble")
    other_slice = next(s for s in api.list(*SLICES, NS) if s["metadata"]["name"] == "other-imex")
    api.put(cr(memberSelector={"matchLabels": {"imex-ensemble.io/ensemble": "other"}}))
    st = await eventually(lambda: condition(status(api), "Degraded") == ("True",
                                                                          "SelectorConflict")
                          and status(api), what="Degraded")
    assert "selects imex-ensemble.io/ensemble in (other)" in st["problems"][0]
    await eventually(lambda: "SelectorConflict" in reasons(api), what="the Event")
    assert not agent.task.done()  # the agent is still running
    same = next(s for s in api.list(*SLICES, NS) if s["metadata"]["name"] == "other-imex")
    assert same["metadata"]["resourceVersion"] == other_slice["metadata"]["resourceVersion"]
    assert "gb200-imex" not in {s["metadata"]["name"] for s in api.list(*SLICES, NS)}
    assert not any(s["metadata"]["name"] == "gb200" for s in api.list(*SVC, NS))
