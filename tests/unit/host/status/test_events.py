"""Which Events an ensemble's story gets (pure), and how repeats become a series."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from dataclasses import replace
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from host_agent.ensembles.cr_spec import Declaration, parse_ensemble_cr
from host_agent.metrics import HostMetrics
from host_agent.state.snapshot import Absent, GuestReport
from host_agent.state.store import State
from host_agent.status.events import (
    Facts,
    Intent,
    Regarding,
    decide,
    event_body,
    facts_of,
    problem_reason,
    series_patch,
    service_intent,
)
from host_agent.status.events_io import EventRecorder
from host_agent.status.status import Evaluation, desired_status
from imex_shared.model import EnsembleId, Member
from tests.host_support.ensembles import CR_UID, imex_ensemble
from tests.timing import measured

ENS = EnsembleId("rack1", "gb200")
T0 = 1_796_000_000.0
CR = Regarding("imex-ensemble.io/v1alpha1", "ImexEnsemble", "rack1", "gb200", CR_UID)


class Story:
    """An ensemble's evaluations as the status writer would make them."""

    def __init__(self, kind: str = "ImexEnsemble") -> None:
        self.state = State(clock=lambda: T0)
        spec = parse_ensemble_cr(imex_ensemble(maxMembers=4)).spec
        assert spec is not None
        self.spec = replace(spec, uid="svc-uid")
        self.kind = kind
        self.before: Facts | None = None

    def step(self, ips: dict[int, str], *, ready: bool = True,
             absent: tuple[Absent, ...] = (), problems: tuple[str, ...] = (),
             decl: Declaration | None = None) -> list[Intent]:
        members = [Member(i, ip, vmi=f"gb200-{i}", phase="Running", ready=True)
                   for i, ip in ips.items()]
        snap, _ = self.state.set(self.spec, members, problems, absent=absent)
        for i in ips:
            state = "READY" if ready else "WAITING_FOR_PEERS"
            snap = self.state.report(ENS, i, GuestReport(T0, "x", {
                "imex_state": state, "generation_applied": snap.generation}))
        d = decl or Declaration("rack1", "gb200", CR_UID if self.kind != "Service" else "svc-uid",
                                1, self.spec, kind=self.kind)  # type: ignore[arg-type]
        status = desired_status(d, snap, T0, 120.0)
        after = facts_of(Evaluation(d, snap, status, T0), self.before)
        out = decide(self.before, after)
        self.before = after
        return out


def said(intents: list[Intent]) -> list[tuple[str, str, str]]:
    return [(i.type, i.reason, i.note) for i in intents]


def test_boot_crash_rejoin_and_migration_tell_the_story() -> None:
    s = Story()
    assert said(s.step({})) == []  # first sight: nothing to compare with
    assert said(s.step({0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3", 3: "10.0.0.4"})) == [
        ("Normal", "MemberJoined", "4 members joined: 0 (gb200-0) at 10.0.0.1; 1 (gb200-1) at "
         "10.0.0.2; 2 (gb200-2) at 10.0.0.3; 3 (gb200-3) at 10.0.0.4"),
        ("Normal", "Ready", "all 4 published members report IMEX READY at generation "
         f"{s.state.get(ENS).generation}"),  # type: ignore[union-attr]
    ]
    crashed = (Absent("gb200-2", 2, "Failed", "MemberNotRunning"),)
    assert said(s.step({0: "10.0.0.1", 1: "10.0.0.2", 3: "10.0.0.4"}, absent=crashed)) == [
        ("Warning", "MemberLeft", "member 2 (gb200-2) left (was at 10.0.0.3; VMI Failed)"),
        ("Warning", "ReadyLost", "Ready is False: VMIs without a published slot: gb200-2 "
         "(slot 2, Failed): MemberNotRunning"),
    ]
    intents = s.step({0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.33", 3: "10.0.0.4"})
    assert said(intents)[0] == ("Normal", "MemberJoined",
                                "member 2 (gb200-2) joined at 10.0.0.33")
    assert said(intents)[1][:2] == ("Normal", "ReadyRegained")
    assert said(s.step({0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.33", 3: "10.0.0.40"})) == [
        ("Normal", "MemberIPChanged", "member 3 (gb200-3) moved from 10.0.0.4 to 10.0.0.40")]
    out = said(s.step({0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.33"}))  # scaled down
    assert out == [("Normal", "MemberLeft", "member 3 (gb200-3) left (was at 10.0.0.40; VMI "
                    "gone)")]
    out = said(s.step({0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.33"}, ready=False))
    assert [(t, r) for t, r, _ in out] == [("Warning", "ReadyLost")]
    assert out[0][2].startswith("Ready is False: slot 0: IMEX WAITING_FOR_PEERS")
    two = said(s.step({0: "10.0.0.1"}, ready=True))
    assert two[0] == ("Normal", "MemberLeft", "2 members left: 1 (gb200-1) (was at 10.0.0.2; "
                      "VMI gone); 2 (gb200-2) (was at 10.0.0.33; VMI gone)")


def test_nothing_new_nothing_said() -> None:
    s = Story()
    s.step({0: "10.0.0.1"})
    assert s.step({0: "10.0.0.1"}) == []
    assert s.step({0: "10.0.0.1"}) == []


def test_problems_are_said_when_they_appear_with_their_reason() -> None:
    s = Story()
    dup = "slot 1 is claimed by 2 live VMIs (gb200-1, gb200-1b); publishing neither until " \
        "only one is left"
    noaddr = "VMI gb200-3 has no IP address on network 'default' yet; not published"
    absent = (Absent("gb200-1", 1, "Running", "DuplicateIndex"),
              Absent("gb200-1b", 1, "Running", "DuplicateIndex"),
              Absent("gb200-3", 3, "Running", "NoAddress"))
    out = said(s.step({0: "10.0.0.1"}, absent=absent, problems=(dup, noaddr)))
    assert ("Warning", "DuplicateIndex", dup) in out
    assert ("Warning", "NoAddress", noaddr) in out
    assert [i for i in said(s.step({0: "10.0.0.1"}, absent=absent, problems=(dup, noaddr)))
            if i[0] == "Warning" and i[1] != "ReadyLost"] == []


def test_refusals_and_the_service_are_said() -> None:
    s = Story()
    conflict = Declaration("rack1", "gb200", CR_UID, 1, s.spec,
                           (("ServiceConflict", "Service rack1/gb200 is controlled by x"),))
    assert ("Warning", "ServiceConflict", "Service rack1/gb200 is controlled by x") in \
        said(s.step({}, decl=conflict))
    adopted = Declaration("rack1", "gb200", CR_UID, 1, s.spec, service_action="adopt",
                          service_wrote="apply")
    assert service_intent(adopted) == Intent(
        "Normal", "ServiceAdopted", "AdoptService", "adopted Service rack1/gb200: "
        "ownerReference added; the domain id and every slot name are unchanged, so no guest "
        "restarts IMEX")
    created = replace(adopted, service_action="create")
    assert service_intent(created) == Intent(
        "Normal", "ServiceCreated", "CreateService",
        "created Service rack1/gb200 (headless, owned by this ImexEnsemble)")
    assert service_intent(replace(adopted, service_action="own")) is None
    assert service_intent(replace(adopted, service_wrote=None)) is None


def test_a_service_only_ensemble_speaks_about_its_service() -> None:
    s = Story(kind="Service")
    s.step({})
    s.step({0: "10.0.0.1"})
    assert s.before is not None
    assert s.before.regarding == Regarding("v1", "Service", "rack1", "gb200", "svc-uid")


def test_problem_reason_matches_whole_names() -> None:
    absent = {"gb200-1": ("Running", "NoAddress"), "gb200-10": ("Running", "IndexOutOfRange")}
    assert problem_reason("VMI gb200-10 has slot 12, out of range", absent) == "IndexOutOfRange"
    assert problem_reason("VMI gb200-1 has no IP address", absent) == "NoAddress"
    assert problem_reason("annotation imex-ensemble.io/port='x'", absent) == "Problem"


def test_event_body_byte_for_byte() -> None:
    body = event_body(CR, Intent("Warning", "MemberLeft", "Unpublish", "x" * 2000),
                      "gb200.1", "imex-host-agent-7d9f", T0 + 0.123456)
    assert json.dumps(body, sort_keys=True) == json.dumps({
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": "gb200.1", "namespace": "rack1"},
        "eventTime": "2026-11-30T00:53:20.123456Z",
        "reportingController": "imex-ensemble.io/host-agent",
        "reportingInstance": "imex-host-agent-7d9f",
        "action": "Unpublish", "reason": "MemberLeft", "type": "Warning",
        "note": "x" * 1023 + "…",
        "regarding": {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                      "namespace": "rack1", "name": "gb200", "uid": CR_UID},
    }, sort_keys=True)
    assert series_patch(3, T0) == {"series": {"count": 3,
                                              "lastObservedTime": "2026-11-30T00:53:20.000000Z"}}
    assert not any(k.startswith("deprecated") for k in body)


class FakeEvents:
    def __init__(self) -> None:
        self.created: list[dict[str, Any]] = []
        self.patches: list[tuple[str, dict[str, Any]]] = []

    async def create_event(self, body: dict[str, Any]) -> dict[str, Any]:
        self.created.append(body)
        return body

    async def patch_event(self, namespace: str, name: str, patch: dict[str, Any]
                          ) -> dict[str, Any]:
        self.patches.append((name, patch))
        return patch


@contextlib.asynccontextmanager
async def recorder(**kw: Any) -> Any:
    api = FakeEvents()
    metrics = HostMetrics(CollectorRegistry())
    rec = EventRecorder(api, "agent-0", metrics, **kw)
    task = asyncio.create_task(rec.run())
    try:
        yield rec, api, metrics
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def drain(rec: EventRecorder) -> None:
    async with asyncio.timeout(5):
        while rec.pending():  # noqa: ASYNC110 - the queue offers no join here
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.02)


async def test_repeats_are_one_event_with_a_series_flushed_at_most_every_interval() -> None:
    async with recorder(series_flush=0.2) as (rec, api, _metrics):
        flap = Intent("Warning", "ReadyLost", "Evaluate", "Ready is False: slot 3: no report")
        t0 = time.monotonic()
        for n in range(6):
            rec.record(CR, flap, T0 + n)
            await asyncio.sleep(0.01)
        # the six come within one series_flush: measured max 0.12 s, 0.11 s beside
        # stress-ng (15 runs each, 2026-12-02)
        measured("host.events.flap_span", time.monotonic() - t0)
        await drain(rec)
        assert len(api.created) == 1 and api.created[0]["reason"] == "ReadyLost"
        assert "series" not in api.created[0]
        assert len(api.patches) <= 1  # the first repeat comes too soon after the create
        await asyncio.sleep(0.3)
        await drain(rec)
        name, patch = api.patches[-1]
        assert name == api.created[0]["metadata"]["name"]
        assert patch["series"]["count"] == 6
        assert patch["series"]["lastObservedTime"] == "2026-11-30T00:53:25.000000Z"
        assert len(api.patches) <= 2


async def test_a_flood_of_distinct_events_is_bounded_per_object() -> None:
    async with recorder(burst=5, refill=3600) as (rec, api, metrics):
        for n in range(40):
            rec.record(CR, Intent("Normal", "MemberJoined", "Publish", f"member {n} joined"),
                       T0 + n)
        await drain(rec)
        assert len(api.created) == 5
        assert metrics.events.labels("dropped")._value.get() == 35  # type: ignore[attr-defined]


@pytest.mark.parametrize("kind", ["ImexEnsemble", "Service"])
async def test_observe_records_what_decide_says(kind: str) -> None:
    async with recorder() as (rec, api, _):
        s = Story(kind=kind)
        for ips in ({}, {0: "10.0.0.1"}):
            members = [Member(i, ip, vmi=f"gb200-{i}", phase="Running", ready=True)
                       for i, ip in ips.items()]
            snap, _ = s.state.set(s.spec, members, [])
            uid = CR_UID if kind == "ImexEnsemble" else "svc-uid"
            d = Declaration("rack1", "gb200", uid, 1, s.spec, kind=kind)  # type: ignore[arg-type]
            rec.observe(Evaluation(d, snap, desired_status(d, snap, T0, 120.0), T0))
        await drain(rec)
        assert [e["reason"] for e in api.created] == ["MemberJoined"]
        assert api.created[0]["regarding"]["kind"] == kind
        assert api.created[0]["reportingInstance"] == "agent-0"


async def test_a_cluster_wide_storm_is_bounded_for_the_whole_agent() -> None:
    async with recorder(burst=25, global_burst=10, global_rate=0.001) as (rec, api, metrics):
        for n in range(50):  # fifty ensembles, one Event each
            other = Regarding("v1", "Service", "rack1", f"e{n}", f"uid-{n}")
            rec.record(other, Intent("Normal", "MemberIPChanged", "Publish", "moved"), T0)
        await drain(rec)
        assert len(api.created) == 10
        assert metrics.events.labels("dropped")._value.get() == 40  # type: ignore[attr-defined]
