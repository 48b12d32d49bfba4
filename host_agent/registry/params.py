"""Path and query parameters of the registry routes (one definition, one OpenAPI text)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import Path, Query

_DNS_LABEL = r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$"

Namespace = Annotated[
    str,
    Path(
        pattern=_DNS_LABEL, max_length=63, description="the Service's namespace", examples=["gpu"]
    ),
]
Name = Annotated[
    str,
    Path(
        pattern=_DNS_LABEL,
        max_length=63,
        description="the ensemble Service's name",
        examples=["gb200"],
    ),
]


_ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {"error": {"type": "string"},
                   "detail": {"type": "array", "items": {"type": "object"}}},
    "required": ["error"],
}


def error_responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for error answers: always ``{"error": ...}`` JSON (422 adds detail)."""
    return {code: {"content": {"application/json": {"schema": _ERROR_SCHEMA}}}
            for code in codes}


Wait = Annotated[
    int | None,
    Query(ge=0, description="hold the answer until the generation differs from this"),
]
Timeout = Annotated[
    float | None,
    Query(
        ge=0,
        allow_inf_nan=False,
        description="seconds to hold the answer (default 30, capped at 60 unless configured "
        "otherwise); then the current state is answered",
    ),
]
Format = Annotated[Literal["json", "table"], Query(description="json (default) or table")]
NodesMode = Annotated[Literal["names", "ips"], Query(description="names (default) or ips")]
HostsMember = Annotated[
    int | None,
    Query(ge=0, le=2**31, description="the bytes this member writes: members of other "
          "NVLink cliques pinned to 127.0.0.2 (default: every published member pinned)"),
]
SlotIndex = Annotated[
    int, Path(ge=0, le=2**31, description="the member's slot index", examples=[0])
]
