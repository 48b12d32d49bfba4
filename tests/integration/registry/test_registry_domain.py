"""GET .../domain (JSON and matrix) and the imex_ensemble_* metrics, over real HTTP."""

from __future__ import annotations

import ipaddress
from typing import Any

import httpx

from host_agent.registry.config import RegistryConfig
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import SPEC, TOKEN, serve
from tests.unit.shared.test_imex_domain import domain_doc

ENS = EnsembleId("gpu", "nvl")
BASE = "/v1/ensembles/gpu/nvl"
TRUSTED = RegistryConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
A = {"cluster_uuid": "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10", "clique_id": 1}
B = {**A, "clique_id": 2}


def state_of(n: int) -> State:
    state = State()
    spec = EnsembleSpec(ENS, 18, 50000, token_sha256=SPEC.token_sha256)
    state.set(spec, [Member(i, f"10.213.0.{10 + i}") for i in range(n)], [])
    state.mark_synced()
    return state


async def put(client: httpx.AsyncClient, i: int, doc: dict[str, Any], **extra: Any) -> None:
    r = await client.put(f"{BASE}/members/{i}/status", json={
        "imex_state": "READY", "nodes_config_sha256": "c" * 64, "imex_domain": doc, **extra},
        headers={"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": f"10.213.0.{10 + i}"})
    assert r.status_code == 200, r.text


def view_of(i: int, n: int, lost: set[tuple[int, int]]) -> dict[str, Any]:
    """Member i's -N -j over 18 slots: n published, the pairs in ``lost`` DISCONNECTED."""
    doc = domain_doc(18, down=frozenset(range(n, 18)))
    for j, conn in doc["nodes"][str(i)]["connections"].items():
        if (i, int(j)) in lost:
            conn["status"] = "DISCONNECTED"
        elif int(j) >= n:
            conn["status"] = "NEVER_CONNECTED"
    return doc


async def test_domain_json_and_matrix_follow_the_members_own_reports() -> None:
    async with serve(state_of(4), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        empty = (await c.get(f"{BASE}/domain")).json()
        assert empty["status"] == "UNKNOWN" and empty["silent"] == [0, 1, 2, 3]
        for i in range(4):
            await put(c, i, view_of(i, 4, {(1, 3)}), fabric=A, imex_channel0=i != 2)
        r = await c.get(f"{BASE}/domain")
        doc = r.json()
        assert r.headers["x-imex-generation"] == str(doc["generation"])
        assert doc["status"] == "DEGRADED"
        assert doc["missing_links"] == [[1, 3]]
        assert doc["asymmetric_links"] == [[3, 1]]
        assert doc["partitions"] == [[0, 1, 2, 3]]
        assert doc["cliques"] == {f"{A['cluster_uuid']}.1": [0, 1, 2, 3]}
        assert [m["channel0"] for m in doc["members"]] == [True, True, False, True]
        assert {(x["from"], x["to"]): x["state"] for x in doc["links"]}[(1, 3)] == "DISCONNECTED"
        assert len(doc["links"]) == 12  # published peers only, not the 14 absent slots
        matrix = await c.get(f"{BASE}/domain?format=matrix")
        assert matrix.headers["content-type"] == "text/plain; charset=utf-8"
        assert matrix.text == (
            "Nodes From\\To  0  1  2  3\n"
            "            0  .  C  C  C\n"
            "            1  C  .  C  D\n"
            "            2  C  C  .  C\n"
            "            3  C  C  C  .\n"
            "Domain State: DEGRADED\n")
        await put(c, 1, view_of(1, 4, set()), fabric=A)
        assert (await c.get(f"{BASE}/domain")).json()["status"] == "UP"
        assert (await c.get("/v1/ensembles/gpu/other/domain")).status_code == 404
        assert (await c.get(f"{BASE}/domain?format=xml")).status_code == 422


async def test_metrics_count_states_never_one_series_per_link() -> None:
    async with serve(state_of(18), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        for i in range(16):  # 16 and 17 never report
            await put(c, i, view_of(i, 18, {(0, 5)} if i == 0 else set()),
                      fabric=A if i < 12 else B)
        text = (await c.get("/metrics")).text
    lines = [ln for ln in text.splitlines() if ln.startswith("imex_ensemble_")]
    assert 'imex_ensemble_domain_status{ensemble="nvl",namespace="gpu",status="DEGRADED"} 1.0' \
        in lines
    assert 'imex_ensemble_domain_status{ensemble="nvl",namespace="gpu",status="UP"} 0.0' in lines
    assert 'imex_ensemble_cliques{ensemble="nvl",namespace="gpu"} 2.0' in lines
    assert 'imex_ensemble_silent_members{ensemble="nvl",namespace="gpu"} 2.0' in lines
    # 0-11 clique A, 12-15 B, 16-17 unknown (in every clique): rows of 16 and 17 UNKNOWN
    assert reg.sample("imex_ensemble_links", namespace="gpu", ensemble="nvl",
                      state="UNKNOWN") == 2 * 17
    assert reg.sample("imex_ensemble_links", namespace="gpu", ensemble="nvl",
                      state="DISCONNECTED") == 1
    expected = 12 * 11 + 4 * 3 + 16 * 2  # A, B, and every reporter to 16 and 17
    assert reg.sample("imex_ensemble_links", namespace="gpu", ensemble="nvl",
                      state="CONNECTED") == expected - 1
    assert len([ln for ln in lines if ln.startswith("imex_ensemble_links{")]) == 9


async def test_a_split_wakes_long_polls_and_hosts_per_member_is_what_each_writes() -> None:
    import asyncio

    from imex_shared.cliques import pins_for
    from imex_shared.hostsfile import merge_hosts

    async with serve(state_of(4), TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        g = (await c.get(BASE)).json()["generation"]
        for i in range(3):
            await put(c, i, view_of(i, 4, set()), fabric=A)
        assert (await c.get(BASE)).json()["generation"] == g  # one clique: nothing new
        parked = asyncio.create_task(c.get(f"{BASE}?wait={g}&timeout=20"))
        await reg.until(lambda: reg.sample("imex_registry_longpoll_waiters") == 1)
        await put(c, 3, view_of(3, 4, set()), fabric=B)
        woke = (await asyncio.wait_for(parked, 5)).json()
        assert woke["generation"] == g + 1
        assert [m["clique"] for m in woke["members"]] == [f"{A['cluster_uuid']}.{x}"
                                                          for x in (1, 1, 1, 2)]
        assert any(p.startswith("the members span 2 NVLink cliques") for p in woke["problems"])
        pins = {i: f"10.213.0.{10 + i}" for i in range(4)}
        cliques = {m["index"]: m["clique"] for m in woke["members"]}
        for i in range(4):
            body = (await c.get(f"{BASE}/hosts?member={i}")).content
            assert body == merge_hosts(b"", ENS, 18, pins_for(pins, cliques, i))
        assert b"127.0.0.2\timex-" in (await c.get(f"{BASE}/hosts?member=3")).content
        assert (await c.get(f"{BASE}/hosts")).content == merge_hosts(b"", ENS, 18, pins)
        missing = await c.get(f"{BASE}/hosts?member=9")
        assert missing.status_code == 404 and "no published member 9" in missing.json()["error"]
