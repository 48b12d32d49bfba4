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

Guest status (``PUT .../members/{index}/status``) is checked in this order,
so a caller learns nothing it is not entitled to: body size (413, before
anything is parsed, also for chunked bodies), ensemble exists (404), bearer
token (401: sha256 of the token compared in constant time with the Service's
``imex-ensemble.io/token-sha256``), member published (404), caller address
equals the member's published IP (403; ``X-Forwarded-For`` is honoured only
when the direct peer is in a trusted proxy network), body schema (422). The
report is stored with ``State.report`` and never changes the generation.

Every error is JSON ``{"error": "<what is wrong and what to do>"}``. Uvicorn
must run with ``proxy_headers=False`` (see ``server_config``): otherwise it
rewrites the peer address from ``X-Forwarded-For`` itself for loopback
peers, behind the back of ``trusted_proxies``.
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any, Protocol

import prometheus_client
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from host_agent.registry import views
from host_agent.registry.asgi import BodyLimit, RequestMetrics
from host_agent.registry.auth import (
    AuthFailure,
    IPNetwork,
    RegistryError,
    authenticate_member,
    caller_address,
    check_token,
    validation_message,
)
from host_agent.registry.cert_routes import (
    CERT_BODY_LIMIT,
    CERT_PATH_PATTERN,
    CaSource,
    CertConfig,
    add_certificate_routes,
)
from host_agent.registry.domain_models import index_errors, reduce_links
from host_agent.registry.domain_routes import add_domain_routes
from host_agent.registry.models import (
    EnsembleOut,
    ErrorOut,
    ListOut,
    StatusAccepted,
    StatusReport,
    inline_schema,
)
from host_agent.registry.page_routes import add_ui_routes
from host_agent.registry.params import (
    Format,
    HostsMember,
    Name,
    Namespace,
    NodesMode,
    SlotIndex,
    Timeout,
    Wait,
)
from host_agent.state.store import EnsembleSnapshot, GuestReport, State, report_counts
from imex_shared.model import EnsembleId, ModelError

__all__ = [
    "BodyLimit",
    "RegistryConfig",
    "RegistryError",
    "RegistryServer",
    "RenderedJson",
    "StatusReport",
    "caller_address",
    "check_token",
    "create_app",
    "server_config",
]

log = logging.getLogger("host_agent.registry")  # logger name pinned



_TEXT = "text/plain; charset=utf-8"
_GENERATION_HEADER = "X-Imex-Generation"
#: Set on answers of a replica that is shutting down (guest_agent.peers.registry_io reads it).
CLOSING_HEADER = "X-Imex-Registry"


#: How long a status PUT waits for its report to be stored in the API (the guest's own
#: read timeout is 10 s; a 503 makes it send the report again).
REPORT_PERSIST_TIMEOUT = 5.0


class ReportSink(Protocol):
    """Where an accepted report is persisted (host_agent/persist/reports.py), across replicas."""

    async def persist(self, ens: EnsembleId, index: int, report: GuestReport, *,
                      since: float) -> None:
        """Returns once the report is in the API, or at once when it has no news
        (a heartbeat: ``reports.persist_reason``); ``since``: the member's."""
        ...


@dataclass(frozen=True)
class RegistryConfig:
    """The registry's settings (one frozen object, passed explicitly).

    ``trusted_proxies``: networks whose ``X-Forwarded-For`` names the real
    caller (``--trusted-proxy CIDR``). ``report_stale_after``: seconds after
    which a guest's last report is shown as stale. ``longpoll_default`` is
    used when ``wait`` comes without ``timeout``; ``longpoll_cap`` bounds any
    ``timeout``.
    """

    trusted_proxies: tuple[IPNetwork, ...] = ()
    report_stale_after: float = 120.0
    max_body_bytes: int = 16384
    #: the status PUT carries an 18-node ``nvidia-imex-ctl -N -j`` (~25 KB) with headroom
    status_body_bytes: int = 65536
    longpoll_cap: float = 60.0
    longpoll_default: float = 30.0


#: the status PUT's path (its own body limit, ``status_body_bytes``)
STATUS_PATH_PATTERN = r"^/v1/ensembles/[^/]+/[^/]+/members/[^/]+/status$"


# -- metrics ------------------------------------------------------------------


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


def _errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Error answers: always JSON, also on routes whose success is text/plain."""
    content = {"application/json": {"schema": ErrorOut.model_json_schema()}}
    return {code: {"content": content} for code in codes}


_TEXT_200: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
}


# -- the app ----------------------------------------------------------------------------


class RenderedJson:
    """An ensemble's JSON body, encoded once per snapshot and tenth of a second.

    Why: a change answers every parked long-poll of the ensemble at once (5,000
    in the benchmark) with the same document; building and encoding it per
    waiter was most of the wake-up time. The body depends on the snapshot
    (replaced, never mutated, on every change or report) and on the clock only
    through ``age_s``/``stale``, and ``age_s`` is rounded to 0.1 s, so a body made
    within the same 0.1 s is the body. Bytes are what JSONResponse would send.
    """

    LIMIT = 4096  # ensembles remembered; cleared beyond (a cache, never the truth)

    def __init__(self, stale_after: float) -> None:
        self._stale_after = stale_after
        self._last: dict[EnsembleId, tuple[EnsembleSnapshot, int, bytes]] = {}

    def body(self, snap: EnsembleSnapshot, now: float) -> bytes:
        tick = int(now * 10)
        hit = self._last.get(snap.ens)
        if hit is not None and hit[0] is snap and hit[1] == tick:
            return hit[2]
        body = bytes(JSONResponse(views.ensemble_json(snap, now, self._stale_after)).body)
        if len(self._last) >= self.LIMIT:
            self._last.clear()
        self._last[snap.ens] = (snap, tick, body)
        return body


def create_app(
    state: State,
    config: RegistryConfig,
    metrics_registry: prometheus_client.CollectorRegistry,
    *,
    ca_source: CaSource | None = None,
    cert_config: CertConfig | None = None,
    reports: ReportSink | None = None,
) -> FastAPI:
    """The registry's ASGI app: reads ``state``, registers metrics on ``metrics_registry``.

    ``ca_source`` (the per-ensemble CAs) enables certificate issuing (registry_certs.py).
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

    def now() -> float:
        return time.time()

    rendered = RenderedJson(config.report_stale_after)

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

    # -- helpers bound to state/config --

    def lookup(ens: EnsembleId) -> EnsembleSnapshot:
        snap = state.get(ens)
        if snap is not None:
            return snap
        hint = f"is the Service labelled imex-ensemble.io/ensemble={ens.name}?"
        if not state.synced:
            hint = "the host agent has not finished its first list yet, see /readyz"
        raise RegistryError(404, f"no ensemble {ens.key} ({hint})")

    async def current(ens: EnsembleId, wait: int | None, timeout: float | None) -> EnsembleSnapshot:
        snap = lookup(ens)
        if wait is None or snap.generation > wait or state.closed:
            return snap
        limit = config.longpoll_default if timeout is None else timeout
        metrics.waiters.inc()
        try:
            later = await state.wait_for_change(ens, wait, min(limit, config.longpoll_cap))
        finally:
            metrics.waiters.dec()
        if later is None:
            raise RegistryError(404, f"ensemble {ens.key} was deleted while you waited")
        return later

    def headers(snap: EnsembleSnapshot) -> dict[str, str]:
        """The generation, and on a replica that is shutting down a word for the guest
        to ask again at once (through the Service, so another replica answers)."""
        out = {_GENERATION_HEADER: str(snap.generation)}
        if state.closed:
            out[CLOSING_HEADER] = "closing"
            out["Connection"] = "close"
        return out

    def text(body: bytes | str, snap: EnsembleSnapshot) -> Response:
        return PlainTextResponse(body, media_type=_TEXT, headers=headers(snap))

    # -- routes --

    @app.get("/healthz", summary="Liveness: the process answers")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get(
        "/readyz",
        summary="Readiness: synced and able to serve (leader or not); 503 while shutting down",
        responses=_errors(503),
    )
    async def readyz() -> Response:
        if state.closed:
            return JSONResponse(
                {"error": "not ready: shutting down (long-polls answered, lease released)"},
                status_code=503,
            )
        if not state.synced:
            return JSONResponse(
                {"error": "not ready: the first full list of VMIs and Services is not in yet"},
                status_code=503,
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics", summary="Prometheus metrics", responses=_TEXT_200)
    async def metrics_text() -> Response:
        return Response(generate_latest(metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/ensembles", summary="All ensembles", response_model=ListOut)
    async def list_ensembles() -> Response:
        return JSONResponse(views.list_json(state.all()))

    @app.get(
        "/v1/ensembles/{ns}/{name}",
        summary="One ensemble (long-poll with ?wait=G; ?format=table for people)",
        response_model=EnsembleOut,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **_errors(404, 422),
        },
    )
    async def get_ensemble(
        ns: Namespace,
        name: Name,
        wait: Wait = None,
        timeout: Timeout = None,
        format: Format = "json",
    ) -> Response:
        snap = await current(EnsembleId(ns, name), wait, timeout)
        if format == "table":
            return text(views.ensemble_table(snap, now(), config.report_stale_after), snap)
        return Response(
            rendered.body(snap, now()), media_type="application/json", headers=headers(snap),
        )

    @app.get(
        "/v1/ensembles/{ns}/{name}/nodes_config",
        summary="The nodes_config.cfg a guest writes",
        response_class=PlainTextResponse,
        responses={**_TEXT_200, **_errors(404, 422, 500)},
    )
    async def get_nodes_config(
        ns: Namespace,
        name: Name,
        mode: NodesMode = "names",
        wait: Wait = None,
        timeout: Timeout = None,
    ) -> Response:
        snap = await current(EnsembleId(ns, name), wait, timeout)
        try:
            return text(views.nodes_config(snap, mode), snap)
        except ModelError as exc:
            raise RegistryError(
                500, f"cannot render nodes_config of {snap.ens.key}: {exc}"
            ) from exc

    @app.get(
        "/v1/ensembles/{ns}/{name}/hosts",
        summary="The /etc/hosts block a guest writes",
        response_class=PlainTextResponse,
        responses={**_TEXT_200, **_errors(404, 422, 500)},
    )
    async def get_hosts(
        ns: Namespace, name: Name, wait: Wait = None, timeout: Timeout = None,
        member: HostsMember = None,
    ) -> Response:
        snap = await current(EnsembleId(ns, name), wait, timeout)
        if member is not None and snap.member(member) is None:
            published = ", ".join(str(p.index) for p in snap.members) or "none"
            raise RegistryError(404, f"ensemble {snap.ens.key} has no published member "
                                     f"{member} (published: {published})")
        try:
            return text(views.hosts(snap, member), snap)
        except ModelError as exc:
            raise RegistryError(500, f"cannot render hosts of {snap.ens.key}: {exc}") from exc

    @app.put(
        "/v1/ensembles/{ns}/{name}/members/{index}/status",
        summary="A guest reports its IMEX status (bearer token; from the member's own IP)",
        response_model=StatusAccepted,
        responses=_errors(400, 401, 403, 404, 413, 422),
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": inline_schema(StatusReport)}},
            }
        },
    )
    async def put_status(
        ns: Namespace,
        name: Name,
        index: SlotIndex,
        request: Request,
    ) -> Response:
        ens = EnsembleId(ns, name)
        snap = lookup(ens)
        try:
            pub, caller = authenticate_member(
                snap, index, request.headers.get("authorization"),
                request.client.host if request.client else None,
                request.headers.getlist("x-forwarded-for"), config.trusted_proxies,
            )
        except AuthFailure as exc:
            metrics.auth_failures.labels(exc.reason).inc()
            log.warning("registry: report for %s member %d refused: %s", ens.key, index, exc.reason)
            raise
        try:
            report = StatusReport.model_validate_json(await request.body())
        except ValidationError as exc:
            message, detail = validation_message(exc.errors())
            return JSONResponse({"error": message, "detail": detail}, status_code=422)
        received = now()
        guest = guest_report(report, snap, index, received, str(caller))
        state.report(ens, index, guest)
        if reports is not None:  # news into the API before the answer: no replica loses it
            try:
                async with asyncio.timeout(REPORT_PERSIST_TIMEOUT):
                    await reports.persist(ens, index, guest, since=pub.since)
            except Exception as exc:
                log.warning("registry: report for %s member %d not persisted: %s",
                            ens.key, index, exc)
                return JSONResponse(
                    {"error": f"report shown by this replica but not yet stored in the API "
                     f"({type(exc).__name__}: {exc}); send it again"}, status_code=503)
        metrics.reports.labels(ens.namespace, ens.name).inc()
        current_snap = state.get(ens) or snap
        return JSONResponse(
            {"generation": current_snap.generation, "received_at": views.rfc3339(received)},
            headers=headers(current_snap),  # a closing replica: the guest resends its view
        )

    add_certificate_routes(app, state, ca_source, metrics_registry, config.trusted_proxies,
                           cert_config)
    app.state.domain = add_domain_routes(
        app, state, config.report_stale_after, lookup, metrics_registry)
    add_ui_routes(app, state, app.state.domain, lookup, config.report_stale_after)
    app.add_middleware(BodyLimit, limit=config.max_body_bytes, per_path=(
        (CERT_PATH_PATTERN, CERT_BODY_LIMIT),
        (STATUS_PATH_PATTERN, config.status_body_bytes),
    ))
    app.add_middleware(RequestMetrics, requests=metrics.requests, routes=app.router.routes)
    return app


def guest_report(
    report: StatusReport, snap: EnsembleSnapshot, index: int, received: float, caller: str
) -> GuestReport:
    """What is kept of a validated report: its fields, the member's own links, no raw view.

    Raises RegistryError(422) for node ids outside the ensemble. A report without
    ``fabric`` keeps the one the member reported before (it does not change while a VM
    runs). A report without ``imex_domain`` (the guest sends it only when it changed, and
    at least once a minute) keeps the member's last link row, if that came from the VM
    now in the slot; with ``imex_domain: null`` the row is gone (no domain view).
    """
    domain = report.imex_domain
    links = None
    previous = snap.reports.get(index)
    if domain is not None:
        errors = index_errors(domain, snap.spec.max_members)
        if errors:
            text, detail = validation_message(errors)
            raise RegistryError(422, text, detail=detail)
        links = reduce_links(domain, index)
    elif "imex_domain" not in report.model_fields_set and previous is not None:
        pub = snap.member(index)
        if pub is not None and report_counts(pub, previous):
            links = previous.links
    fields = report.model_dump(exclude={"imex_domain"})
    if "fabric" not in report.model_fields_set and previous is not None:
        fields["fabric"] = previous.fields.get("fabric")
    return GuestReport(received, caller, fields, links)


# -- serving ----------------------------------------------------------------------------------


def server_config(app: FastAPI, host: str, port: int, **kwargs: Any) -> uvicorn.Config:
    """A uvicorn config for the registry: proxy headers off (the app decides whom to trust)."""
    kwargs.setdefault("log_level", "warning")
    kwargs.setdefault("timeout_graceful_shutdown", 5)
    return uvicorn.Config(app, host=host, port=port, proxy_headers=False, **kwargs)


class RegistryServer(uvicorn.Server):
    """uvicorn.Server that answers parked long-polls as soon as shutdown begins.

    Listening sockets handed in by the caller get TCP_NODELAY (inherited by
    accepted connections): asyncio sets it only on sockets created with
    ``proto=IPPROTO_TCP``, and without it the body of a long-poll answer on
    a kept-alive connection waits ~40 ms for a delayed ACK (Nagle).
    """

    def __init__(self, config: uvicorn.Config, state: State) -> None:
        super().__init__(config)
        self._state = state

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        for sock in sockets or ():
            if sock.family in (socket.AF_INET, socket.AF_INET6):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        await super().startup(sockets)

    async def shutdown(self, sockets: Any = None) -> None:
        self._state.close()
        await super().shutdown(sockets)
