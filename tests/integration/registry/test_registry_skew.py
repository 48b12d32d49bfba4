"""Version skew at the registry: ``GET /version``, and reports from a newer guest.

A guest upgraded before its host agent sends fields this registry does not know: the
report is accepted, the unknown fields are counted under a bounded set of labels and
logged once each, and every field the registry knows keeps its strict check.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from host_agent.registry import report_routes
from host_agent.registry.config import RegistryConfig
from imex_shared.version import package_version, series
from tests.integration.registry.registry_harness import TOKEN, Running, seeded_state, serve

URL = "/v1/ensembles/gpu/gb200/members/0/status"
AUTH = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": "10.213.0.10"}
COUNTER = "imex_registry_unknown_report_fields_total"


@pytest.fixture
async def reg() -> AsyncIterator[Running]:
    config = RegistryConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
    async with serve(seeded_state(), config) as running:
        yield running


async def test_version_names_the_release_and_the_guests_it_supports(reg: Running) -> None:
    async with httpx.AsyncClient(base_url=reg.url) as client:
        doc = (await client.get("/version")).json()
    version = package_version()
    major, minor = series(version) or (0, 0)
    assert doc == {"version": version, "api": "v1", "min_guest": f"{major}.{max(0, minor - 1)}",
                   "max_guest": f"{major}.{minor}"}


async def test_unknown_fields_are_ignored_counted_and_logged_once(
        reg: Running, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="host_agent.registry")
    body = {"imex_state": "READY", "agent_version": "0.3.0", "channels": [0, 1],
            "workload_hints": {"ok": True, "checks": ["gpu"]}}  # 0.3's, say
    async with httpx.AsyncClient(base_url=reg.url) as client:
        for _ in range(3):
            answer = await client.put(URL, json=body, headers=AUTH)
            assert answer.status_code == 200, answer.text
        shown = (await client.get("/v1/ensembles/gpu/gb200")).json()
        # what the registry knows stays strict, unknown fields beside it or not
        bad = await client.put(URL, json={**body, "signals": "7"}, headers=AUTH)
        assert bad.status_code == 422 and "signals" in bad.json()["error"]
    kept = reg.state.get(seeded_state().all()[0].ens).reports[0]  # type: ignore[union-attr]
    assert "channels" not in kept.fields and "workload_hints" not in kept.fields
    assert kept.fields["transport"] == "http"
    guest = shown["members"][0]["guest"]
    assert guest["imex_state"] == "READY" and guest["transport"] == "http"
    assert "channels" not in guest
    assert reg.sample(COUNTER, field="channels") == 3
    assert reg.sample(COUNTER, field="workload_hints") == 3
    said = [r.getMessage() for r in caplog.records if "ignoring report field" in r.getMessage()]
    assert len(said) == 2 and all(r.levelname == "INFO" for r in caplog.records
                                  if "ignoring report field" in r.getMessage())
    assert "'channels'" in said[0] and "gpu/gb200 member 0" in said[0] and "0.3.0" in said[0]


async def test_the_label_set_is_bounded(reg: Running) -> None:
    names = [f"field_{i:03d}" for i in range(report_routes.UNKNOWN_FIELD_LABELS + 10)]
    body: dict[str, object] = {"imex_state": "READY", **dict.fromkeys(names, 1),
                               "Not A Name!": 1}
    async with httpx.AsyncClient(base_url=reg.url) as client:
        assert (await client.put(URL, json=body, headers=AUTH)).status_code == 200
    labelled = {s.labels["field"] for metric in reg.metrics.collect()
                for s in metric.samples if s.name == COUNTER}
    assert len(labelled) == report_routes.UNKNOWN_FIELD_LABELS + 1
    assert reg.sample(COUNTER, field="other") == 11
