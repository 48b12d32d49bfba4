"""The registry's JSON bodies: what a guest may PUT and what GET answers (the OpenAPI schema).

Requests are strict (no coercion), so a malformed field is a 422 naming it, never a
half-read report. A report field the registry does not know (a newer guest's) is
ignored and counted (report_routes.py), so a guest upgraded before its host agent keeps
reporting; every field it knows keeps its strict check. Responses document what
``views`` builds.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from host_agent.registry.domain_models import FabricIn, ImexDomainIn
from imex_shared.model import SHA256_HEX_PATTERN

_Sha = Annotated[str | None, Field(default=None, pattern=SHA256_HEX_PATTERN)]
_Count = Annotated[int, Field(default=0, ge=0, le=2**63 - 1)]


class PreflightCheck(BaseModel):
    """One preflight check's result, as the guest reports it."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: Annotated[str, Field(pattern=r"^[a-z][a-z0-9_]{0,47}$")]
    result: Literal["PASS", "WARN", "FAIL"]
    message: Annotated[str, Field(max_length=255)]


class SentIn(BaseModel):
    """When the guest sent the report, by its own clock: the boot's id and
    ``CLOCK_BOOTTIME`` in ns. Only a member's reports of one boot are compared with it
    (``host_agent.state.snapshot.sent_after``); extra keys are ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)

    boot_id: Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[0-9A-Za-z-]+$")]
    boottime_ns: Annotated[int, Field(ge=0, le=2**63 - 1)]


class StatusReport(BaseModel):
    """A guest's report (``PUT .../members/{index}/status``); unknown fields are kept
    aside (``model_extra``), counted and dropped by the route."""

    model_config = ConfigDict(extra="allow", strict=True)

    imex_state: Annotated[str, Field(min_length=1, max_length=64)]
    generation_applied: Annotated[int | None, Field(default=None, ge=0, le=2**63 - 1)]
    nodes_config_sha256: _Sha
    hosts_sha256: _Sha
    signals: _Count
    restarts: _Count
    agent_version: Annotated[str | None, Field(default=None, max_length=64)]
    #: authEncryption: when the guest's certificate expires (RFC 3339 UTC).
    cert_not_after: Annotated[
        str | None, Field(default=None, pattern=r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ$")
    ]
    imex_domain: ImexDomainIn | None = Field(
        default=None, description="nvidia-imex-ctl -N -j as the guest's IMEX printed it; "
        "null: no domain view; absent: unchanged (the member's last link row stands)")
    fabric: FabricIn | None = Field(
        default=None, description="the GPUs' NVLink fabric identity; null: no fabric; "
        "absent: unknown (the previous report's value stands)")
    imex_channel0: bool | None = Field(
        default=None, description="whether /dev/nvidia-caps-imex-channels/channel0 exists "
        "(deprecated: imex_channels)")
    registry_ca_sha256: _Sha = Field(
        default=None, description="0.2: sha256 of the registry CA the guest pins (its "
        "registry_ca_sha256); null: the guest reaches the registry over plain HTTP")
    imex_channels: Annotated[
        list[Annotated[int, Field(ge=0, le=2047)]], Field(max_length=2048)
    ] | None = Field(default=None, description="the IMEX channels whose device nodes exist "
                     "(/dev/nvidia-caps-imex-channels/channel<N>)")
    preflight: Annotated[list[PreflightCheck], Field(max_length=32)] | None = Field(
        default=None, description="the guest's preflight checks (imex-guest-agent "
        "preflight), at most 32")
    sent: SentIn | None = Field(
        default=None, description="0.2: when the guest sent this report, by its own clock; "
        "a report sent before the one the registry holds for the member is refused (409)")


class ErrorOut(BaseModel):
    error: str


class GuestOut(BaseModel):
    imex_state: str | None
    generation_applied: int | None
    nodes_config_sha256: str | None
    hosts_sha256: str | None
    signals: int | None
    restarts: int | None
    agent_version: str | None
    cert_not_after: str | None = None
    registry_ca_sha256: str | None = Field(
        default=None, description="0.2: the registry CA the guest pins; null: plain HTTP")
    transport: str | None = Field(
        default=None, description="0.2: how the report came: http or https")
    received_at: str
    from_ip: str
    age_s: float
    stale: bool


class MemberOut(BaseModel):
    index: int
    slot: str
    ip: str
    vmi: str | None
    node: str | None
    phase: str | None
    ready: bool | None
    since: str
    guest: GuestOut | None
    clique: str | None = Field(
        description='"<cluster_uuid>.<clique_id>" from its guest\'s report; null: unknown')


class EnsembleOut(BaseModel):
    namespace: str
    name: str
    domain_id: str
    generation: int
    max_members: int
    port: int
    members: list[MemberOut]
    problems: list[str]
    tls: TlsOut | None = Field(description="authEncryption: the CA's fingerprints; else null")


class TlsOut(BaseModel):
    auth_encryption: bool
    ca_sha256: str | None = Field(description="sha256 of the CA certificate (status.caSHA256)")
    ca_bundle_sha256: str | None = Field(description="changes when the CA bundle does")


class SummaryOut(BaseModel):
    namespace: str
    name: str
    generation: int
    members: int = Field(description="number of published members")
    ready: int = Field(description="number of published members that are ready")


class ListOut(BaseModel):
    items: list[SummaryOut]


class StatusAccepted(BaseModel):
    generation: int = Field(description="the ensemble's current generation")
    received_at: str
    domain_needed: bool = Field(
        False, description="the report left imex_domain out and this replica holds no link "
        "row from the VM now in the slot (it moved, or this replica never saw the view): "
        "send the view with the next report")


def inline_schema(model: type[BaseModel]) -> dict[str, Any]:
    """``model``'s JSON schema with its ``$defs`` references inlined.

    A request body given through ``openapi_extra`` is copied into the OpenAPI document
    as is, where ``#/$defs/...`` would point nowhere (the models here are not recursive).
    """
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def resolve(node: Any) -> Any:
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return resolve(defs[ref.removeprefix("#/$defs/")])
            return {k: resolve(v) for k, v in node.items()}
        if isinstance(node, list):
            return [resolve(v) for v in node]
        return node

    resolved: dict[str, Any] = resolve(schema)
    return resolved


def json_errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """Error answers: always JSON, also on routes whose success is text/plain."""
    content = {"application/json": {"schema": ErrorOut.model_json_schema()}}
    return {code: {"content": content} for code in codes}


TEXT_200: dict[int | str, dict[str, Any]] = {
    200: {"content": {"text/plain": {"schema": {"type": "string"}}}}
}
