"""Every registry endpoint against DESIGN.md "Registry HTTP API", over real HTTP on loopback."""

from __future__ import annotations

import hashlib
import ipaddress
import json
import time
from collections.abc import AsyncIterator

import httpx
import pytest

from host_agent.registry.config import RegistryConfig
from host_agent.state.snapshot import EnsembleSpec, GuestReport
from host_agent.state.store import State
from imex_shared.hostsfile import merge_hosts
from imex_shared.model import EnsembleId, Member
from imex_shared.render import render_nodes_config
from tests.integration.registry.registry_harness import (
    ENS,
    MEMBERS,
    SPEC,
    TOKEN,
    Running,
    seeded_state,
    serve,
)

BASE = "/v1/ensembles/gpu/gb200"


async def test_healthz_and_readyz_follow_the_first_list() -> None:
    state = State()
    async with serve(state) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        assert (await client.get("/healthz")).status_code == 200
        not_ready = await client.get("/readyz")
        assert not_ready.status_code == 503
        assert "first full list" in not_ready.json()["error"]
        unknown = await client.get(BASE)
        assert unknown.status_code == 404
        assert "/readyz" in unknown.json()["error"]
        state.mark_synced()
        assert (await client.get("/readyz")).status_code == 200


async def test_readyz_names_what_the_agent_cannot_work_without() -> None:
    """The agent's start-up checks (kube/preflight_io.py) gate readiness before the
    first list does, and say why; reads are served meanwhile."""
    state = State()
    problem: list[str | None] = ["namespace imex-system does not exist: ..."]
    async with serve(state, not_ready=lambda: problem[0]) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        state.mark_synced()
        answer = await client.get("/readyz")
        assert answer.status_code == 503
        assert answer.json() == {"error": "not ready: namespace imex-system does not exist: ..."}
        assert (await client.get("/v1/ensembles")).status_code == 200
        problem[0] = None
        assert (await client.get("/readyz")).status_code == 200


async def test_list_counts_members_and_ready(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        response = await client.get("/v1/ensembles")
    assert response.status_code == 200
    generation = registry.state.get(ENS).generation  # type: ignore[union-attr]
    assert response.json() == {
        "items": [
            {
                "namespace": "gpu",
                "name": "gb200",
                "generation": generation,
                "members": 2,
                "ready": 1,
            }
        ]
    }


async def test_ensemble_json_has_exactly_the_contract_fields(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        response = await client.get(BASE)
    assert response.status_code == 200
    assert response.headers["content-type"] == "application/json"
    body = response.json()
    snap = registry.state.get(ENS)
    assert snap is not None
    assert list(body) == [
        "namespace",
        "name",
        "domain_id",
        "generation",
        "max_members",
        "port",
        "members",
        "problems",
        "tls",
    ]
    assert body["tls"] is None  # authEncryption off
    assert body["domain_id"] == ENS.domain_id
    assert body["generation"] == snap.generation
    assert response.headers["x-imex-generation"] == str(snap.generation)
    assert (body["max_members"], body["port"]) == (4, 50000)
    assert body["problems"] == ["VMI gb200-9 has index 9, beyond max-members 4"]
    assert [list(m) for m in body["members"]] == [
        ["index", "slot", "ip", "vmi", "node", "phase", "ready", "since", "guest", "clique"]
    ] * 2  # clique: issue 17
    first, second = body["members"]
    assert first["slot"] == ENS.slot(0) and first["ip"] == "10.213.0.10"
    assert (first["vmi"], first["node"], first["phase"], first["ready"]) == (
        "gb200-0",
        "node-a",
        "Running",
        True,
    )
    assert second["index"] == 2 and second["ready"] is False and second["guest"] is None


async def test_unknown_ensemble_404_names_it_and_the_label(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        for path in (
            "/v1/ensembles/gpu/gb300",
            "/v1/ensembles/gpu/gb300/nodes_config",
            "/v1/ensembles/gpu/gb300/hosts",
        ):
            response = await client.get(path)
            assert response.status_code == 404, path
            assert response.json() == {
                "error": "no ensemble gpu/gb300 "
                "(is the Service labelled imex-ensemble.io/ensemble=gb300?)"
            }
        nowhere = await client.get("/v2/whatever")
        assert nowhere.status_code == 404 and "/docs" in nowhere.json()["error"]
        wrong_method = await client.delete(BASE)
        assert wrong_method.status_code == 405 and "DELETE" in wrong_method.json()["error"]
        bad_name = await client.get("/v1/ensembles/GPU/gb200")
        assert bad_name.status_code == 422 and "path.ns" in bad_name.json()["error"]


async def test_table_for_people(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        response = await client.get(BASE, params={"format": "table"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    lines = response.text.splitlines()
    assert lines[0].startswith("ensemble gpu/gb200  domain ")
    assert lines[2].split() == [
        "INDEX", "SLOT", "IP", "VMI", "NODE", "PHASE", "READY", "IMEX", "REPORTED"
    ]  # fmt: skip
    assert lines[3].split() == [
        "0", ENS.slot(0), "10.213.0.10", "gb200-0", "node-a", "Running", "yes", "-", "-"
    ]  # fmt: skip
    assert "absent (pinned to 127.0.0.2): 1, 3" in lines


@pytest.mark.parametrize("mode", ["names", "ips"])
async def test_nodes_config_is_what_a_guest_writes(registry: Running, mode: str) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        response = await client.get(f"{BASE}/nodes_config", params={"mode": mode})
    assert response.status_code == 200
    assert response.headers["content-type"] == "text/plain; charset=utf-8"
    pins = {m.index: m.ip for m in MEMBERS}
    assert response.content == render_nodes_config(ENS, 4, mode, pins)  # type: ignore[arg-type]
    if mode == "ips":
        assert response.content == b"10.213.0.10\n127.0.0.2\n10.213.0.12\n127.0.0.2\n"


async def test_hosts_is_what_a_guest_writes(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        response = await client.get(f"{BASE}/hosts")
    assert response.status_code == 200
    pins = {m.index: m.ip for m in MEMBERS}
    assert response.content == merge_hosts(b"", ENS, 4, pins)
    assert response.content.splitlines()[1] == f"10.213.0.10\t{ENS.slot(0)}".encode()


async def test_stale_reports_are_marked_in_json_and_table() -> None:
    state = seeded_state()
    fresh = {"imex_state": "READY", "generation_applied": 7, "signals": 1, "restarts": 0}
    state.report(ENS, 0, GuestReport(time.time() - 500, "10.213.0.10", fresh))
    state.report(ENS, 2, GuestReport(time.time() - 1, "10.213.0.12", {"imex_state": "DOWN"}))
    config = RegistryConfig(report_stale_after=60)
    async with serve(state, config) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        members = (await client.get(BASE)).json()["members"]
        table = (await client.get(BASE, params={"format": "table"})).text
    old, new = (m["guest"] for m in members)
    assert old["stale"] is True and old["age_s"] >= 500
    assert old["imex_state"] == "READY" and old["generation_applied"] == 7
    assert old["from_ip"] == "10.213.0.10"
    assert new["stale"] is False and new["age_s"] < 60
    rows = {line.split()[0]: line for line in table.splitlines()[3:5]}
    assert rows["0"].endswith("8m20s ago STALE") or rows["0"].endswith("8m21s ago STALE")
    assert "READY" in rows["0"]
    assert "DOWN" in rows["2"] and "STALE" not in rows["2"]


async def test_metrics_count_requests_by_route(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        await client.get(BASE)
        await client.get("/v1/ensembles/gpu/nope")
        response = await client.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    route = "/v1/ensembles/{ns}/{name}"
    assert registry.sample("imex_registry_requests_total", route=route, method="GET", code="200")
    assert registry.sample("imex_registry_requests_total", route=route, method="GET", code="404")
    assert 'imex_registry_requests_total{code="404",method="GET"' in response.text
    assert "imex_registry_longpoll_waiters 0.0" in response.text


async def test_docs_and_openapi(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        docs = await client.get("/docs")
        spec = (await client.get("/openapi.json")).json()
    assert docs.status_code == 200 and "swagger" in docs.text.lower()
    status = spec["paths"]["/v1/ensembles/{ns}/{name}/members/{index}/status"]["put"]
    body = status["requestBody"]["content"]["application/json"]["schema"]
    # a newer guest's fields are ignored (and counted), not refused: test_registry_skew.py
    assert body["additionalProperties"] is True
    assert set(body["properties"]) == {
        "imex_state",
        "generation_applied",
        "nodes_config_sha256",
        "hosts_sha256",
        "signals",
        "restarts",
        "agent_version",
        "cert_not_after",
        "imex_domain",
        "fabric",
        "imex_channel0",
        "registry_ca_sha256",
        "imex_channels",
        "preflight",
        "sent",
    }
    assert "$ref" not in json.dumps(body)  # inlined: a #/$defs reference would point nowhere
    assert {"401", "403", "404", "409", "413", "422"} <= set(status["responses"])
    assert set(body["properties"]["sent"]["anyOf"][0]["required"]) == {"boot_id", "boottime_ns"}


# -- guest status over loopback (the address checks with real addresses: test_registry_netns) --


@pytest.fixture
async def loopback_member() -> AsyncIterator[Running]:
    """Member 1 is published at 10.213.9.9; every loopback peer is a trusted proxy."""
    state = State()
    spec = EnsembleSpec(EnsembleId("gpu", "lo"), 2, 50000, token_sha256=SPEC.token_sha256)
    state.set(spec, [Member(1, "10.213.9.9")], [])
    state.mark_synced()
    trusted = RegistryConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
    async with serve(state, trusted) as reg:
        yield reg


REPORT = {"imex_state": "READY", "generation_applied": 1, "signals": 0, "restarts": 0}
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def test_forwarded_for_honoured_only_from_a_trusted_proxy(
    loopback_member: Running,
) -> None:
    url = "/v1/ensembles/gpu/lo/members/1/status"
    async with httpx.AsyncClient(base_url=loopback_member.url) as client:
        direct = await client.put(url, json=REPORT, headers=AUTH)
        assert direct.status_code == 403
        assert "10.213.9.9" in direct.json()["error"] and "127.0.0.1" in direct.json()["error"]
        spoofed_chain = {**AUTH, "X-Forwarded-For": "10.213.9.9, 10.213.7.7"}
        assert (await client.put(url, json=REPORT, headers=spoofed_chain)).status_code == 403
        proxied = await client.put(
            url, json=REPORT, headers={**AUTH, "X-Forwarded-For": "10.213.9.9"}
        )
        assert proxied.status_code == 200, proxied.text
    snap = loopback_member.state.get(EnsembleId("gpu", "lo"))
    assert snap is not None and snap.reports[1].from_ip == "10.213.9.9"


async def test_forwarded_for_ignored_without_trusted_proxies() -> None:
    """uvicorn itself would trust X-Forwarded-For from 127.0.0.1; the registry must not."""
    state = State()
    spec = EnsembleSpec(EnsembleId("gpu", "lo"), 2, 50000, token_sha256=SPEC.token_sha256)
    state.set(spec, [Member(1, "10.213.9.9")], [])
    async with serve(state) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        response = await client.put(
            "/v1/ensembles/gpu/lo/members/1/status",
            json=REPORT,
            headers={**AUTH, "X-Forwarded-For": "10.213.9.9"},
        )
    assert response.status_code == 403
    assert reg.sample("imex_registry_auth_failures_total", reason="wrong_address") == 1


async def test_oversized_body_413_with_and_without_content_length(registry: Running) -> None:
    url = f"{BASE}/members/0/status"
    big = b'{"imex_state": "' + b"x" * 66000 + b'"}'

    async def chunked() -> AsyncIterator[bytes]:
        for start in range(0, len(big), 1000):
            yield big[start : start + 1000]

    async with httpx.AsyncClient(base_url=registry.url) as client:
        declared = await client.put(url, content=big, headers=AUTH)
        assert declared.status_code == 413
        assert "65536" in declared.json()["error"]  # the status PUT's own limit
        streamed = await client.put(url, content=chunked(), headers=AUTH)
        assert streamed.status_code == 413
        assert "content-length" not in {k.lower() for k in streamed.request.headers}
        just_fits = await client.put(url, content=b" " * 65536, headers=AUTH)
        assert just_fits.status_code != 413  # parsed, then refused for its content


async def test_token_checks_come_before_membership_and_body(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        none = await client.put(f"{BASE}/members/0/status", json=REPORT)
        assert none.status_code == 401 and none.headers["www-authenticate"] == "Bearer"
        assert "Authorization: Bearer" in none.json()["error"]
        wrong = await client.put(
            f"{BASE}/members/3/status", content=b"{not json", headers={"Authorization": "Bearer x"}
        )
        assert wrong.status_code == 401 and "wrong token" in wrong.json()["error"]
        absent = await client.put(f"{BASE}/members/3/status", json=REPORT, headers=AUTH)
        assert absent.status_code == 404
        assert absent.json()["error"] == (
            "ensemble gpu/gb200 has no published member 3 (published: 0, 2)"
        )
    assert registry.sample("imex_registry_auth_failures_total", reason="missing_token") == 1
    assert registry.sample("imex_registry_auth_failures_total", reason="wrong_token") == 1


async def test_no_token_configured_refuses_every_report() -> None:
    state = State()
    state.set(EnsembleSpec(EnsembleId("gpu", "open"), 2, 50000), [Member(0, "10.213.9.9")], [])
    async with serve(state) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        response = await client.put(
            "/v1/ensembles/gpu/open/members/0/status", json=REPORT, headers=AUTH
        )
    assert response.status_code == 401
    assert "no imex-ensemble.io/token-sha256 annotation" in response.json()["error"]
    assert hashlib.sha256(b"").hexdigest() not in response.text


async def test_report_accepted_from_any_address_of_the_members_vmi() -> None:
    """Multus layout: IMEX on the secondary network (published), reports over the pod network."""
    state = State()
    spec = EnsembleSpec(EnsembleId("gpu", "lo"), 2, 50000, token_sha256=SPEC.token_sha256)
    state.set(spec, [Member(1, "10.213.9.9")], [], {1: frozenset({"10.213.9.9", "10.244.1.7"})})
    trusted = RegistryConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
    url = "/v1/ensembles/gpu/lo/members/1/status"
    async with serve(state, trusted) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        pod_net = await client.put(
            url, json=REPORT, headers={**AUTH, "X-Forwarded-For": "10.244.1.7"}
        )
        stranger = await client.put(
            url, json=REPORT, headers={**AUTH, "X-Forwarded-For": "10.244.1.8"}
        )
    assert pod_net.status_code == 200, pod_net.text
    assert stranger.status_code == 403
    assert "10.244.1.7" in stranger.json()["error"] and "10.213.9.9" in stranger.json()["error"]
    snap = state.get(EnsembleId("gpu", "lo"))
    assert snap is not None and snap.reports[1].from_ip == "10.244.1.7"
