"""Prometheus metrics of the watching and publishing side of the host agent.

Everything lives on the CollectorRegistry passed in (the registry's HTTP app
serves the same one at /metrics), so tests and two agents in one process
never share counters; there are no module globals. Per-ensemble gauges are
removed when the ensemble goes, so the series count follows the cluster.
"""

from __future__ import annotations

import contextlib

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from imex_shared.version import package_version

_P = "imex_host_agent_"


class HostMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry
        self.watch_restarts = Counter(
            _P + "watch_restarts",
            "Watches restarted, by kind and reason (gone: relist after 410; error: after backoff; "
            "forbidden: list permitted, watch not, so listed again every 30 s)",
            ["kind", "reason"],
            registry=registry,
        )
        self.watch_events = Counter(
            _P + "watch_events",
            "Watch events received, by kind and event type",
            ["kind", "type"],
            registry=registry,
        )
        self.lists = Counter(
            _P + "lists", "Full lists done (start and every relist), by kind", ["kind"],
            registry=registry,
        )
        self.synced = Gauge(
            _P + "informer_synced", "1 once the first full list of a kind is in", ["kind"],
            registry=registry,
        )
        self.applies = Counter(
            _P + "slice_writes",
            "EndpointSlice writes sent (op: apply or delete)",
            ["op"],
            registry=registry,
        )
        self.apply_errors = Counter(
            _P + "slice_write_errors", "EndpointSlice writes that failed", registry=registry
        )
        self.echoes = Counter(
            _P + "slice_echoes",
            "EndpointSlice events that were our own last write coming back (no pass queued)",
            registry=registry,
        )
        self.service_writes = Counter(
            _P + "service_writes",
            "Writes of ImexEnsembles' own Services (op: create, adopt, apply)",
            ["op"],
            registry=registry,
        )
        self.status_writes = Counter(
            _P + "status_writes",
            "ImexEnsemble status evaluations, by result (written; unchanged: nothing to "
            "write; error: the write failed and is retried)",
            ["result"],
            registry=registry,
        )
        self.events = Counter(
            _P + "events",
            "Events on ImexEnsembles and ensemble Services, by result (created; repeat: "
            "folded into a series; series: a series patch written; dropped: over the "
            "per-object budget; error: the write failed)",
            ["result"],
            registry=registry,
        )
        self.reconciles = Counter(
            _P + "reconciles", "Ensemble reconcile passes, by result", ["result"],
            registry=registry,
        )
        self.reconcile_seconds = Histogram(
            _P + "reconcile_seconds",
            "Time of one ensemble reconcile pass",
            buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0),
            registry=registry,
        )
        self.members = Gauge(
            _P + "members_published",
            "Members published per ensemble",
            ["namespace", "ensemble"],
            registry=registry,
        )
        self.problems = Gauge(
            _P + "problems",
            "Problems per ensemble Service (VMIs and annotations), including refused Services",
            ["namespace", "ensemble"],
            registry=registry,
        )

        self.leader = Gauge(
            _P + "leader",
            "1 while this replica holds the Lease and may write (0 without leader election: see "
            "imex_host_agent_leader_elect)",
            registry=registry,
        )
        self.leader_elect = Gauge(
            _P + "leader_elect", "1 when this replica takes part in leader election",
            registry=registry,
        )
        self.leader_transitions = Counter(
            _P + "leader_transitions",
            "Changes of the Lease's holder this replica observed (its own takeovers included)",
            registry=registry,
        )
        self._transitions = 0
        self.membership_writes = Counter(
            _P + "membership_writes",
            "Writes of an ensemble's persisted (generation, membership) pair, by result",
            ["result"],
            registry=registry,
        )
        self.report_decisions = Counter(
            _P + "report_decisions",
            "Guest reports this replica received, by what it did: written for news (new, "
            "changed, counts), refresh (the stored copy was old), held (a heartbeat, not written), "
            "newer (a later report written back over an older copy)",
            ["decision"],
            registry=registry,
        )
        self.api_requests = Counter(
            _P + "api_requests",
            "Requests to the Kubernetes API, by verb (get, list, watch, create, update, patch, "
            "apply, delete, ...), resource (plural, /subresource) and code (HTTP status; "
            "error: no answer)",
            ["verb", "resource", "code"],
            registry=registry,
        )
        self.report_writes = Counter(
            _P + "report_writes",
            "Reports ConfigMap writes sent (one per coalesced batch of an ensemble)",
            registry=registry,
        )
        #: the release this agent runs (pyproject's version, imex_shared.version)
        self.build_info = Gauge(
            "imex_build_info", "1, labelled with the imex-ensemble release this agent runs",
            ["version"], registry=registry,
        )
        self.build_info.labels(package_version()).set(1)

    def count_request(self, verb: str, resource: str, code: str) -> None:
        self.api_requests.labels(verb, resource, code).inc()

    def set_leader(self, leading: bool) -> None:
        self.leader.set(1 if leading else 0)

    def set_transitions(self, total: int) -> None:
        if total > self._transitions:
            self.leader_transitions.inc(total - self._transitions)
            self._transitions = total

    def set_ensemble(self, namespace: str, name: str, members: int, problems: int) -> None:
        self.members.labels(namespace, name).set(members)
        self.problems.labels(namespace, name).set(problems)

    def drop_ensemble(self, namespace: str, name: str) -> None:
        for gauge in (self.members, self.problems):
            with contextlib.suppress(KeyError):
                gauge.remove(namespace, name)
