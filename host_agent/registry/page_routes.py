"""The registry's page for operators: ``GET /ui/`` and ``GET /ui/ensembles/{ns}/{name}``.

Read-only (GET only), served on the registry's port behind the same NetworkPolicy,
no external resource; the HTML comes from ``host_agent.registry.page`` (pure) over the same
snapshots and cached domain views as ``/domain``. ``/ui/ensembles.json`` is the list
page's refresh source (the per-ensemble page refreshes from ``/v1/...`` and
``.../domain``). Responses forbid every script but the page's own (CSP with its hash).
"""

from __future__ import annotations

import time
from typing import Any

from fastapi import FastAPI
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from host_agent.registry import page as ui
from host_agent.registry.domain_routes import DomainCache, Lookup
from host_agent.registry.page_assets import CSP
from host_agent.registry.params import Name, Namespace, error_responses
from host_agent.state.store import State
from imex_shared.model import EnsembleId

HEADERS = {
    "Content-Security-Policy": CSP,
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-store",
}


def add_ui_routes(app: FastAPI, state: State, cache: DomainCache, lookup: Lookup,
                  stale_after: float) -> None:
    """Register the page's routes on ``app``."""

    @app.get("/ui", include_in_schema=False)
    async def ui_root() -> Response:
        return RedirectResponse("/ui/", status_code=308)

    @app.get("/ui/", summary="The operator's page: every ensemble",
             response_class=HTMLResponse)
    async def ui_list() -> Response:
        now = time.time()
        rows = [(snap, cache.view(snap, now)) for snap in state.all()]
        return HTMLResponse(ui.list_page(rows), headers=HEADERS)

    @app.get("/ui/ensembles.json", summary="What the list page refreshes from")
    async def ui_list_json() -> Response:
        now = time.time()
        items: list[dict[str, Any]] = []
        for snap in state.all():
            view = cache.view(snap, now)
            items.append({"namespace": snap.ens.namespace, "name": snap.ens.name,
                          "generation": snap.generation, "members": len(snap.members),
                          "max_members": snap.spec.max_members,
                          "domain_status": view.status, "imex_ready": ui.imex_ready(view)})
        return JSONResponse({"items": items}, headers={"Cache-Control": "no-store"})

    @app.get("/ui/ensembles/{ns}/{name}", summary="The operator's page: one ensemble",
             response_class=HTMLResponse, responses=error_responses(404, 422))
    async def ui_ensemble(ns: Namespace, name: Name) -> Response:
        snap = lookup(EnsembleId(ns, name))
        now = time.time()
        page = ui.ensemble_page(snap, cache.view(snap, now), now, stale_after)
        return HTMLResponse(page, headers=HEADERS)
