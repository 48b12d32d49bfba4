"""The certificate endpoint: ``POST /v1/ensembles/{ns}/{name}/members/{index}/certificate``.

A guest of an ensemble with authEncryption sends ``{"csr": "<PEM>"}`` and gets
``{"certificate", "ca", "not_after"}``: its leaf signed by the ensemble's CA,
the CA bundle, and the leaf's end of validity (RFC 3339).

Check order (issue 19, "Precisions"), so a caller learns nothing it is not
entitled to and a stranger cannot use up a member's renewals:
1. 413: body over 16 KiB, refused by ``BodyLimit`` before anything is parsed;
2. 404: unknown ensemble;
3. 401 token, 404 member not published, 403 caller address: the same
   ``authenticate_member`` as the status PUT (one code path);
4. 409: the ensemble does not use authEncryption (only said to a member);
5. 429: more than ``rate`` requests per ``rate_window`` seconds for this
   member (counted after authentication only), with ``Retry-After``;
6. 422: a body that is not ``{"csr": str}``, a CSR that does not parse, has a
   bad signature, or a key that is not ECDSA P-256 or RSA >= 2048;
7. 403: a CSR that parses but names anything other than exactly its own slot
   (subject exactly CN=<slot>; exactly one SAN, DNS:<slot>; no IP);
8. 503: the CA is not there yet or its Secret is unusable (the message says
   which); the guest keeps its current certificate and retries.

Signing reads the CA through ``CaSource`` (any replica may sign, from the one
Secret; only the leader creates or rotates it). Every issued certificate is
logged with its serial, slot and not_after; metrics never get one series per
certificate: a counter per ensemble and a not-after gauge per member.
"""

from __future__ import annotations

import collections
import datetime as dt
import logging
import time
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Annotated, Final, Protocol

import prometheus_client
from fastapi import FastAPI, Path, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import Counter, Gauge
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from host_agent.ca.secret_io import CaUnavailable
from host_agent.registry.auth import (
    AuthFailure,
    IPNetwork,
    RegistryError,
    authenticate_member,
    validation_message,
)
from host_agent.registry.config import CertConfig
from host_agent.state.snapshot import EnsembleSnapshot
from host_agent.state.store import State
from imex_shared.model import EnsembleId

if TYPE_CHECKING:
    from host_agent.ca import authority as ca_mod

log = logging.getLogger("imex.host.certs")


def _ca() -> ModuleType:
    """host_agent.ca.authority, imported on first use: ``cryptography`` costs the agent about 13 MB
    of RSS, which an agent without authEncryption ensembles never pays."""
    import host_agent.ca.authority

    return host_agent.ca.authority

#: The certificate POST's body limit (a CSR is about 500 bytes; RSA 4096 about 2 KiB).
CERT_BODY_LIMIT: Final = 16 * 1024
CERT_PATH_PATTERN: Final = r"^/v1/ensembles/[^/]+/[^/]+/members/[^/]+/certificate$"


class CaSource(Protocol):
    async def load(self, ens: EnsembleId) -> ca_mod.CaState:
        """The ensemble's CA as its Secret holds it now; ``CaUnavailable`` otherwise."""
        ...


class CsrIn(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    csr: Annotated[str, Field(min_length=1, description="PEM CSR; the body is at most 16 KiB")]


class CertificateOut(BaseModel):
    certificate: str = Field(description="the member's certificate (PEM)")
    ca: str = Field(description="the CA bundle (PEM): verify it against your pinned fingerprint")
    not_after: str = Field(description="the certificate's end of validity (RFC 3339)")


class MemberRateLimit:
    """At most ``rate`` requests per ``window`` seconds per (ensemble, index): a sliding log."""

    def __init__(self, rate: int, window: float, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        self.rate = rate
        self.window = window
        self.clock = clock
        self._log: dict[tuple[EnsembleId, int], collections.deque[float]] = {}

    def check(self, ens: EnsembleId, index: int) -> float | None:
        """None when allowed (and counted), else seconds until the next one would be."""
        now = self.clock()
        times = self._log.setdefault((ens, index), collections.deque())
        while times and times[0] <= now - self.window:
            times.popleft()
        if len(times) >= self.rate:
            return max(0.0, times[0] + self.window - now)
        times.append(now)
        if len(self._log) > 4096:  # forget members idle for a whole window
            self._log = {k: v for k, v in self._log.items() if v and v[-1] > now - self.window}
        return None


class CertMetrics:
    def __init__(self, registry: prometheus_client.CollectorRegistry) -> None:
        self.issued = Counter(
            "imex_registry_certificates_issued",
            "Member certificates issued, by ensemble (serials are in the log, never here).",
            ("namespace", "ensemble"),
            registry=registry,
        )
        self.not_after = Gauge(
            "imex_registry_certificate_not_after_seconds",
            "Unix time at which the last certificate issued to a member expires.",
            ("namespace", "ensemble", "index"),
            registry=registry,
        )
        self.refused = Counter(
            "imex_registry_certificate_refusals",
            "Certificate requests refused, by reason (bounded label values).",
            ("reason",),
            registry=registry,
        )


SlotIndex = Annotated[int, Path(ge=0, le=2**31, description="the member's slot index")]
_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"
Label = Annotated[str, Path(pattern=_DNS_LABEL, max_length=63)]


def _rfc3339(moment: dt.datetime) -> str:
    return moment.astimezone(dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def add_certificate_routes(
    app: FastAPI,
    state: State,
    source: CaSource | None,
    metrics_registry: prometheus_client.CollectorRegistry,
    trusted: tuple[IPNetwork, ...],
    config: CertConfig | None = None,
    *,
    now: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
) -> MemberRateLimit:
    """Register the certificate POST on ``app``; returns its rate limiter (for tests)."""
    cfg = config or CertConfig()
    metrics = CertMetrics(metrics_registry)
    limiter = MemberRateLimit(cfg.rate, cfg.rate_window)

    def refuse(status: int, reason: str, message: str,
               headers: dict[str, str] | None = None) -> RegistryError:
        metrics.refused.labels(reason).inc()
        return RegistryError(status, message, headers)

    def lookup(ens: EnsembleId) -> EnsembleSnapshot:
        snap = state.get(ens)
        if snap is None:
            raise refuse(404, "unknown_ensemble", f"no ensemble {ens.key}")
        return snap

    @app.post(
        "/v1/ensembles/{ns}/{name}/members/{index}/certificate",
        summary="A guest asks for its IMEX certificate (bearer token; from the member's IP)",
        response_model=CertificateOut,
        responses={code: {"content": {"application/json": {"schema": {
            "type": "object", "properties": {"error": {"type": "string"}}}}}}
            for code in (401, 403, 404, 409, 413, 422, 429, 503)},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/json": {"schema": CsrIn.model_json_schema()}}}},
    )
    async def post_certificate(ns: Label, name: Label, index: SlotIndex,
                               request: Request) -> Response:
        ens = EnsembleId(ns, name)
        snap = lookup(ens)
        try:
            authenticate_member(
                snap, index, request.headers.get("authorization"),
                request.client.host if request.client else None,
                request.headers.getlist("x-forwarded-for"), trusted,
                scheme=request.url.scheme,
            )
        except AuthFailure as exc:
            metrics.refused.labels(exc.reason).inc()
            log.warning("certificate for %s member %d refused: %s", ens.key, index, exc.reason)
            raise
        except RegistryError:
            metrics.refused.labels("unknown_member").inc()
            raise
        if not snap.spec.auth_encryption or source is None:
            raise refuse(409, "auth_off", f"ensemble {ens.key} does not use authEncryption; "
                         "there is no CA to sign with")
        wait = limiter.check(ens, index)
        if wait is not None:
            raise refuse(
                429, "rate",
                f"more than {cfg.rate} certificate requests in {cfg.rate_window:g} s for "
                f"{ens.key} member {index}; retry in {wait:.0f} s",
                {"Retry-After": str(max(1, round(wait + 0.5)))},
            )
        try:
            body = CsrIn.model_validate_json(await request.body())
        except ValidationError as exc:
            message, detail = validation_message(exc.errors())
            metrics.refused.labels("bad_body").inc()
            return JSONResponse({"error": message, "detail": detail}, status_code=422)
        slot = ens.slot(index)
        try:
            csr = _ca().load_csr(body.csr)
        except _ca().CsrError as exc:
            raise refuse(422, "bad_csr", str(exc)) from exc
        try:
            _ca().check_csr_names(csr, slot)
        except _ca().CsrNameError as exc:
            log.warning("certificate for %s member %d refused: %s", ens.key, index, exc)
            raise refuse(403, "wrong_name", str(exc)) from exc
        try:
            ca_state = await source.load(ens)
        except CaUnavailable as exc:
            raise refuse(503, "no_ca", f"no usable CA for {ens.key}: {exc}",
                         {"Retry-After": "5"}) from exc
        issued_at = now()
        leaf = _ca().issue_leaf(ca_state.signer, csr, slot, issued_at, cfg.lifetime)
        not_after = leaf.not_valid_after_utc
        metrics.issued.labels(ens.namespace, ens.name).inc()
        metrics.not_after.labels(ens.namespace, ens.name, str(index)).set(not_after.timestamp())
        log.info(
            "issued certificate serial %x for %s (%s member %d), not after %s, CA %s",
            leaf.serial_number, slot, ens.key, index, _rfc3339(not_after), ca_state.sha256[:16],
            extra={"ensemble": ens.key, "slot": slot, "serial": f"{leaf.serial_number:x}",
                   "not_after": _rfc3339(not_after)},
        )
        return JSONResponse({
            "certificate": _ca().cert_pem(leaf),
            "ca": ca_state.bundle_pem(),
            "not_after": _rfc3339(not_after),
        })

    return limiter
