"""The registry's pure views: JSON document, list summary, table, file bodies."""

from __future__ import annotations

import datetime as dt

import pytest

from host_agent.registry import views
from host_agent.state.snapshot import EnsembleSnapshot, EnsembleSpec, GuestReport, PublishedMember
from imex_shared.hostsfile import merge_hosts, read_block
from imex_shared.model import EnsembleId, InvalidIndex, Member
from imex_shared.render import render_hosts_block, render_nodes_config

ENS = EnsembleId("gpu", "gb200")
T0 = 1_800_000_000.0  # 2027-01-15T08:00:00Z


def snapshot(
    members: list[Member],
    reports: dict[int, GuestReport] | None = None,
    problems: tuple[str, ...] = (),
    max_members: int = 4,
) -> EnsembleSnapshot:
    return EnsembleSnapshot(
        spec=EnsembleSpec(ENS, max_members, 50000),
        generation=1_800_000_000_000,
        members=tuple(PublishedMember(m, T0 + m.index) for m in members),
        problems=problems,
        changed_at=T0,
        reports=reports or {},
    )


M0 = Member(0, "10.0.0.10", "gb200-0", "node-a", "Running", True)
M2 = Member(2, "fd00::12", "gb200-2", None, "Scheduling", False)


def test_rfc3339_is_utc_with_milliseconds() -> None:
    assert views.rfc3339(T0 + 0.25) == "2027-01-15T08:00:00.250Z"
    parsed = dt.datetime.fromisoformat(views.rfc3339(T0).replace("Z", "+00:00"))
    assert parsed.timestamp() == T0


def test_ensemble_json_follows_the_contract() -> None:
    doc = views.ensemble_json(snapshot([M0, M2], problems=("dup index 1",)), T0, 120)
    assert doc == {
        "namespace": "gpu",
        "name": "gb200",
        "domain_id": ENS.domain_id,
        "generation": 1_800_000_000_000,
        "max_members": 4,
        "port": 50000,
        "members": [
            {
                "index": 0,
                "slot": ENS.slot(0),
                "ip": "10.0.0.10",
                "vmi": "gb200-0",
                "node": "node-a",
                "phase": "Running",
                "ready": True,
                "since": "2027-01-15T08:00:00.000Z",
                "guest": None,
                "clique": None,
            },
            {
                "index": 2,
                "slot": ENS.slot(2),
                "ip": "fd00::12",
                "vmi": "gb200-2",
                "node": None,
                "phase": "Scheduling",
                "ready": False,
                "since": "2027-01-15T08:00:02.000Z",
                "guest": None,
                "clique": None,
            },
        ],
        "problems": ["dup index 1"],
        "tls": None,
    }


def test_guest_report_fresh_stale_and_missing_fields() -> None:
    fresh = GuestReport(T0 - 10, "10.0.0.10", {"imex_state": "READY", "signals": 3})
    old = GuestReport(T0 - 121, "fd00::12", {"imex_state": "UNAVAILABLE"})
    doc = views.ensemble_json(snapshot([M0, M2], {0: fresh, 2: old}), T0, 120)
    g0, g2 = (m["guest"] for m in doc["members"])
    assert g0 == {
        "imex_state": "READY",
        "generation_applied": None,
        "nodes_config_sha256": None,
        "hosts_sha256": None,
        "signals": 3,
        "restarts": None,
        "agent_version": None,
        "cert_not_after": None,
        "registry_ca_sha256": None,
        "transport": None,
        "received_at": "2027-01-15T07:59:50.000Z",
        "from_ip": "10.0.0.10",
        "age_s": 10.0,
        "stale": False,
    }
    assert g2["stale"] is True and g2["age_s"] == 121.0
    # exactly at the limit is not stale yet; a clock stepping back gives age 0
    at_limit = GuestReport(T0 - 120, "10.0.0.10", {})
    assert views.guest_json(at_limit, T0, 120)["stale"] is False  # type: ignore[index]
    future = GuestReport(T0 + 5, "10.0.0.10", {})
    assert views.guest_json(future, T0, 120)["age_s"] == 0.0  # type: ignore[index]


def test_summary_counts_members_and_ready() -> None:
    assert views.list_json([snapshot([M0, M2]), snapshot([])]) == {
        "items": [
            {"namespace": "gpu", "name": "gb200", "generation": 1_800_000_000_000,
             "members": 2, "ready": 1},
            {"namespace": "gpu", "name": "gb200", "generation": 1_800_000_000_000,
             "members": 0, "ready": 0},
        ]
    }  # fmt: skip


def test_table_rows_gaps_problems_and_stale_marker() -> None:
    reports = {
        0: GuestReport(T0 - 200, "10.0.0.10", {"imex_state": "READY"}),
        2: GuestReport(T0 - 3, "fd00::12", {"imex_state": None}),
    }
    text = views.ensemble_table(snapshot([M0, M2], reports, ("dup index 1",)), T0, 120)
    lines = text.splitlines()
    assert lines[0] == (
        f"ensemble gpu/gb200  domain {ENS.domain_id}  generation 1800000000000  "
        "max-members 4  port 50000"
    )
    header = lines[2]
    assert header.split() == [
        "INDEX", "SLOT", "IP", "VMI", "NODE", "PHASE", "READY", "IMEX", "REPORTED"
    ]  # fmt: skip
    # columns line up: every cell starts where its header does
    col = header.index("IMEX")
    assert lines[3][col:].startswith("READY  3m20s ago STALE")
    assert lines[4][col:].startswith("-")
    assert lines[4].endswith("3s ago")
    assert lines[4].split()[:7] == [
        "2",
        ENS.slot(2),
        "fd00::12",
        "gb200-2",
        "-",
        "Scheduling",
        "no",
    ]
    assert "2 of 4 slots published" in lines
    assert "absent (pinned to 127.0.0.2): 1, 3" in lines
    assert lines[-2:] == ["problems:", "  - dup index 1"]
    assert text.endswith("\n")


def test_table_of_an_empty_ensemble() -> None:
    lines = views.ensemble_table(snapshot([], max_members=2), T0, 120).splitlines()
    assert lines[3:] == ["", "0 of 2 slots published", "absent (pinned to 127.0.0.2): 0, 1"]


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0, "0s"), (59.9, "59s"), (60, "1m00s"), (3599, "59m59s"), (3600, "1h00m"),
     (86399, "23h59m"), (90061, "1d01h")],
)  # fmt: skip
def test_format_age(seconds: float, text: str) -> None:
    assert views.format_age(seconds) == text


def test_file_bodies_are_the_guest_renderings() -> None:
    snap = snapshot([M0, M2])
    pins = {0: "10.0.0.10", 2: "fd00::12"}
    assert views.nodes_config(snap) == render_nodes_config(ENS, 4, "names")
    assert views.nodes_config(snap, "ips") == b"10.0.0.10\n127.0.0.2\nfd00::12\n127.0.0.2\n"
    assert views.hosts(snap) == render_hosts_block(ENS, 4, pins)
    assert views.hosts(snap) == merge_hosts(b"", ENS, 4, pins)
    assert read_block(views.hosts(snap), ENS) == {0: "10.0.0.10", 1: "127.0.0.2",
                                                  2: "fd00::12", 3: "127.0.0.2"}  # fmt: skip


def test_file_bodies_refuse_members_beyond_the_size() -> None:
    with pytest.raises(InvalidIndex):
        views.hosts(snapshot([Member(5, "10.0.0.15")]))


def test_rendered_json_is_the_json_response_body_made_once_per_snapshot_and_tick() -> None:
    import json
    from dataclasses import replace

    from fastapi.responses import JSONResponse

    from host_agent.registry.ensemble_routes import RenderedJson

    report = GuestReport(T0, "10.0.0.10", {"imex_state": "READY"})
    snap = snapshot([M0, M2], {0: report})
    cache = RenderedJson(stale_after=120.0)
    first = cache.body(snap, T0 + 5.01)
    assert first == JSONResponse(views.ensemble_json(snap, T0 + 5.01, 120.0)).body
    assert cache.body(snap, T0 + 5.09) is first  # same snapshot, same tenth of a second
    later = cache.body(snap, T0 + 5.2)  # the clock moved: age_s moves with it
    assert json.loads(later)["members"][0]["guest"]["age_s"] == 5.2
    newer = replace(snap, generation=snap.generation + 1)  # a change: a new snapshot
    assert json.loads(cache.body(newer, T0 + 5.2))["generation"] == snap.generation + 1
    stale = cache.body(newer, T0 + 200.0)
    assert json.loads(stale)["members"][0]["guest"]["stale"] is True
