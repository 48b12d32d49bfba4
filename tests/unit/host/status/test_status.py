"""The ImexEnsemble status as a pure function: byte for byte, and its transitions."""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace
from typing import Any

from host_agent.ensembles.cr_spec import Declaration, parse_ensemble_cr
from host_agent.state.snapshot import Absent, CaPublished, GuestReport
from host_agent.state.store import State
from host_agent.status.status import desired_status, next_change, status_in_sync
from imex_shared.model import EnsembleId, Member
from tests.host_support.ensembles import CR_UID, imex_ensemble

ENS = EnsembleId("rack1", "gb200")
T0 = 1_796_000_000.0  # 2026-11-30T00:53:20Z
STALE = 120.0


def spec(**fields: Any) -> Any:
    s = parse_ensemble_cr(imex_ensemble(**fields)).spec
    assert s is not None
    return replace(s, uid="svc-uid")


def decl(**kw: Any) -> Declaration:
    base: dict[str, Any] = {"namespace": "rack1", "name": "gb200", "uid": CR_UID,
                            "generation": 2, "spec": spec(maxMembers=4)}
    base.update(kw)
    return Declaration(**base)


def snapshot(members: int = 3, reports: dict[int, tuple[str, int | None, float]] | None = None,
             absent: tuple[Absent, ...] = (), problems: tuple[str, ...] = (),
             ca: CaPublished | None = None) -> Any:
    state = State(clock=lambda: T0)
    ms = [Member(i, f"10.0.0.{i + 1}", vmi=f"gb200-{i}", node=f"node-{i}", phase="Running",
                 ready=True) for i in range(members)]
    snap, _ = state.set(spec(maxMembers=4), ms, problems, ca=ca, absent=absent)
    for i, (imex, gen, at) in (reports or {}).items():
        fields = {"imex_state": imex,
                  "generation_applied": snap.generation if gen == -1 else gen}
        snap = state.report(ENS, i, GuestReport(at, f"10.0.0.{i + 1}", fields))
    return snap


def ready_all(n: int = 3, at: float = T0) -> dict[int, tuple[str, int | None, float]]:
    return {i: ("READY", -1, at) for i in range(n)}


def conditions(status: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """Ready, Degraded and Published by type (DomainUp, GuestChecks and CliqueShared have
    tests of their own)."""
    return {c["type"]: (c["status"], c["reason"]) for c in status["conditions"]
            if c["type"] not in ("DomainUp", "GuestChecks", "CliqueShared")}


def test_a_ready_ensemble_byte_for_byte() -> None:
    snap = snapshot(reports=ready_all())
    status = desired_status(decl(), snap, T0 + 5, STALE)
    gen = snap.generation
    member = {"imexState": "READY", "generationApplied": gen, "phase": "Running", "ready": True}
    expected = {
        "observedGeneration": 2,
        "domainID": ENS.domain_id,
        "membershipGeneration": gen,
        "publishedSummary": "3/4",
        "membersPublished": 3,
        "imexReady": 3,
        "cliquesSplit": False,
        "members": [{"index": i, "slot": ENS.slot(i), "ip": f"10.0.0.{i + 1}",
                     "vmi": f"gb200-{i}", "node": f"node-{i}",
                     "since": "2026-11-30T00:53:20.000Z", **member} for i in range(3)],
        "conditions": [
            {"type": "Ready", "status": "True", "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:25Z", "reason": "AllMembersReady",
             "message": f"all 3 published members report IMEX READY at generation {gen}"},
            {"type": "Degraded", "status": "False", "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:25Z", "reason": "AsExpected",
             "message": "no problems"},
            {"type": "Published", "status": "True", "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:25Z", "reason": "EndpointsPublished",
             "message": "3 of 4 slots published (EndpointSlice gb200-imex)"},
            # issue 17: these reports carry no nvidia-imex-ctl -N -j view to judge links by
            {"type": "DomainUp", "status": "Unknown", "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:25Z", "reason": "ReportsMissing",
             "message": "members 0-2 report no nvidia-imex-ctl -N -j view"},
            # issue 28: no preflight reported; no clique reported, so none shared
            {"type": "GuestChecks", "status": "Unknown", "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:25Z", "reason": "NoChecksReported",
             "message": "no member has reported its preflight checks yet"},
            {"type": "CliqueShared", "status": "False", "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:25Z", "reason": "NotShared",
             "message": "no other ensemble's members report this ensemble's NVLink cliques"},
        ],
        "domainStatus": "UNKNOWN",
        "problems": [],
    }
    assert json.dumps(status, sort_keys=True, indent=1) == json.dumps(expected, sort_keys=True,
                                                                      indent=1)


def test_last_transition_time_moves_only_with_the_status() -> None:
    snap = snapshot(reports=ready_all())
    first = desired_status(decl(), snap, T0 + 5, STALE)
    later = desired_status(decl(), snap, T0 + 50, STALE, previous=first)
    assert later == first  # nothing changed: byte-identical, so no write
    crashed = snapshot(reports=ready_all(), absent=(Absent("gb200-3", 3, "Failed",
                                                           "MemberNotRunning"),))
    after = desired_status(decl(), crashed, T0 + 60, STALE, previous=first)
    times = {c["type"]: c["lastTransitionTime"] for c in after["conditions"]}
    assert times["Ready"] == "2026-11-30T00:54:20Z" != first["conditions"][0]["lastTransitionTime"]
    assert times["Published"] == first["conditions"][2]["lastTransitionTime"]


def test_a_crashed_member_makes_ready_false_and_degraded() -> None:
    snap = snapshot(reports=ready_all(), absent=(Absent("gb200-3", 3, "Failed",
                                                        "MemberNotRunning"),))
    status = desired_status(decl(), snap, T0 + 5, STALE)
    assert conditions(status) == {"Ready": ("False", "MemberNotRunning"),
                                  "Degraded": ("True", "MemberNotRunning"),
                                  "Published": ("True", "EndpointsPublished")}
    assert status["conditions"][0]["message"] == (
        "VMIs without a published slot: gb200-3 (slot 3, Failed): MemberNotRunning")


def test_reasons_in_order_of_telling() -> None:
    absent = (Absent("gb200-9", None, "Running", "IndexOutOfRange"),
              Absent("gb200-2", 2, "Running", "DuplicateIndex"),
              Absent("gb200-x", None, "Pending", "NoIndex"))
    status = desired_status(decl(), snapshot(reports=ready_all(), absent=absent), T0, STALE)
    assert conditions(status)["Ready"] == ("False", "DuplicateIndex")
    no_addr = (Absent("gb200-3", 3, "Running", "NoAddress"),)
    status = desired_status(decl(), snapshot(reports=ready_all(), absent=no_addr), T0, STALE)
    assert conditions(status)["Degraded"] == ("True", "NoAddress")


def test_guest_silent_past_the_stale_time() -> None:
    reports = {0: ("READY", -1, T0), 1: ("READY", -1, T0 - 200), 2: ("READY", -1, T0)}
    status = desired_status(decl(), snapshot(reports=reports), T0 + 1, STALE)
    assert conditions(status)["Ready"] == ("False", "GuestSilent")
    assert conditions(status)["Degraded"] == ("True", "GuestSilent")
    assert [m["imexState"] for m in status["members"]] == ["READY", "GuestSilent", "READY"]
    assert status["imexReady"] == 2
    assert status["conditions"][0]["message"] == "no report from slot 1 for more than 120 s"


def test_not_ready_guests_and_generation_lag() -> None:
    reports = {0: ("READY", -1, T0), 1: ("WAITING_FOR_PEERS", -1, T0), 2: ("READY", 7, T0)}
    snap = snapshot(reports=reports)
    status = desired_status(decl(), snap, T0 + 1, STALE)
    assert conditions(status)["Ready"] == ("False", "GuestNotReady")
    assert status["conditions"][0]["message"] == (
        f"slot 1: IMEX WAITING_FOR_PEERS; slot 2: applied generation 7, current "
        f"{snap.generation}")
    assert conditions(status)["Degraded"] == ("True", "GuestNotReady")
    # lagging on the generation only is catching up, not degraded
    lagging = desired_status(decl(), snapshot(reports={**ready_all(), 2: ("READY", 7, T0)}),
                             T0 + 1, STALE)
    assert conditions(lagging) == {"Ready": ("False", "GuestNotReady"),
                                   "Degraded": ("False", "AsExpected"),
                                   "Published": ("True", "EndpointsPublished")}
    unreported = desired_status(decl(), snapshot(reports={0: ("READY", -1, T0)}), T0, STALE)
    assert "slot 1: no report yet; slot 2: no report yet" in unreported["conditions"][0]["message"]
    assert [m["imexState"] for m in unreported["members"]] == ["READY", "", ""]
    assert "generationApplied" not in unreported["members"][1]


def test_not_published_shows_the_refusal() -> None:
    message = "Service rack1/gb200 exists and is not labelled imex-ensemble.io/ensemble=gb200"
    d = decl(spec=None, refusals=(("ServiceConflict", message),))
    status = desired_status(d, None, T0, STALE, declared_max=4)
    assert status == {
        "observedGeneration": 2, "domainID": ENS.domain_id, "publishedSummary": "0/4",
        "membersPublished": 0, "imexReady": 0, "members": [],
        "conditions": [
            {"type": t, "status": v, "observedGeneration": 2,
             "lastTransitionTime": "2026-11-30T00:53:20Z", "reason": "ServiceConflict",
             "message": message}
            for t, v in (("Ready", "False"), ("Degraded", "True"), ("Published", "False"))]
        + [{"type": "DomainUp", "status": "Unknown", "observedGeneration": 2,
            "lastTransitionTime": "2026-11-30T00:53:20Z", "reason": "ReportsMissing",
            "message": message},
           {"type": "GuestChecks", "status": "Unknown", "observedGeneration": 2,
            "lastTransitionTime": "2026-11-30T00:53:20Z", "reason": "NotPublished",
            "message": "the ensemble is not published"},
           {"type": "CliqueShared", "status": "False", "observedGeneration": 2,
            "lastTransitionTime": "2026-11-30T00:53:20Z", "reason": "NotShared",
            "message": "the ensemble is not published"}],
        "domainStatus": "UNKNOWN",
        "problems": [message],
    }


def test_conflict_fallback_is_published_and_degraded() -> None:
    message = "Service rack1/gb200 is controlled by Deployment x"
    d = decl(refusals=(("ServiceConflict", message),))
    snap = snapshot(reports=ready_all(), problems=(message,))
    status = desired_status(d, snap, T0, STALE)
    assert conditions(status) == {"Ready": ("True", "AllMembersReady"),
                                  "Degraded": ("True", "ServiceConflict"),
                                  "Published": ("True", "EndpointsPublished")}
    assert status["conditions"][2]["message"].endswith(
        "; from Service gb200 as it is (ServiceConflict)")
    assert status["problems"] == [message]


def test_no_members_and_other_problems() -> None:
    status = desired_status(decl(), snapshot(members=0, problems=("bad port",)), T0, STALE)
    assert conditions(status) == {"Ready": ("False", "NoMembers"),
                                  "Degraded": ("True", "Problem"),
                                  "Published": ("False", "NoMembers")}
    assert status["problems"] == ["bad port"]


def test_problems_and_messages_are_clipped_to_the_schema() -> None:
    status = desired_status(decl(), snapshot(problems=tuple("p" * 2000 + str(i)
                                                           for i in range(100))), T0, STALE)
    assert len(status["problems"]) == 64
    assert all(len(p) == 1024 and p.endswith("…") for p in status["problems"])
    assert all(len(c["message"]) <= 32768 for c in status["conditions"])


def test_ca_digest_is_published() -> None:
    snap = snapshot(ca=CaPublished(sha256="c" * 64, bundle_sha256="d" * 64))
    assert desired_status(decl(), snap, T0, STALE)["caSHA256"] == "c" * 64


def test_next_change_is_the_next_report_going_stale() -> None:
    snap = snapshot(reports={0: ("READY", -1, T0), 1: ("READY", -1, T0 + 30),
                             2: ("READY", -1, T0 - 500)})
    assert next_change(snap, T0 + 10, STALE) == T0 + STALE
    assert next_change(snap, T0 + STALE + 1, STALE) == T0 + 30 + STALE
    assert next_change(snap, T0 + 1000, STALE) is None
    assert next_change(None, T0, STALE) is None


def test_in_sync_ignores_what_others_write_but_not_ours() -> None:
    desired = desired_status(decl(), snapshot(reports=ready_all()), T0, STALE)
    observed = json.loads(json.dumps(desired))
    observed["members"][0]["clique"] = "uuid.1"
    assert status_in_sync(desired, observed)
    observed["domainStatus"] = "UP"  # ours since issue 17: a difference to write
    assert not status_in_sync(desired, observed)
    observed["domainStatus"] = desired["domainStatus"]
    observed["members"].append({"index": 3, "slot": "x"})
    assert not status_in_sync(desired, observed)
    observed["members"].pop()
    observed["conditions"][0]["status"] = "False"
    assert not status_in_sync(desired, observed)
    assert not status_in_sync(desired, None)



def test_domain_up_and_domain_status_follow_the_domain_view() -> None:
    from host_agent.state.snapshot import GuestReport

    snap = snapshot(reports=ready_all())
    state_links = {i: tuple(None if j == i else "CONNECTED" for j in range(3)) for i in range(3)}
    reports = {i: GuestReport(r.received_at, r.from_ip, r.fields, state_links[i])
               for i, r in snap.reports.items()}
    up = dataclasses.replace(snap, reports=reports)
    status = desired_status(decl(), up, T0 + 5, STALE)
    (cond,) = [c for c in status["conditions"] if c["type"] == "DomainUp"]
    assert status["domainStatus"] == "UP"
    assert (cond["status"], cond["reason"]) == ("True", "AllLinksConnected")
    lost = dict(reports)
    lost[1] = GuestReport(reports[1].received_at, reports[1].from_ip, reports[1].fields,
                          ("CONNECTED", None, "DISCONNECTED"))
    later = desired_status(decl(), dataclasses.replace(snap, reports=lost), T0 + 50, STALE,
                           previous=status)
    (cond2,) = [c for c in later["conditions"] if c["type"] == "DomainUp"]
    assert later["domainStatus"] == "DEGRADED"
    assert (cond2["status"], cond2["reason"], cond2["message"]) == (
        "False", "LinksMissing", "1 links not CONNECTED: 1->2")
    assert cond2["lastTransitionTime"] != cond["lastTransitionTime"]  # it moved


def test_an_events_only_evaluation_tells_the_events_what_the_whole_one_does() -> None:
    """issue 27: a Service-only ensemble's evaluation (nothing writes it, only the Events
    read it) skips the domain view and the members' since; every fact an Event is decided
    from is the same as the whole evaluation's."""
    from host_agent.status.events import facts_of
    from host_agent.status.status import Evaluation

    svc = decl(kind="Service", uid="svc-uid", generation=0)
    absent = (Absent("gb200-3", 3, "Pending", "MemberNotRunning"),)
    for snap in (snapshot(reports=ready_all()), snapshot(absent=absent),
                 snapshot(reports={0: ("READY", -1, T0), 1: ("DOWN", -1, T0)},
                          problems=("VMI gb200-9 has no address",)),
                 snapshot(reports=ready_all(at=T0 - 500))):
        whole = desired_status(svc, snap, T0, STALE)
        lean = desired_status(svc, snap, T0, STALE, events_only=True)
        assert "domainStatus" not in lean and all("since" not in m for m in lean["members"])
        assert facts_of(Evaluation(svc, snap, lean, T0)) == \
            facts_of(Evaluation(svc, snap, whole, T0))
        assert [c for c in whole["conditions"] if c["type"] != "DomainUp"] == \
            lean["conditions"]
