"""``GET /version``: the release the registry runs and the guests it supports.

``{"version": "0.2.0", "api": "v1", "min_guest": "0.1", "max_guest": "0.2"}``: the
version is the installed distribution's (pyproject.toml's, the one source); the guest
range is the skew policy's (imex_shared/version.py, docs/install.md "Upgrades"). A guest
reads it before its first report and says, once, what it makes of it. No token: it
tells nothing about any ensemble.
"""

from __future__ import annotations

from fastapi import FastAPI
from pydantic import BaseModel, Field

from imex_shared.version import package_version, version_doc


class VersionOut(BaseModel):
    version: str = Field(description="the imex-ensemble release the host agent runs")
    api: str = Field(description="the registry API version (the /v1 of its paths)")
    min_guest: str = Field(description="oldest supported guest release series (MAJOR.MINOR)")
    max_guest: str = Field(description="newest supported guest release series (MAJOR.MINOR)")


def add_version_routes(app: FastAPI) -> None:
    doc = version_doc(package_version())  # fixed for the process: looked up once

    @app.get("/version", summary="The host agent's release and the guest releases it supports",
             response_model=VersionOut)
    async def version() -> dict[str, str]:
        return doc
