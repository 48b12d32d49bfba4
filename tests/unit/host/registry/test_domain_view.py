"""The aggregated IMEX domain: status rules, missing/asymmetric links, partitions, cliques."""

from __future__ import annotations

import json
from pathlib import Path

from host_agent.registry.domain_view import aggregate, domain_json, matrix_text
from host_agent.registry.views import rfc3339
from tests.unit.host.registry.domain_fixtures import (
    CLIQUE_A,
    CLIQUE_B,
    NOW,
    SHA,
    T0,
    full,
    report,
    snapshot,
)

GOLDEN = Path(__file__).resolve().parents[3] / "golden" / "domain"


def test_all_connected_and_ready_is_up() -> None:
    view = aggregate(full(18), NOW, 120)
    assert view.status == "UP"
    assert view.missing == () and view.asymmetric == () and view.silent == ()
    assert view.partitions == (tuple(range(18)),)
    assert len(view.links) == 18 * 17 and view.link_counts == {"CONNECTED": 18 * 17}
    assert view.problems == ()


def test_one_way_loss_is_degraded_with_exactly_that_link_missing() -> None:
    view = aggregate(full(18, lambda a, b: "DISCONNECTED" if (a, b) == (3, 7) else "CONNECTED"),
                     NOW, 120)
    assert view.status == "DEGRADED"
    assert view.missing == ((3, 7),)
    assert view.asymmetric == ((7, 3),)  # 7 sees 3, 3 does not see 7
    assert view.partitions == (tuple(range(18)),)  # still connected through the others
    assert view.link_counts == {"CONNECTED": 18 * 17 - 1, "DISCONNECTED": 1}
    assert "1 links not CONNECTED: 3->7" in view.problems


def test_partitions_are_components_over_links_connected_both_ways() -> None:
    half = {0, 1, 2}
    view = aggregate(full(6, lambda a, b: "CONNECTED" if (a in half) == (b in half)
                          else "DISCONNECTED"), NOW, 120)
    assert view.status == "DEGRADED"
    assert view.partitions == ((0, 1, 2), (3, 4, 5))
    assert len(view.missing) == 18


def test_no_reports_unknown_none_ready_down() -> None:
    assert aggregate(snapshot(4), NOW, 120).status == "UNKNOWN"
    assert aggregate(snapshot(0), NOW, 120).status == "UNKNOWN"
    down = aggregate(full(4, state="WAITING_FOR_PEERS"), NOW, 120)
    assert down.status == "DOWN"
    one = aggregate(snapshot(4, {i: report(i, 4, state="READY" if i else "INITIALIZING")
                                 for i in range(4)}), NOW, 120)
    assert one.status == "DEGRADED" and "IMEX not READY on members 0" in one.problems


def test_a_silent_member_makes_an_otherwise_good_domain_unknown() -> None:
    reports = {i: report(i, 4) for i in range(4)}
    reports[2] = report(2, 4, at=NOW - 500)  # stale: older than 120 s
    view = aggregate(snapshot(4, reports), NOW, 120)
    assert view.status == "UNKNOWN" and view.silent == (2,)
    assert view.link_counts["UNKNOWN"] == 3
    assert "no fresh report (none, or older than 120s) from members 2" in view.problems
    # ... but DEGRADED when the others see it gone
    reports = {i: report(i, 4, lambda a, b: "DISCONNECTED" if b == 2 else "CONNECTED")
               for i in (0, 1, 3)}
    view = aggregate(snapshot(4, reports), NOW, 120)
    assert view.status == "DEGRADED" and view.missing == ((0, 2), (1, 2), (3, 2))
    assert view.silent == (2,)


def test_a_report_from_before_the_slots_address_does_not_count() -> None:
    reports = {i: report(i, 3) for i in range(3)}
    reports[1] = report(1, 3, at=T0 - 1)  # from the slot's previous VM
    view = aggregate(snapshot(3, reports), NOW, 120)
    assert view.silent == (1,) and view.status == "UNKNOWN"


def test_a_report_without_a_view_is_unknown_not_missing() -> None:
    reports = {i: report(i, 3) for i in range(3)}
    reports[0] = report(0, 3, view=False)
    view = aggregate(snapshot(3, reports), NOW, 120)
    assert view.status == "UNKNOWN" and view.missing == ()
    assert "members 0 report no nvidia-imex-ctl -N -j view" in view.problems


def test_configuration_drift_degrades_or_downs_with_a_named_problem() -> None:
    reports = {i: report(i, 6) for i in range(6)}
    reports[4] = report(4, 6, sha="b" * 64)
    view = aggregate(snapshot(6, reports), NOW, 120)
    assert view.status == "DEGRADED"
    assert any(p.startswith("configuration drift: members 4 report a nodes_config.cfg that "
                            f"differs from the other members' ({SHA[:12]}...)")
               for p in view.problems)
    tie = {i: report(i, 4, sha=("a" if i < 2 else "b") * 64) for i in range(4)}
    view = aggregate(snapshot(4, tie), NOW, 120)
    assert view.status == "DOWN"
    assert any("none has a majority" in p for p in view.problems)


def cliques_18() -> dict[int, object]:
    """12 members in clique A, 6 in B; cross-clique peers pinned away: NEVER_CONNECTED."""
    def link(a: int, b: int) -> str:
        return "CONNECTED" if (a < 12) == (b < 12) else "NEVER_CONNECTED"
    return {i: report(i, 18, link, fabric=CLIQUE_A if i < 12 else CLIQUE_B) for i in range(18)}


def test_two_cliques_are_judged_apart_and_named_as_a_split() -> None:
    view = aggregate(snapshot(18, cliques_18()), NOW, 120)  # type: ignore[arg-type]
    assert view.status == "UP"  # cross-clique pairs are excluded
    assert view.missing == ()
    a, b = (f"{u}.{c}" for u, c in (CLIQUE_A, CLIQUE_B))
    assert view.cliques == {a: tuple(range(12)), b: tuple(range(12, 18))}
    assert view.partitions == (tuple(range(12)), tuple(range(12, 18)))
    assert view.problems == (
        f"the members span 2 NVLink cliques ({a}: members 0-11; {b}: members 12-17); IMEX "
        "works only within a clique, so each member pins only its own clique's peers",)
    assert view.link_counts == {"CONNECTED": 12 * 11 + 6 * 5}


def test_a_link_across_cliques_joins_no_partition() -> None:
    """A TCP link left CONNECTED both ways across the split (made while a new member's
    clique was unknown; pinning the other clique away closes nothing) is no domain."""
    def link(a: int, b: int) -> str:
        same = (a < 12) == (b < 12)
        return "CONNECTED" if same or {a, b} == {0, 12} else "NEVER_CONNECTED"
    reports = {i: report(i, 18, link, fabric=CLIQUE_A if i < 12 else CLIQUE_B)
               for i in range(18)}
    view = aggregate(snapshot(18, reports), NOW, 120)  # type: ignore[arg-type]
    assert view.status == "UP"
    assert view.partitions == (tuple(range(12)), tuple(range(12, 18)))
    assert (0, 12, "CONNECTED") in view.links and (12, 0, "CONNECTED") in view.links


def test_matrix_is_byte_exact(request: object) -> None:
    reports = cliques_18()
    reports[3] = report(3, 18, lambda a, b: "DISCONNECTED" if b == 7 else (
        "CONNECTED" if b < 12 else "NEVER_CONNECTED"), fabric=CLIQUE_A)
    del reports[15]
    view = aggregate(snapshot(18, reports), NOW, 120)  # type: ignore[arg-type]
    assert view.status == "DEGRADED"
    text = matrix_text(view)
    assert text == (GOLDEN / "matrix_18_split_degraded.txt").read_text()
    small = aggregate(full(3, lambda a, b: "DISCONNECTED" if (a, b) == (0, 2) else "CONNECTED"),
                      NOW, 120)
    assert matrix_text(small) == (
        "Nodes From\\To  0  1  2\n"
        "            0  .  C  D\n"
        "            1  C  .  C\n"
        "            2  C  C  .\n"
        "Domain State: DEGRADED\n")


def test_domain_json_has_the_issues_fields() -> None:
    reports = {i: report(i, 3, lambda a, b: "DISCONNECTED" if (a, b) == (0, 2)
                         else "CONNECTED", fabric=CLIQUE_A) for i in range(3)}
    doc = domain_json(aggregate(snapshot(3, reports, max_members=4), NOW, 120), rfc3339)
    key = f"{CLIQUE_A[0]}.{CLIQUE_A[1]}"
    assert doc == json.loads((GOLDEN / "domain_3_degraded.json").read_text())
    assert list(doc)[:8] == ["status", "generation", "members", "links", "missing_links",
                             "partitions", "cliques", "asymmetric_links"]
    assert doc["cliques"] == {key: [0, 1, 2]}
    assert doc["missing_links"] == [[0, 2]]


def test_the_cr_status_fields() -> None:
    from host_agent.registry.domain_view import cr_status

    assert cr_status(aggregate(full(4), NOW, 120)) == ("UP", {
        "type": "DomainUp", "status": "True", "reason": "AllLinksConnected",
        "message": "4 members, every expected link CONNECTED"})
    lost = aggregate(full(4, lambda a, b: "DISCONNECTED" if (a, b) == (1, 2) else "CONNECTED"),
                     NOW, 120)
    assert cr_status(lost) == ("DEGRADED", {
        "type": "DomainUp", "status": "False", "reason": "LinksMissing",
        "message": "1 links not CONNECTED: 1->2"})
    assert cr_status(aggregate(snapshot(4), NOW, 120))[1]["status"] == "Unknown"
