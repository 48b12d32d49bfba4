"""GuestChecks and CliqueShared (issue 28): the conditions, the registry problem, the Event
and the metric's counts, from real State snapshots.

CliqueShared is informational: it never makes an ensemble Degraded or not Ready, and it
names the other ensemble only within one namespace.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from host_agent.ensembles.cr_spec import Declaration, parse_ensemble_cr
from host_agent.registry.guest_checks import check_counts, guest_checks
from host_agent.registry.views import all_problems
from host_agent.state.snapshot import EnsembleSnapshot, GuestReport
from host_agent.state.store import State
from host_agent.status.events import decide, facts_of
from host_agent.status.status import Evaluation, desired_status
from imex_shared.model import EnsembleId, Member
from tests.host_support.ensembles import CR_UID, imex_ensemble

T0 = 1_796_000_000.0
STALE = 120.0
UUID = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10"


def spec(ns: str, name: str) -> Any:
    s = parse_ensemble_cr(imex_ensemble(name=name, namespace=ns, maxMembers=4)).spec
    assert s is not None
    return replace(s, uid=f"svc-{ns}-{name}")


def decl(ens: EnsembleId) -> Declaration:
    return Declaration(namespace=ens.namespace, name=ens.name, uid=CR_UID, generation=1,
                       spec=spec(ens.namespace, ens.name))


def publish(state: State, ens: EnsembleId, net: int, n: int = 2) -> None:
    ms = [Member(i, f"10.{net}.0.{i + 1}", vmi=f"{ens.name}-{i}", phase="Running", ready=True)
          for i in range(n)]
    state.set(spec(ens.namespace, ens.name), ms, ())


def report(state: State, ens: EnsembleId, net: int, i: int, clique: int | None,
           checks: list[dict[str, str]] | None = None, at: float = T0 + 1) -> None:
    fields: dict[str, object] = {"imex_state": "READY", "generation_applied": 0}
    if clique is not None:
        fields["fabric"] = {"cluster_uuid": UUID, "clique_id": clique}
    if checks is not None:
        fields["preflight"] = checks
    state.report(ens, i, GuestReport(at, f"10.{net}.0.{i + 1}", fields))


def snap_of(state: State, ens: EnsembleId) -> EnsembleSnapshot:
    s = state.get(ens)
    assert s is not None
    return s


def cond(status: dict[str, Any], ctype: str) -> dict[str, Any]:
    [c] = [c for c in status["conditions"] if c["type"] == ctype]
    return c


A, B, C = EnsembleId("rack1", "a"), EnsembleId("rack1", "b"), EnsembleId("other", "c")


def test_two_ensembles_in_one_clique_get_the_condition_and_lose_it_when_one_moves() -> None:
    state = State(clock=lambda: T0)
    heard: list[EnsembleId] = []
    state.subscribe(heard.append)
    for net, ens in ((1, A), (2, B)):
        publish(state, ens, net)
    report(state, A, 1, 0, 7)
    report(state, A, 1, 1, None)  # no clique reported: never counted
    heard.clear()
    report(state, B, 2, 1, 7)
    assert set(heard) == {A, B}  # A hears of it too: its status is evaluated again
    a, b = snap_of(state, A), snap_of(state, B)
    assert a.shared == ((f"{UUID}.7", (B,)),) and b.shared == ((f"{UUID}.7", (A,)),)
    sa = desired_status(decl(A), a, T0 + 2, STALE)
    c = cond(sa, "CliqueShared")
    assert (c["status"], c["reason"]) == ("True", "SharedWithAnotherEnsemble")
    assert f"NVLink clique {UUID}.7 (members 0) is also reported by ImexEnsemble b" in \
        c["message"]
    # informational: neither Degraded nor not Ready because of it
    assert cond(sa, "Degraded")["status"] == "False"
    assert any(p.startswith("NVLink clique") for p in sa["problems"])
    assert any(p.startswith("NVLink clique") for p in all_problems(a, T0 + 2, STALE))
    # the Event, once, on the transition
    before = facts_of(Evaluation(decl(A), a, desired_status(decl(A), None, T0, STALE), T0))
    after = facts_of(Evaluation(decl(A), a, sa, T0 + 2), before)
    intents = decide(before, after)
    assert [(i.type, i.reason) for i in intents if i.reason == "CliqueShared"] == [
        ("Warning", "CliqueShared")]
    assert not [i for i in decide(after, after) if i.reason == "CliqueShared"]
    # B's member moves to another clique: both lose it
    report(state, B, 2, 1, 8)
    assert snap_of(state, A).shared == () and snap_of(state, B).shared == ()
    sa = desired_status(decl(A), snap_of(state, A), T0 + 3, STALE, previous=sa)
    assert cond(sa, "CliqueShared")["status"] == "False"
    assert not any(p.startswith("NVLink clique") for p in sa["problems"])


def test_an_ensemble_in_another_namespace_is_not_named() -> None:
    state = State(clock=lambda: T0)
    publish(state, A, 1)
    publish(state, C, 3)
    report(state, A, 1, 0, 7)
    report(state, C, 3, 0, 7)
    msg = cond(desired_status(decl(A), snap_of(state, A), T0 + 2, STALE), "CliqueShared")
    assert "an ensemble in another namespace" in msg["message"]
    assert "other" not in msg["message"].replace("another", "") and " c " not in msg["message"]
    # the dropped ensemble stops sharing
    state.drop(C)
    assert snap_of(state, A).shared == ()


def test_guest_checks_condition_and_counts() -> None:
    state = State(clock=lambda: T0)
    publish(state, A, 1, n=3)
    s = snap_of(state, A)
    assert guest_checks(s, T0, STALE)[:2] == ("Unknown", "NoChecksReported")
    ok = [{"name": "dns", "result": "PASS", "message": "ok"},
          {"name": "fabric", "result": "WARN", "message": "In Progress"}]
    bad = [{"name": "dns", "result": "FAIL", "message": "no answer"},
           {"name": "driver_version", "result": "FAIL", "message": "driver 550"}]
    report(state, A, 1, 0, None, ok)
    report(state, A, 1, 1, None, bad)
    report(state, A, 1, 2, None, [{"name": "dns", "result": "FAIL", "message": "no answer"}])
    s = snap_of(state, A)
    status, reason, message = guest_checks(s, T0 + 2, STALE)
    assert (status, reason) == ("False", "DnsFailed")
    assert message.startswith("dns FAIL on members 1, 2: no answer; driver_version FAIL on "
                              "member 1: driver 550")
    counts = check_counts(s, T0 + 2, STALE)
    assert counts == {("dns", "PASS"): 1, ("dns", "FAIL"): 2, ("fabric", "WARN"): 1,
                      ("driver_version", "FAIL"): 1}
    full = desired_status(decl(A), s, T0 + 2, STALE)
    assert cond(full, "GuestChecks")["reason"] == "DnsFailed"
    assert cond(full, "Ready")["status"] == "False"  # (generation lag, not the checks)
    # a stale report's checks no longer count
    assert check_counts(s, T0 + 1 + STALE + 1, STALE) == {}
    report(state, A, 1, 1, None, ok)
    report(state, A, 1, 2, None, ok)
    assert guest_checks(snap_of(state, A), T0 + 2, STALE)[:2] == ("True", "AllChecksPass")
