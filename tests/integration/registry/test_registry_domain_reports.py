"""Status reports with IMEX's domain view: hostile bodies 422/413, what is kept, no crash."""

from __future__ import annotations

import ipaddress
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from host_agent.registry.config import RegistryConfig
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import SPEC, TOKEN, Running, serve
from tests.unit.shared.test_imex_domain import domain_doc

ENS = EnsembleId("gpu", "nvl")
URL = "/v1/ensembles/gpu/nvl/members/3/status"
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "10.213.0.13"}
FABRIC = {"cluster_uuid": "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10", "clique_id": 7}


def state18() -> State:
    state = State()
    spec = EnsembleSpec(ENS, 18, 50000, token_sha256=SPEC.token_sha256)
    state.set(spec, [Member(i, f"10.213.0.{10 + i}") for i in range(18)], [])
    state.mark_synced()
    return state


TRUSTED = (ipaddress.ip_network("127.0.0.0/8"),)


@pytest.fixture
async def reg() -> AsyncIterator[Running]:
    async with serve(state18(), RegistryConfig(trusted_proxies=TRUSTED)) as running:
        yield running


def report(**extra: Any) -> dict[str, Any]:
    return {"imex_state": "READY", **extra}


async def test_an_18_node_view_is_reduced_to_the_members_own_row(reg: Running) -> None:
    doc = domain_doc(18, down=frozenset({5}))
    # member 7's entry claims 3 lost its link to 9: a relayed copy, never believed
    doc["nodes"]["7"]["connections"]["3"]["status"] = "DISCONNECTED"
    body = report(imex_domain=doc, fabric=FABRIC, imex_channel0=True)
    assert 20_000 < len(json.dumps(body)) < 65536
    async with httpx.AsyncClient(base_url=reg.url) as client:
        ok = await client.put(URL, json=body, headers=AUTH)
        assert ok.status_code == 200, ok.text
        ensemble = (await client.get("/v1/ensembles/gpu/nvl")).text
    kept = reg.state.get(ENS).reports[3]  # type: ignore[union-attr]
    assert kept.links == tuple(None if j == 3 else "DISCONNECTED" if j == 5 else "CONNECTED"
                               for j in range(18))
    assert "imex_domain" not in kept.fields
    assert kept.fields["fabric"] == FABRIC and kept.fields["imex_channel0"] is True
    # the raw view never reaches the document every long-poll wake-up sends
    assert "connections" not in ensemble and "580.82.07" not in ensemble
    assert len(ensemble) < 12_000


async def test_fabric_absent_keeps_the_last_one_and_null_clears_it(reg: Running) -> None:
    async with httpx.AsyncClient(base_url=reg.url) as client:
        assert (await client.put(URL, json=report(fabric=FABRIC), headers=AUTH)).status_code == 200
        assert (await client.put(URL, json=report(), headers=AUTH)).status_code == 200
        assert reg.state.get(ENS).reports[3].fields["fabric"] == FABRIC  # type: ignore[union-attr]
        assert reg.state.get(ENS).reports[3].links is None  # type: ignore[union-attr]
        assert (await client.put(URL, json=report(fabric=None), headers=AUTH)).status_code == 200
        assert reg.state.get(ENS).reports[3].fields["fabric"] is None  # type: ignore[union-attr]


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


HOSTILE: list[tuple[str, str, str]] = [
    ("wrong type: nodes a list", json.dumps(report(imex_domain={"nodes": []})),
     "imex_domain.nodes"),
    ("wrong type: a link's status a number", json.dumps(report(imex_domain={"nodes": {"3": {
        "connections": {"1": {"status": 5}}}}})), "imex_domain.nodes.3.connections.1.status"),
    ("a link's word that is markup", json.dumps(report(imex_domain={"nodes": {"3": {
        "connections": {"1": {"status": "<b>CONNECTED</b>"}}}}})), "connections.1.status"),
    ("a link without its status", json.dumps(report(imex_domain={"nodes": {"3": {
        "connections": {"1": {"changed": 5}}}}})), "connections.1.status"),
    ("wrong type: a node a string",
     json.dumps(report(imex_domain={"nodes": {"3": "READY"}})), "imex_domain.nodes.3"),
    ("node id not decimal",
     json.dumps(report(imex_domain={"nodes": {"three": {"status": "READY"}}})), "nodes"),
    ("node id outside the ensemble",
     json.dumps(report(imex_domain={"nodes": {"18": {"status": "READY"}}})),
     "node id 18 is outside the ensemble (0..17)"),
    ("peer outside the ensemble", json.dumps(report(imex_domain={"nodes": {"3": {
        "status": "READY", "connections": {"400": {"status": "CONNECTED"}}}}})),
     "node id 400 is outside the ensemble"),
    ("connection to itself", json.dumps(report(imex_domain={"nodes": {"3": {
        "status": "READY", "connections": {"3": {"status": "CONNECTED"}}}}})),
     "connection to itself"),
    ("deep nesting", '{"imex_state": "READY", "imex_domain": {"nodes": {"3": {"status": '
     '"READY", "x": ' + nested(5000) + "}}}}", "recursion"),
    ("deep nesting in an unknown field", '{"imex_state": "READY", "junk": ' + nested(3000)
     + "}", "recursion"),
    ("2,500 nodes (fits 64 KiB)", json.dumps(report(imex_domain={"nodes": {
        str(i): {"status": "X"} for i in range(2500)}}), separators=(",", ":")),
     "at most 1000 items"),
    ("bad fabric", json.dumps(report(fabric={"cluster_uuid": "x", "clique_id": 1})),
     "cluster_uuid"),
    ("fabric clique as a string", json.dumps(report(fabric={**FABRIC, "clique_id": "7"})),
     "clique_id"),
    ("channel0 as a string", json.dumps(report(imex_channel0="yes")), "imex_channel0"),
]


@pytest.mark.parametrize(("what", "body", "says"), HOSTILE, ids=[h[0] for h in HOSTILE])
async def test_hostile_domain_bodies_are_422_and_the_agent_carries_on(
    reg: Running, what: str, body: str, says: str
) -> None:
    assert len(body) <= 65536, what
    async with httpx.AsyncClient(base_url=reg.url) as client:
        refused = await client.put(URL, content=body, headers={
            **AUTH, "Content-Type": "application/json"})
        assert refused.status_code == 422, refused.text
        assert says in refused.json()["error"], refused.json()
        assert refused.json()["detail"]
        assert 3 not in reg.state.get(ENS).reports  # type: ignore[union-attr]  # nothing kept
        fine = await client.put(URL, json=report(imex_domain=domain_doc(18)), headers=AUTH)
        assert fine.status_code == 200  # the registry is unharmed


_UNUSED_VALUES = [True, False, "2026-12-02T10:00:00Z", {"at": [1, 2]}, None, -1, "<b>x</b>"]


@pytest.mark.parametrize("value", [*_UNUSED_VALUES, "absent"],
                         ids=[repr(v)[:16] for v in _UNUSED_VALUES] + ["absent"])
async def test_fields_the_registry_does_not_use_never_refuse_a_report(
    reg: Running, value: object
) -> None:
    """Issue 30: ``changed`` (type undocumented), and every other field the registry does
    not read, may hold anything or be missing: the report is accepted, the row kept."""
    def put(conn: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
        if value != "absent":
            conn = {**conn, "changed": value, "host": value}
            node = {**node, "status": value, "host": value, "hostName": value,
                    "version": value}
        top = {} if value == "absent" else {"timestamp": value, "status": value}
        return report(imex_domain={"nodes": {"3": {**node, "connections": {"1": conn}}},
                                   **top})
    body = put({"status": "CONNECTED"}, {})
    async with httpx.AsyncClient(base_url=reg.url) as client:
        ok = await client.put(URL, json=body, headers=AUTH)
    assert ok.status_code == 200, ok.text
    assert reg.state.get(ENS).reports[3].links == (None, "CONNECTED")  # type: ignore[union-attr]


async def test_10000_nodes_are_refused_before_parsing_and_by_the_schema() -> None:
    many = json.dumps(report(imex_domain={"nodes": {str(i): {"status": "READY", "connections": {}}
                                                    for i in range(10_000)}}))
    assert len(many) > 65536
    async with serve(state18(), RegistryConfig(trusted_proxies=TRUSTED)) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        too_big = await client.put(URL, content=many, headers=AUTH)
        assert too_big.status_code == 413 and "65536" in too_big.json()["error"]
    # with the size limit out of the way the schema itself refuses 10,000 nodes
    roomy = RegistryConfig(trusted_proxies=TRUSTED, status_body_bytes=1 << 20)
    async with serve(state18(), roomy) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        refused = await client.put(URL, content=many, headers={
            **AUTH, "Content-Type": "application/json"})
        assert refused.status_code == 422
        assert "at most 1000 items" in refused.json()["error"]
        assert 3 not in reg.state.get(ENS).reports  # type: ignore[union-attr]


async def test_other_routes_keep_the_16_kib_limit(reg: Running) -> None:
    async with httpx.AsyncClient(base_url=reg.url) as client:
        other = await client.put("/v1/ensembles/gpu/nvl", content=b"x" * 20000)
        assert other.status_code == 413 and "16384" in other.json()["error"]
