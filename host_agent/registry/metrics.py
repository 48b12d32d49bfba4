"""The registry's own Prometheus metrics (the domain's are domain_routes.py's)."""

from __future__ import annotations

import prometheus_client
from prometheus_client import Counter, Gauge

#: auth.py's refusals: 401 for the token, 403 for the caller (wrong_address) or for a
#: token over plain HTTP to a registryTLS Required ensemble (plain_http). The alert
#: ImexGuestReportsRefused reads every reason.
AUTH_REASONS = ("no_token_configured", "bad_token_annotation", "missing_token", "wrong_token",
                "wrong_address", "plain_http")


class RegistryMetrics:
    """The registry's Prometheus metrics, registered on the agent's registry."""

    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self.requests = Counter(
            "imex_registry_requests",
            "Registry HTTP requests by route template, method and status code.",
            ("route", "method", "code"),
            registry=registry,
        )
        self.waiters = Gauge(
            "imex_registry_longpoll_waiters",
            "Long-poll requests currently parked waiting for a generation change.",
            registry=registry,
        )
        self.reports = Counter(
            "imex_registry_reports",
            "Guest status reports accepted, by ensemble.",
            ("namespace", "ensemble"),
            registry=registry,
        )
        self.auth_failures = Counter(
            "imex_registry_auth_failures",
            "Guest status reports refused by authentication or address checks, by reason.",
            ("reason",),
            registry=registry,
        )
        for reason in AUTH_REASONS:  # series from 0, so that rate() sees the first refusal
            self.auth_failures.labels(reason)
        self.unknown_fields = Counter(
            "imex_registry_unknown_report_fields",
            "Report fields the registry does not know (a newer guest's), ignored, by name: "
            "the first 16 names seen get a label of their own, any later one is 'other'",
            ("field",),
            registry=registry,
        )
