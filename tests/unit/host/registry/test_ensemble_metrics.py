"""imex_registry_generation, imex_ensemble_members_ready and imex_ensemble_report_age_seconds
from a State with reports (the collector on a real CollectorRegistry, scraped as text)."""

from __future__ import annotations

import dataclasses

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from host_agent.registry.domain_routes import DomainCache
from host_agent.registry.ensemble_metrics import EnsembleCollector, members_ready, oldest_report_age
from host_agent.state.snapshot import EnsembleSnapshot, EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.unit.host.registry.domain_fixtures import ENS, NOW, full, report, snapshot


def scrape(registry: CollectorRegistry) -> dict[tuple[str, str, str], float]:
    """(metric, namespace, ensemble) -> value, parsed from the text exposition."""
    text = generate_latest(registry).decode()
    return {(s.name, s.labels["namespace"], s.labels["ensemble"]): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_ready_counts_fresh_ready_reports_and_age_is_the_oldest() -> None:
    cache = DomainCache(stale_after=60.0, clock=lambda: NOW)
    snap = snapshot(3, {0: report(0, 3, at=NOW - 5), 1: report(1, 3, state="NOT_READY",
                                                              at=NOW - 20)})
    view = cache.view(snap, NOW)
    assert members_ready(view) == 1
    assert oldest_report_age(view, NOW) == 20.0
    assert oldest_report_age(cache.view(snapshot(2), NOW), NOW) is None
    assert members_ready(cache.view(full(4), NOW)) == 4


def test_the_collector_exports_four_series_per_ensemble_and_forgets_a_gone_one() -> None:
    now = [1000.0]
    state = State(clock=lambda: now[0])
    state.set(EnsembleSpec(ENS, 4, 50000), [Member(i, f"10.0.0.{i + 10}") for i in range(2)],
              [])
    registry = CollectorRegistry()
    registry.register(EnsembleCollector(state, DomainCache(60.0, clock=lambda: now[0])))
    got = scrape(registry)
    snap = state.get(ENS)
    assert snap is not None
    key = (ENS.namespace, ENS.name)
    assert got[("imex_registry_generation", *key)] == snap.generation
    assert got[("imex_ensemble_members_ready", *key)] == 0
    assert ("imex_ensemble_report_age_seconds", *key) not in got  # nobody reported yet
    assert got[("imex_ensemble_cliques_shared", *key)] == 0
    now[0] = 1010.0
    state.report(ENS, 0, report(0, 2, at=1005.0))
    got = scrape(registry)
    assert got[("imex_ensemble_report_age_seconds", *key)] == 5.0
    assert got[("imex_ensemble_members_ready", *key)] == 1
    state.drop(ENS)
    assert scrape(registry) == {}


class _Snapshots:
    def __init__(self, *snaps: EnsembleSnapshot) -> None:
        self.snaps = snaps

    def all(self) -> list[EnsembleSnapshot]:
        return list(self.snaps)


def test_shared_cliques_are_counted() -> None:
    other = EnsembleId("rack-b", "gb300")
    snap = dataclasses.replace(full(2), shared=(("uuid.1", (other,)), ("uuid.2", (other,))))
    registry = CollectorRegistry()
    registry.register(EnsembleCollector(_Snapshots(snap),  # type: ignore[arg-type]
                                        DomainCache(60.0, clock=lambda: NOW)))
    assert scrape(registry)[("imex_ensemble_cliques_shared", ENS.namespace, ENS.name)] == 2
