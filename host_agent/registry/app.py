"""The registry: the host agent's ensembles over HTTP (DESIGN.md "Registry HTTP API").

Reads the same ``State`` the EndpointSlice publisher reads, so the JSON, the
text views and DNS always agree on who is in an ensemble and on the
generation. Everything runs on the event loop thread; no handler blocks.

Long-poll (``?wait=G&timeout=S``): a request whose ``G`` equals the current
generation parks in ``State.wait_for_change``, where all waiters of one
ensemble share one future (and timeouts share one timer per 100 ms bucket):
a change costs one wake-up per ensemble, not a task or timer per request. The
answer is always the *current* snapshot, so it carries the current
generation, also after a timeout. ``timeout`` is capped at
``RegistryConfig.longpoll_cap``. On shutdown ``State.close()`` answers every
parked request at once; ``RegistryServer`` calls it *before* uvicorn starts
waiting for open connections, otherwise a shutdown would hang for a whole
long-poll (uvicorn runs the ASGI lifespan shutdown only after connections
have closed).

The routes live by what they serve: ensemble_routes.py (the reads and the
long-poll), report_routes.py (a guest's status PUT, and the order its checks
run in), cert_routes.py, domain_routes.py and page_routes.py; this module makes
the app from them, with the error answers, health and metrics.

Every error is JSON ``{"error": "<what is wrong and what to do>"}``. Uvicorn
must run with ``proxy_headers=False`` (see ``server_config``): otherwise it
rewrites the peer address from ``X-Forwarded-For`` itself for loopback
peers, behind the back of ``trusted_proxies``.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from host_agent.registry.asgi import BodyLimit, RequestMetrics
from host_agent.registry.auth import (
    RegistryError,
    validation_message,
)
from host_agent.registry.cert_routes import (
    CERT_BODY_LIMIT,
    CERT_PATH_PATTERN,
    CaSource,
    add_certificate_routes,
)
from host_agent.registry.config import CertConfig, RegistryConfig
from host_agent.registry.domain_routes import add_domain_routes
from host_agent.registry.ensemble_metrics import EnsembleCollector
from host_agent.registry.ensemble_routes import EnsembleReads, add_ensemble_routes
from host_agent.registry.metrics import RegistryMetrics
from host_agent.registry.models import TEXT_200, json_errors
from host_agent.registry.page_routes import add_ui_routes
from host_agent.registry.report_routes import STATUS_PATH_PATTERN, ReportSink, add_report_routes
from host_agent.registry.tls_routes import add_tls_routes
from host_agent.registry.version_routes import add_version_routes
from host_agent.state.store import State

log = logging.getLogger("host_agent.registry")  # logger name pinned



_TEXT = "text/plain; charset=utf-8"
_GENERATION_HEADER = "X-Imex-Generation"
#: Set on answers of a replica that is shutting down (guest_agent.peers.registry_io reads it).
CLOSING_HEADER = "X-Imex-Registry"


# -- metrics ------------------------------------------------------------------


# -- the app ----------------------------------------------------------------------------


def create_app(
    state: State,
    config: RegistryConfig,
    metrics_registry: prometheus_client.CollectorRegistry,
    *,
    ca_source: CaSource | None = None,
    cert_config: CertConfig | None = None,
    reports: ReportSink | None = None,
    not_ready: Callable[[], str | None] | None = None,
    registry_ca: Callable[[], str | None] | None = None,
) -> FastAPI:
    """The registry's ASGI app: reads ``state``, registers metrics on ``metrics_registry``.

    ``ca_source`` (the per-ensemble CAs) enables certificate issuing (cert_routes.py);
    ``registry_ca`` gives the registry CA's PEM when HTTPS is served (tls_routes.py).
    ``not_ready`` names why the agent cannot work yet (its start-up checks,
    kube/preflight_io.py), or None; /readyz answers 503 with it.
    """
    metrics = RegistryMetrics(metrics_registry)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # Nothing to close here: uvicorn runs the lifespan's end only after every
        # connection closed, too late for parked long-polls; RegistryServer.shutdown
        # (and the agent's handover) answer them with ``state.close()``.
        yield

    app = FastAPI(
        title="imex-ensemble registry",
        summary="Ensemble membership of KubeVirt VMs for NVIDIA IMEX, and the guests' reports.",
        version="1",
        lifespan=lifespan,
    )

    # -- errors: always {"error": "..."} --

    @app.exception_handler(RegistryError)
    async def on_registry_error(_: Request, exc: RegistryError) -> Response:
        body: dict[str, Any] = {"error": exc.message}
        if exc.detail is not None:
            body["detail"] = exc.detail
        return JSONResponse(body, status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            message = f"no route {request.url.path}; the API is described at /docs"
        elif exc.status_code == 405:
            message = f"{request.method} is not allowed on {request.url.path}; see /docs"
        else:
            message = str(exc.detail)
        return JSONResponse({"error": message}, status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def on_invalid(_: Request, exc: RequestValidationError) -> Response:
        text, detail = validation_message(exc.errors())
        return JSONResponse({"error": text, "detail": detail}, status_code=422)

    @app.exception_handler(Exception)
    async def on_crash(request: Request, exc: Exception) -> Response:
        log.exception("registry: %s %s failed", request.method, request.url.path)
        return JSONResponse(
            {"error": f"internal error ({type(exc).__name__}); see the host agent's log"},
            status_code=500,
        )

    # -- routes --

    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="Readiness: able to work (namespace, token, RBAC), synced (leader or not); "
        "503 with the cause otherwise, and while shutting down",
        responses=json_errors(503),
    )
    async def readyz() -> Response:
        if state.closed:
            return JSONResponse(
                {"error": "not ready: shutting down (long-polls answered, lease released)"},
                status_code=503,
            )
        problem = not_ready() if not_ready is not None else None
        if problem is not None:
            return JSONResponse({"error": f"not ready: {problem}"}, status_code=503)
        if not state.synced:
            return JSONResponse(
                {"error": "not ready: the first full list of VMIs and Services is not in yet"},
                status_code=503,
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", summary="Prometheus metrics", responses=TEXT_200)
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    add_version_routes(app)
    add_tls_routes(app, registry_ca)
    reads = EnsembleReads(state, config, metrics.waiters)
    add_ensemble_routes(app, reads, config.report_stale_after)
    add_report_routes(app, reads, config.trusted_proxies, metrics, reports)
    add_certificate_routes(app, state, ca_source, metrics_registry, config.trusted_proxies,
                           cert_config)
    app.state.domain = add_domain_routes(
        app, state, config.report_stale_after, reads.lookup, metrics_registry)
    metrics_registry.register(EnsembleCollector(state, app.state.domain))
    add_ui_routes(app, state, app.state.domain, reads.lookup, config.report_stale_after)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, per_path=(
        (CERT_PATH_PATTERN, CERT_BODY_LIMIT),
        (STATUS_PATH_PATTERN, config.status_body_bytes),
    ))
    app.add_middleware(RequestMetrics, requests=metrics.requests, routes=app.router.routes)
    return app
