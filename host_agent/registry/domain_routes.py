"""The registry's domain routes and metrics: ``GET .../domain`` and ``imex_ensemble_*``.

Registered from ``registry.create_app`` (docs/host-agent.md "The IMEX domain"). Every
answer comes from ``domain_view.aggregate`` over the snapshot the other routes read, so
the JSON, the matrix, the page and the metrics agree. Aggregating costs ~18² steps, so a
view is remembered per ensemble until its snapshot changes (every report replaces it)
or a report in it turns stale, whichever comes first: a metrics scrape of 1,000
ensembles, or 32 browsers on one page, aggregate each snapshot once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from typing import Annotated, Literal

import prometheus_client
from fastapi import FastAPI, Query
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from host_agent.registry import views
from host_agent.registry.domain_view import (
    LINK_STATES,
    STATUSES,
    DomainView,
    aggregate,
    domain_json,
    matrix_text,
)
from host_agent.registry.guest_checks import check_counts
from host_agent.registry.params import Name, Namespace, error_responses
from host_agent.state.snapshot import EnsembleSnapshot
from host_agent.state.store import State
from imex_shared.model import EnsembleId

Lookup = Callable[[EnsembleId], EnsembleSnapshot]
DomainFormat = Annotated[
    Literal["json", "matrix"], Query(description="json (default) or matrix (text/plain)")]


class DomainCache:
    """Aggregated views by ensemble, valid while the snapshot and every report's freshness
    stay the same (a cache: dropping it changes nothing but cost)."""

    LIMIT = 4096

    def __init__(self, stale_after: float, clock: Callable[[], float] = time.time) -> None:
        self.stale_after = stale_after
        self.clock = clock
        self._views: dict[EnsembleId, tuple[EnsembleSnapshot, float, DomainView]] = {}

    def view(self, snap: EnsembleSnapshot, now: float | None = None) -> DomainView:
        now = self.clock() if now is None else now
        hit = self._views.get(snap.ens)
        if hit is not None and hit[0] is snap and now < hit[1]:
            return hit[2]
        view = aggregate(snap, now, self.stale_after)
        # the view changes when the next fresh report turns stale
        turns = [r.received_at + self.stale_after for r in snap.reports.values()
                 if r.received_at + self.stale_after >= now]
        until = min(turns, default=math.inf)
        if len(self._views) >= self.LIMIT:
            self._views.clear()
        self._views[snap.ens] = (snap, until, view)
        return view


class DomainCollector(Collector):
    """``imex_ensemble_domain_status``, ``_links``, ``_cliques``, ``_silent_members``.

    Computed at scrape time from the state, so an ensemble that goes leaves no series
    behind. Link counts are by state over the expected pairs, never one series per link.
    """

    def __init__(self, state: State, cache: DomainCache) -> None:
        self.state = state
        self.cache = cache

    def describe(self) -> Iterator[GaugeMetricFamily]:
        return iter(())  # unchecked collector: families are known only at scrape time

    def collect(self) -> Iterator[GaugeMetricFamily]:
        labels = ["namespace", "ensemble"]
        status = GaugeMetricFamily(
            "imex_ensemble_domain_status",
            "1 for the IMEX domain's current status (UP, DEGRADED, DOWN, UNKNOWN), else 0",
            labels=[*labels, "status"])
        links = GaugeMetricFamily(
            "imex_ensemble_links",
            "Expected member links (same clique) by the state their own member reports; "
            "UNKNOWN: no fresh report with a -N -j view", labels=[*labels, "state"])
        cliques = GaugeMetricFamily(
            "imex_ensemble_cliques", "NVLink cliques the ensemble's members report",
            labels=labels)
        silent = GaugeMetricFamily(
            "imex_ensemble_silent_members",
            "Published members without a fresh status report (--report-stale-after)",
            labels=labels)
        checks = GaugeMetricFamily(
            "imex_ensemble_guest_checks",
            "Members whose fresh report has this preflight check with this result",
            labels=[*labels, "check", "result"])
        now = self.cache.clock()
        for snap in self.state.all():
            view = self.cache.view(snap, now)
            key = [snap.ens.namespace, snap.ens.name]
            for s in STATUSES:
                status.add_metric([*key, s], 1.0 if view.status == s else 0.0)
            for s in LINK_STATES:
                links.add_metric([*key, s], float(view.link_counts.get(s, 0)))
            cliques.add_metric(key, float(len(view.cliques)))
            silent.add_metric(key, float(len(view.silent)))
            for (name, result), n in sorted(
                    check_counts(snap, now, self.cache.stale_after).items()):
                checks.add_metric([*key, name, result], float(n))
        yield from (status, links, cliques, silent, checks)


def add_domain_routes(
    app: FastAPI,
    state: State,
    stale_after: float,
    lookup: Lookup,
    metrics_registry: prometheus_client.CollectorRegistry,
) -> DomainCache:
    """Register ``/domain`` and the domain metrics; returns the cache the page shares."""
    cache = DomainCache(stale_after)
    metrics_registry.register(DomainCollector(state, cache))

    @app.get(
        "/v1/ensembles/{ns}/{name}/domain",
        summary="The IMEX domain: member states, links, partitions, cliques (?format=matrix)",
        responses={200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
                   **error_responses(404, 422)},
    )
    async def get_domain(
        ns: Namespace,
        name: Name,
        format: DomainFormat = "json",
    ) -> Response:
        snap = lookup(EnsembleId(ns, name))
        view = cache.view(snap)
        headers = {"X-Imex-Generation": str(snap.generation)}
        if format == "matrix":
            return PlainTextResponse(matrix_text(view), media_type="text/plain; charset=utf-8",
                                     headers=headers)
        return JSONResponse(domain_json(view, views.rfc3339), headers=headers)

    return cache
