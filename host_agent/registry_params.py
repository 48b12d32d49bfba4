"""Path parameters every registry route module shares (one definition, one OpenAPI text)."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Path

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
