"""Path parameters every registry route module shares (one definition, one OpenAPI text)."""

from __future__ import annotations

from typing import Annotated

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
