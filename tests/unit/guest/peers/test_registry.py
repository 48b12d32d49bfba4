"""Defensive parsing of the registry's ensemble document (DESIGN.md "Registry HTTP API")."""

from __future__ import annotations

from typing import Any

import pytest

from guest_agent.peers.registry import RegistryBadResponse, parse_ensemble
from imex_shared.model import EnsembleId, Member

ENS = EnsembleId("team-a", "rack1")


def doc(members: list[Any], **extra: Any) -> dict[str, Any]:
    d = {"namespace": "team-a", "name": "rack1", "domain_id": ENS.domain_id,
         "generation": 1700000000000, "max_members": 4, "port": 50000,
         "members": members, "problems": []}
    d.update(extra)
    return d


def member(index: Any, ip: Any, **extra: Any) -> dict[str, Any]:
    m = {"index": index, "slot": ENS.slot(index) if isinstance(index, int) and index >= 0
         else "x", "ip": ip, "vmi": f"rack1-{index}", "node": "n1", "phase": "Running",
         "ready": True, "since": "2026-01-01T00:00:00Z", "guest": None}
    m.update(extra)
    return m


class Log(list[str]):
    def __call__(self, message: str) -> None:
        self.append(message)


def test_valid_document() -> None:
    log = Log()
    snap = parse_ensemble(doc([member(2, "10.0.0.3"), member(0, "10.0.0.1/24")]), ENS, 4, log)
    assert snap.generation == 1700000000000
    assert snap.members == (
        Member(0, "10.0.0.1", "rack1-0", "n1", "Running", True),
        Member(2, "10.0.0.3", "rack1-2", "n1", "Running", True),
    )
    assert snap.pins == {0: "10.0.0.1", 2: "10.0.0.3"}
    assert log == []


@pytest.mark.parametrize(
    ("entry", "fragment"),
    [
        ("not a member", "not an object"),
        (member(9, "10.0.0.9"), "out of range"),
        (member(-1, "10.0.0.9"), "negative"),
        (member("1", "10.0.0.9"), "not an integer"),
        (member(True, "10.0.0.9"), "not an integer"),
        (member(1, "127.0.0.1"), "loopback"),
        (member(1, "169.254.0.1"), "link-local"),
        (member(1, "10.0.2.2"), "masquerade"),
        (member(1, "not-an-ip"), "not an IP"),
        (member(1, ["10.0.0.1"]), "not a string"),
        (member(1, "10.0.0.2", slot="imex-00000000-1"), "does not match"),
        (member(1, "10.0.0.2\n10.0.0.3 evil"), "not an IP"),
    ],
)
def test_bad_members_ignored_with_one_line_each(entry: Any, fragment: str) -> None:
    log = Log()
    snap = parse_ensemble(doc([member(0, "10.0.0.1"), entry]), ENS, 4, log)
    assert snap.pins == {0: "10.0.0.1"}
    assert len(log) == 1 and fragment in log[0], log


def test_duplicate_index_uses_neither() -> None:
    log = Log()
    snap = parse_ensemble(
        doc([member(1, "10.0.0.2"), member(1, "10.0.0.3"), member(0, "10.0.0.1")]), ENS, 4, log
    )
    assert snap.pins == {0: "10.0.0.1"}
    assert len(log) == 1 and "twice" in log[0]


def test_size_mismatch_is_reported_and_ours_used() -> None:
    log = Log()
    snap = parse_ensemble(doc([member(3, "10.0.0.4")], max_members=18), ENS, 4, log)
    assert snap.pins == {3: "10.0.0.4"} and len(log) == 1 and "max_members" in log[0]


@pytest.mark.parametrize(
    ("data", "fragment"),
    [
        ([], "not an object"),
        (doc([], namespace="other"), "not team-a/rack1"),
        (doc([], name="rack2"), "not team-a/rack1"),
        (doc([], domain_id="00000000"), "domain_id"),
        (doc([], generation=None), "generation"),
        (doc([], generation="5"), "generation"),
        (doc([], generation=-1), "generation"),
        (doc([], generation=True), "generation"),
        (doc(None), "members"),  # type: ignore[arg-type]
    ],
)
def test_bad_envelope_refused(data: Any, fragment: str) -> None:
    with pytest.raises(RegistryBadResponse, match=fragment):
        parse_ensemble(data, ENS, 4, Log())
