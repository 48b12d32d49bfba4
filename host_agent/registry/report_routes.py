"""A guest's status report: ``PUT /v1/ensembles/{ns}/{name}/members/{index}/status``.

Checked in this order, so a caller learns nothing it is not entitled to: body size
(413, before anything is parsed, also for chunked bodies: asgi.py), ensemble exists
(404), bearer token (401: sha256 of the token compared in constant time with the
ensemble's ``tokenSHA256``), member published (404), caller address equals the
member's published IP (403; ``X-Forwarded-For`` is honoured only when the direct
peer is in a trusted proxy network), body schema (422), and last whether the guest
sent it before the member's report held here (409, dropped: ``superseded``). A
top-level field the registry does not know (a newer guest's) is ignored: counted in
``imex_registry_unknown_report_fields_total{field}`` (:class:`UnknownFields`: a
fixed number of label values) and logged once per name at INFO. The report is stored with
``State.report`` (it never changes the generation) and, where reports are persisted,
in the API before the answer, so no replica loses it (persist/reports.py).
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Iterable
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from host_agent.registry import views
from host_agent.registry.auth import (
    AuthFailure,
    IPNetwork,
    RegistryError,
    authenticate_member,
    validation_message,
)
from host_agent.registry.domain_models import index_errors, reduce_links
from host_agent.registry.ensemble_routes import EnsembleReads, now
from host_agent.registry.metrics import RegistryMetrics
from host_agent.registry.models import StatusAccepted, StatusReport, inline_schema, json_errors
from host_agent.registry.params import Name, Namespace, SlotIndex
from host_agent.state.snapshot import (
    EnsembleSnapshot,
    GuestReport,
    PublishedMember,
    guest_order,
    report_counts,
)
from imex_shared.model import EnsembleId

log = logging.getLogger("host_agent.registry")  # logger name pinned

#: the status PUT's path (its own body limit, ``status_body_bytes``)
STATUS_PATH_PATTERN = r"^/v1/ensembles/[^/]+/[^/]+/members/[^/]+/status$"


#: Field names that get a label of their own in the unknown-fields counter; later ones
#: are counted as "other" (a fixed, small label set whatever guests send).
UNKNOWN_FIELD_LABELS = 16
#: Names logged once each; beyond this many, unknown names are not logged again.
UNKNOWN_FIELD_LOGGED = 256
_FIELD_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")


class UnknownFields:
    """Counts and logs report fields the registry does not know (see the docstring)."""

    def __init__(self, counter: Any) -> None:
        self._counter = counter
        self._labels: dict[str, str] = {}
        self._logged: set[str] = set()

    def label(self, name: str) -> str:
        got = self._labels.get(name)
        if got is not None:
            return got
        label = name if (_FIELD_NAME.match(name) and len(self._labels) < UNKNOWN_FIELD_LABELS) \
            else "other"
        if label != "other":
            self._labels[name] = label
        return label

    def seen(self, names: Iterable[str], ens: EnsembleId, index: int,
             agent_version: str | None) -> None:
        for name in names:
            self._counter.labels(self.label(name)).inc()
            if name in self._logged or len(self._logged) >= UNKNOWN_FIELD_LOGGED:
                continue
            self._logged.add(name)
            log.info("registry: ignoring report field %r this registry does not know (first "
                     "from %s member %d, guest %s): a newer guest's; upgrade the host agent "
                     "to use it", name[:64], ens.key, index, agent_version or "?")


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


def add_report_routes(app: FastAPI, reads: EnsembleReads,
                      trusted_proxies: tuple[IPNetwork, ...], metrics: RegistryMetrics,
                      reports: ReportSink | None) -> None:
    """The status PUT (module docstring)."""
    lookup, headers, state = reads.lookup, reads.headers, reads.state
    unknown = UnknownFields(metrics.unknown_fields)

    @app.put(
        "/v1/ensembles/{ns}/{name}/members/{index}/status",
        summary="A guest reports its IMEX status (bearer token; from the member's own IP)",
        response_model=StatusAccepted,
        responses=json_errors(400, 401, 403, 404, 409, 413, 422),
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
                request.headers.getlist("x-forwarded-for"), trusted_proxies,
                scheme=request.url.scheme,
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
        if report.model_extra:
            unknown.seen(report.model_extra, ens, index, report.agent_version)
        received = now()
        guest = guest_report(report, snap, index, received, str(caller),
                             transport=request.url.scheme)
        if superseded(guest, snap.reports.get(index), pub):
            log.info("registry: report for %s member %d dropped: the guest sent it before "
                     "the report held here (a request that waited unhandled)", ens.key, index)
            return JSONResponse({"error": "a later report of this member is held; this one "
                                 "was sent before it and is dropped"}, status_code=409)
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
        answer: dict[str, Any] = {"generation": current_snap.generation,
                                  "received_at": views.rfc3339(received)}
        if domain_needed(report, guest):
            answer["domain_needed"] = True
        return JSONResponse(
            answer,
            headers=headers(current_snap),  # a closing replica: the guest resends its view
        )


def domain_needed(report: StatusReport, kept: GuestReport) -> bool:
    """Whether the answer asks for the view: the report left ``imex_domain`` out
    ("unchanged") but there is no row it could leave unchanged here (the slot's VM moved
    since the row came, or this replica never saw it). Without this, the member's links
    read unknown until the guest's next full report, up to a minute later."""
    return "imex_domain" not in report.model_fields_set and kept.links is None


def guest_report(
    report: StatusReport, snap: EnsembleSnapshot, index: int, received: float, caller: str,
    transport: str | None = None,
) -> GuestReport:
    """What is kept of a validated report: its fields, the member's own links, no raw view.

    Raises RegistryError(422) for node ids outside the ensemble. A report without
    ``fabric`` keeps the one the member reported before (it does not change while a VM
    runs). A report without ``imex_domain`` (the guest sends it only when it changed, and
    at least once a minute) keeps the member's last link row, if that came from the VM
    now in the slot; with ``imex_domain: null`` the row is gone (no domain view).
    Fields the registry does not know are not kept; ``transport`` (``http`` or
    ``https``: how the report came) is.
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
    fields = report.model_dump(exclude={"imex_domain", "sent", *(report.model_extra or ())})
    if transport is not None:
        fields["transport"] = transport
    if "fabric" not in report.model_fields_set and previous is not None:
        fields["fabric"] = previous.fields.get("fabric")
    sent = (report.sent.boot_id, report.sent.boottime_ns) if report.sent is not None else None
    return GuestReport(received, caller, fields, links, sent)


def superseded(report: GuestReport, held: GuestReport | None, pub: PublishedMember) -> bool:
    """Whether the member's report held here was sent after ``report`` by the same VM:
    then ``report`` is a request that waited unhandled (a stopped or starved replica)
    while the guest went on, and storing it would show the older state as the newest."""
    return (held is not None and report_counts(pub, held) and held.from_ip == report.from_ip
            and guest_order(report, held) is False)
