"""Per-ensemble metrics of what this replica serves: generation, READY members, report age,
shared cliques.

``imex_registry_generation{namespace,ensemble}`` is the generation this replica serves.
With leader election every replica serves only pairs it observed in the API, so a
replica whose number stays below the other replicas' is behind the API (a stuck watch):
the alert ImexRegistryGenerationBehind compares them (docs/runbooks.md).
``imex_ensemble_members_ready`` and ``imex_ensemble_report_age_seconds`` come from the
same cached domain view as domain_routes.py's families, so they agree with ``/domain``.
``imex_ensemble_cliques_shared`` counts this ensemble's NVLink cliques that another
ensemble's members report too (``CliqueShared``, state/shared.py): the alert
ImexCliqueShared reads it.

Computed at scrape time from the state, like ``DomainCollector``: an ensemble that goes
leaves no series behind. Four series per ensemble.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from host_agent.registry.domain_routes import DomainCache
from host_agent.registry.domain_view import READY, DomainView
from host_agent.state.store import State


def members_ready(view: DomainView) -> int:
    """Published members whose fresh report says IMEX is READY."""
    return sum(1 for m in view.members if m.reporting and m.imex_state == READY)


def oldest_report_age(view: DomainView, now: float) -> float | None:
    """Seconds since the published member that reported longest ago last reported; None
    when no published member has reported (those are ``imex_ensemble_silent_members``)."""
    times = [m.reported_at for m in view.members if m.reported_at is not None]
    return max(0.0, now - min(times)) if times else None


class EnsembleCollector(Collector):
    """``imex_registry_generation``, ``imex_ensemble_members_ready``,
    ``imex_ensemble_report_age_seconds`` and ``imex_ensemble_cliques_shared``."""

    def __init__(self, state: State, cache: DomainCache) -> None:
        self.state = state
        self.cache = cache

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # unchecked collector: families are known only at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "ensemble"]
        generation = GaugeMetricFamily(
            "imex_registry_generation",
            "The membership generation this replica serves (replicas that agree with the "
            "API serve the same number)", labels=labels)
        ready = GaugeMetricFamily(
            "imex_ensemble_members_ready",
            "Published members whose fresh status report says IMEX is READY", labels=labels)
        age = GaugeMetricFamily(
            "imex_ensemble_report_age_seconds",
            "Seconds since the published member that reported longest ago last reported "
            "(no series while no member has reported)", labels=labels)
        shared = GaugeMetricFamily(
            "imex_ensemble_cliques_shared",
            "NVLink cliques of this ensemble that another ensemble's members report too "
            "(the CliqueShared condition)", labels=labels)
        now = self.cache.clock()
        for snap in self.state.all():
            key = [snap.ens.namespace, snap.ens.name]
            view = self.cache.view(snap, now)
            generation.add_metric(key, float(snap.generation))
            ready.add_metric(key, float(members_ready(view)))
            shared.add_metric(key, float(len(snap.shared)))
            oldest = oldest_report_age(view, now)
            if oldest is not None:
                age.add_metric(key, oldest)
        yield from (generation, ready, age, shared)
