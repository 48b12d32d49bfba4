"""The barrier's judgement (``wait --for local|domain``) and ``members``' output (pure)."""

from __future__ import annotations

import json

import pytest

from guest_agent.workload.barrier import (
    BarrierError,
    from_local,
    from_registry,
    judge_domain,
    judge_local,
    member_facts,
    render_members,
)

A = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10.1"
B = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10.2"


def registry_doc(n: int, *, cliques: dict[int, str] | None = None,
                 not_ready: frozenset[int] = frozenset(),
                 missing: frozenset[tuple[int, int]] = frozenset(),
                 silent: frozenset[int] = frozenset()) -> dict[str, object]:
    cliques = cliques or {}
    return {
        "status": "UP",
        "members": [{"index": i, "slot": f"imex-x-{i}", "clique": cliques.get(i),
                     "imex_state": "WAITING_FOR_PEERS" if i in not_ready else "READY"}
                    for i in range(n)],
        "links": [{"from": a, "to": b,
                   "state": "DISCONNECTED" if (a, b) in missing else "CONNECTED"}
                  for a in range(n) for b in range(n) if a != b],
        "silent": sorted(silent),
    }


def test_up_with_enough_members_is_ready() -> None:
    v = judge_domain(from_registry(registry_doc(3), 0, None), 3)
    assert v.ready and v.text() == "ready"


def test_a_vm_that_sees_only_itself_is_not_a_domain() -> None:
    v = judge_domain(from_registry(registry_doc(1), 0, None), 18)
    assert not v.ready and v.missing == ("1 of 18 members published",)


def test_what_is_missing_names_members_and_links() -> None:
    doc = registry_doc(3, not_ready=frozenset({2}), missing=frozenset({(0, 1)}))
    v = judge_domain(from_registry(doc, 0, None), 3)
    assert not v.ready
    assert v.missing == ("not READY: member 2 (WAITING_FOR_PEERS)",
                         "links not CONNECTED: 0->1 (DISCONNECTED)")
    # a silent member's last state does not count
    v = judge_domain(from_registry(registry_doc(2, silent=frozenset({1})), 0, None), 2)
    assert v.missing == ("not READY: member 1 (no report)",)


def test_only_the_own_clique_counts() -> None:
    doc = registry_doc(4, cliques={0: A, 1: A, 2: B, 3: B}, not_ready=frozenset({3}),
                       missing=frozenset({(2, 3), (0, 2)}))
    assert judge_domain(from_registry(doc, 0, A), 4).ready
    v = judge_domain(from_registry(doc, 2, B), 4)
    assert v.missing == ("not READY: member 3 (WAITING_FOR_PEERS)",
                         "links not CONNECTED: 2->3 (DISCONNECTED)")


def test_local_facts_from_the_ctl_and_the_status_members() -> None:
    doc = {"status": "DEGRADED", "nodes": {
        "0": {"status": "READY", "connections": {"1": {"status": "CONNECTED"}}},
        "1": {"status": "READY", "connections": {"0": {"status": "NEVER_CONNECTED"}}},
        "2": {"status": "UNAVAILABLE", "connections": {"0": {"status": "INVALID"}}}}}
    members = [{"index": 0, "slot": "s0", "ip": "10.0.0.1"},
               {"index": 1, "slot": "s1", "ip": "10.0.0.2"}]
    v = judge_domain(from_local(doc, members, 0, None), 2)
    assert v.missing == ("links not CONNECTED: 1->0 (NEVER_CONNECTED)",)
    with pytest.raises(BarrierError, match="without a nodes object"):
        from_local({"nodes": []}, members, 0, None)


def test_local_barrier() -> None:
    assert judge_local("READY\n", [0], [0]).ready
    assert judge_local("READY", [0, 1], [0]).missing == ("channel(s) 1 missing",)
    assert judge_local("WAITING_FOR_PEERS", [], []).missing == (
        "IMEX is WAITING_FOR_PEERS, not READY",)
    with pytest.raises(BarrierError, match="not an IMEX state"):
        judge_local("<html>", [], [])


def test_members_output() -> None:
    facts = member_facts([{"index": i, "slot": f"imex-x-{i}", "ip": f"10.0.0.{i + 1}",
                           "clique": A if i < 2 else B} for i in range(4)])
    facts.own, facts.own_clique = 1, A
    assert render_members(facts, "hostfile", False, 4) == (
        "imex-x-0 slots=4\nimex-x-1 slots=4\n")
    assert render_members(facts, "names", True, 1) == "10.0.0.1\n10.0.0.2\n"
    assert [m["index"] for m in json.loads(render_members(facts, "json", False, 1))] == [0, 1]
