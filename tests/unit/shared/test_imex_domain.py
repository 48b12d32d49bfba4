"""imex_shared.imex_domain: -N -j and nvidia-smi output checked before anything trusts it."""

from __future__ import annotations

import json
import re
from typing import Any

import pytest

from imex_shared.imex_domain import (
    IMEX_DOMAIN_MAX_BYTES,
    DomainError,
    DomainParser,
    Fabric,
    check_fabric,
    clean_imex_domain,
    encode_compact,
    letter,
    matrix_lines,
    own_row,
    own_view,
    parse_fabric,
    parse_imex_domain,
)

UUID = "9a5ef5e6-2e4c-4aa4-9e5a-b4dc1d7c4c24"


def domain_doc(n: int = 18, down: frozenset[int] = frozenset()) -> dict[str, Any]:
    """An n-node ``-N -j`` in IMEX's shape, slot names as host names (names mode)."""
    nodes: dict[str, Any] = {}
    for i in range(n):
        if i in down:
            nodes[str(i)] = {"status": "UNAVAILABLE", "host": f"10.0.0.{i + 10}",
                             "hostName": f"imex-93a7a316-{i}", "version": "",
                             "connections": {str(j): {"host": f"imex-93a7a316-{j}",
                                                      "status": "INVALID", "changed": 0}
                                             for j in range(n) if j != i}}
            continue
        nodes[str(i)] = {
            "status": "READY", "host": f"10.0.0.{i + 10}", "hostName": f"imex-93a7a316-{i}",
            "version": "580.82.07",
            "connections": {str(j): {"host": f"10.0.0.{j + 10}",
                                     "status": "DISCONNECTED" if j in down else "CONNECTED",
                                     "changed": 1795973999}
                            for j in range(n) if j != i},
        }
    return {"nodes": nodes, "timestamp": 1795974000, "status": "DEGRADED" if down else "UP"}


def test_an_18_node_view_is_kept_whole_and_fits() -> None:
    doc = domain_doc(18, down=frozenset({5}))
    raw = json.dumps(doc, indent=2).encode()
    cleaned = parse_imex_domain(raw, 18)
    assert cleaned == doc  # every known field survives, nothing is added
    assert len(encode_compact(cleaned)) < IMEX_DOMAIN_MAX_BYTES // 2  # ~25 KB: headroom
    assert own_row(cleaned, 3) == {j: ("DISCONNECTED" if j == 5 else "CONNECTED")
                                   for j in range(18) if j != 3}
    assert own_row(cleaned, 40) is None


def test_the_parser_cleans_the_nodes_again_only_when_they_changed() -> None:
    """IMEX stamps every print; the collector's parser keeps the last clean of the nodes
    and gives the same documents parse_imex_domain gives, through an error too."""
    parser = DomainParser(18)
    doc = domain_doc(18)
    first = parser.parse(json.dumps(doc).encode())
    doc["timestamp"] += 5
    second = parser.parse(json.dumps(doc).encode())
    assert second == parse_imex_domain(json.dumps(doc).encode(), 18)
    assert second["timestamp"] == 1795974005 and first["timestamp"] == 1795974000
    assert second["nodes"] is first["nodes"]  # the nodes were not cleaned again
    moved = domain_doc(18, down=frozenset({5}))
    third = parser.parse(json.dumps(moved).encode())
    assert third == moved and third["nodes"] is not first["nodes"]
    bad = domain_doc(18, down=frozenset({5}))
    bad["nodes"]["2"]["connections"]["2"] = {"status": "CONNECTED"}
    with pytest.raises(DomainError, match=r"nodes\['2'\]\.connections\['2'\]: a node's "):
        parser.parse(json.dumps(bad).encode())
    # the same nodes as the last good print are still accepted, and a stale top-level
    # field of the kept print never leaks into the next one
    moved.pop("status")
    assert parser.parse(json.dumps(moved).encode()) == moved
    with pytest.raises(DomainError, match="not JSON"):
        parser.parse(b"{")


def test_the_reported_view_is_the_own_entry_and_the_top_level_fields() -> None:
    doc = domain_doc(18, down=frozenset({5}))
    view = own_view(doc, 3)
    assert view == {"nodes": {"3": doc["nodes"]["3"]}, "timestamp": 1795974000,
                    "status": "DEGRADED"}
    assert own_row(view, 3) == own_row(doc, 3)  # what a registry keeps is all there
    assert len(encode_compact(view)) * 15 < len(encode_compact(doc))
    assert own_view(doc, 40) == {"nodes": {}, "timestamp": 1795974000, "status": "DEGRADED"}
    assert own_view({"nodes": {}}, None) == {"nodes": {}}
    assert len(doc["nodes"]) == 18  # the collected view is left whole


def test_unknown_fields_are_left_out_and_optional_ones_may_be_missing() -> None:
    doc = {"nodes": {"0": {"status": "READY", "secret": "x" * 100,
                           "connections": {"1": {"status": "NEVER_CONNECTED", "extra": [1]}}},
                     "1": {"status": "UNAVAILABLE"}},
           "status": "DEGRADED", "debug": {"a": 1}}
    assert clean_imex_domain(doc, 2) == {
        "nodes": {"0": {"status": "READY", "connections": {"1": {"status": "NEVER_CONNECTED"}}},
                  "1": {"status": "UNAVAILABLE", "connections": {}}},
        "status": "DEGRADED"}


@pytest.mark.parametrize(("output", "says"), [
    (b"", "not JSON"),
    (b'{"nodes": {"0": {"status": "READY", "conn', "not JSON"),  # truncated
    (b"\xff\xfe{}", "not UTF-8"),
    (b"[]", "expected an object"),
    (b'{"nodes": []}', "imex_domain.nodes: expected an object"),
    (b'{"nodes": {"0": {"connections": {"1": {"status": 5}}}}}', "is not a state word"),
    (b'{"nodes": {"0": {"connections": {"1": {"status": "ready now"}}}}}',
     "is not a state word"),
    (b'{"nodes": {"0": {"connections": {"1": {"changed": 5}}}}}', "None is not a state word"),
    (b'{"nodes": {"0": {"connections": {"1": "CONNECTED"}}}}', "expected an object"),
    (b'{"nodes": {"0": {"connections": []}}}', "connections: expected an object"),
    (b'{"nodes": {"x": {"status": "READY"}}}', "not a decimal index"),
    (b'{"nodes": {"01": {"status": "READY"}}}', "not a decimal index"),
    (b'{"nodes": {"-1": {"status": "READY"}}}', "not a decimal index"),
    (b'{"nodes": {"18": {"status": "READY"}}}', "outside the ensemble (0..17)"),
    (b'{"nodes": {"0": {"status": "READY", "connections": {"99": {"status": "CONNECTED"}}}}}',
     "node id 99 is outside the ensemble"),
    (b'{"nodes": {"0": {"status": "READY", "connections": {"0": {"status": "CONNECTED"}}}}}',
     "connection to itself"),
])
def test_malformed_or_hostile_output_is_refused_with_a_reason(output: bytes, says: str) -> None:
    with pytest.raises(DomainError, match=re.escape(says)):
        parse_imex_domain(output, 18)


_ABSENT = object()
#: (``changed`` as printed, forwarded): forwarded only in a form every registry accepts
_CHANGED = [(True, False), (False, False), ("2026-12-02T10:00:00Z", True), ("", True),
            ({"at": 1}, False), ([1], False), (None, False), (-5, False), (1e300, False),
            ("x" * 100, False), (1795973999, True), (_ABSENT, False)]


@pytest.mark.parametrize(("changed", "forwarded"), _CHANGED,
                         ids=["absent" if c is _ABSENT else repr(c)[:20] for c, _ in _CHANGED])
def test_changed_of_any_type_or_absent_keeps_the_view(changed: object, forwarded: bool) -> None:
    """``changed`` is not used (its type is not documented): never a reason to drop the
    view. A value every registry version accepts is forwarded, anything else left out."""
    conn: dict[str, Any] = {"host": "10.0.0.11", "status": "CONNECTED"}
    if changed is not _ABSENT:
        conn["changed"] = changed
    out = parse_imex_domain(json.dumps({"nodes": {"0": {"status": "READY", "connections": {
        "1": conn}}}, "timestamp": 1795974000, "status": "UP"}).encode(), 2)
    assert own_row(out, 0) == {1: "CONNECTED"}
    kept = out["nodes"]["0"]["connections"]["1"]
    assert kept.get("changed", _ABSENT) == (changed if forwarded else _ABSENT), kept
    assert out["status"] == "UP" and out["timestamp"] == 1795974000


def test_unused_fields_of_any_type_are_left_out_not_refused() -> None:
    doc = {"nodes": {"0": {"status": 5, "host": ["x"], "hostName": "a\nb", "version": None,
                           "connections": {"1": {"status": "CONNECTED", "host": {"a": 1},
                                                 "changed": True}}},
                     "1": {"connections": {"0": {"status": "NEVER_CONNECTED"}}}},
           "timestamp": {"a": 1}, "status": "up now"}
    assert clean_imex_domain(doc, 2) == {
        "nodes": {"0": {"status": "UNKNOWN", "connections": {"1": {"status": "CONNECTED"}}},
                  "1": {"status": "UNKNOWN",
                        "connections": {"0": {"status": "NEVER_CONNECTED"}}}}}


def test_deep_nesting_too_many_nodes_and_oversize_are_refused() -> None:
    deep = b'{"nodes": {"0": {"status": "READY", "x": ' + b"[" * 100_000 + b"]" * 100_000 + b"}}}"
    with pytest.raises(DomainError, match=r"nested too deeply|over"):
        parse_imex_domain(deep, 18)
    many = {"nodes": {str(i): {"status": "READY"} for i in range(10_000)}}
    with pytest.raises(DomainError, match="10000 nodes, the ensemble has 1000 slots"):
        clean_imex_domain(many, 1000)
    with pytest.raises(DomainError, match="over 1048576 bytes"):
        parse_imex_domain(b" " * (2 << 20), 18)
    # 40 nodes of 39 links: valid, but too big to report
    with pytest.raises(DomainError, match="bytes once cleaned"):
        clean_imex_domain(domain_doc(40), 40)


def test_fabric_of_a_gb200_tray_and_of_gpus_without_one() -> None:
    def gpu(uuid: str, clique: str, state: str = "Completed") -> str:
        return ("GPU 00000009:01:00.0\n    Product Name : NVIDIA GB200\n    Fabric\n"
                f"        State                             : {state}\n"
                "        Status                            : Success\n"
                f"        CliqueId                          : {clique}\n"
                f"        ClusterUUID                       : {uuid}\n"
                "        Health\n            Bandwidth                     : Full\n"
                "    Processes                             : None\n")

    tray = ("==============NVSMI LOG==============\n" + gpu(UUID, "32766") * 4).encode()
    assert parse_fabric(tray) == Fabric(UUID, 32766)
    assert parse_fabric(tray).key == f"{UUID}.32766"  # type: ignore[union-attr]
    assert parse_fabric(gpu("N/A", "N/A").encode()) is None
    assert parse_fabric(b"No devices were found\n") is None
    assert parse_fabric(gpu(UUID, "1", state="In Progress").encode()) is None
    with pytest.raises(DomainError, match="different cliques"):
        parse_fabric((gpu(UUID, "1") + gpu(UUID, "2")).encode())
    with pytest.raises(DomainError, match="CliqueId 'banana' is not a number"):
        parse_fabric(gpu(UUID, "banana").encode())
    with pytest.raises(DomainError, match="is not a UUID"):
        parse_fabric(gpu("'; rm -rf /", "1").encode())
    with pytest.raises(DomainError, match="out of range"):
        parse_fabric(gpu(UUID, str(2**40)).encode())
    with pytest.raises(DomainError, match="not UTF-8"):
        parse_fabric(b"\xff" * 10)


def test_check_fabric_types() -> None:
    assert check_fabric(UUID, 0).to_json() == {"cluster_uuid": UUID, "clique_id": 0}
    for uuid, clique in ((UUID, True), (UUID, "1"), (1, 1), (UUID, -1)):
        with pytest.raises(DomainError):
            check_fabric(uuid, clique)


def test_matrix_lines_widths_for_one_two_and_three_digit_indices() -> None:
    assert matrix_lines([0, 1, 2], [(0, [".", "C", "D"])]) == [
        "Nodes From\\To  0  1  2",
        "            0  .  C  D",
    ]
    assert matrix_lines([9, 10], [(10, ["N", "."])]) == [
        "Nodes From\\To  9 10",
        "           10  N  .",
    ]
    assert matrix_lines([99, 100], [(100, ["?", "."])]) == [
        "Nodes From\\To  99 100",
        "          100   ?   .",
    ]
    assert [letter(w) for w in ("CONNECTED", "DISCONNECTED", "NEVER_CONNECTED", "INVALID",
                                "RECOVERING", "AUTHENTICATING", "MISMATCH", "WHATEVER", None)
            ] == ["C", "D", "N", "I", "R", "A", "M", "?", "?"]
