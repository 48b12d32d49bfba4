"""Schemathesis against the registry's own OpenAPI document: no 5xx, answers match the spec.

Bounded: at most 25 generated examples per operation, long-poll cap 0.2 s
(so a generated ``wait`` that happens to match cannot hold a case for long).
Every default check runs (server errors, status codes and content types the
document declares, response bodies against their schemas); the bearer token
is sent, and requests come from member 0's address, so generated reports
are accepted and then shown (``guest``) in the ensemble's answers.
"""

from __future__ import annotations

import hashlib
import time
from typing import Any

import prometheus_client
import schemathesis
from hypothesis import HealthCheck, settings

from host_agent.registry.app import create_app
from host_agent.registry.config import RegistryConfig
from host_agent.state.snapshot import EnsembleSpec, GuestReport
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member

TOKEN = "schema token"


def _as_member(app: Any) -> Any:
    """The ASGI test client calls from "testclient"; present the member's address instead."""

    async def wrapped(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope = {**scope, "client": ("10.0.0.10", 40000)}
        await app(scope, receive, send)

    return wrapped


def _app() -> Any:
    state = State()
    ens = EnsembleId("gpu", "gb200")
    spec = EnsembleSpec(ens, 4, 50000, token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
    state.set(spec, [Member(0, "10.0.0.10", "gb200-0", "n", "Running", True)], ["a problem"])
    state.report(ens, 0, GuestReport(time.time() - 999, "10.0.0.10", {"imex_state": "READY"}))
    state.mark_synced()
    config = RegistryConfig(longpoll_cap=0.2, longpoll_default=0.2)
    return _as_member(create_app(state, config, prometheus_client.CollectorRegistry()))


schema = schemathesis.openapi.from_asgi("/openapi.json", _app())


@schema.parametrize()
@settings(
    max_examples=25,
    deadline=None,
    suppress_health_check=list(HealthCheck),
    derandomize=True,
)
def test_no_server_errors_and_answers_match_the_spec(case: schemathesis.Case) -> None:
    case.call_and_validate(headers={"Authorization": f"Bearer {TOKEN}"})
