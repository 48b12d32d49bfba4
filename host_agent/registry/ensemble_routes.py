"""The registry's reads of one ensemble: JSON (long-poll), the table, and the two files.

``EnsembleReads`` is what every route of an ensemble needs: find it (404 with a
hint), hold a long-poll until the generation moves past ``wait``, and the headers
every answer carries (the generation; on a replica that is shutting down, the word
for the guest to ask again at once).
"""

from __future__ import annotations

import time

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import Gauge

from host_agent.registry import views
from host_agent.registry.auth import RegistryError, plain_http_refusal
from host_agent.registry.config import RegistryConfig
from host_agent.registry.models import TEXT_200, EnsembleOut, ListOut, json_errors
from host_agent.registry.params import (
    Format,
    HostsMember,
    Name,
    Namespace,
    NodesMode,
    Timeout,
    Wait,
)
from host_agent.state.snapshot import EnsembleSnapshot
from host_agent.state.store import State
from imex_shared.model import EnsembleId, ModelError

_TEXT = "text/plain; charset=utf-8"
_GENERATION_HEADER = "X-Imex-Generation"
#: Set on answers of a replica that is shutting down (guest_agent.peers.registry_io reads it).
CLOSING_HEADER = "X-Imex-Registry"


def now() -> float:
    return time.time()


class EnsembleReads:
    """Finding an ensemble, waiting for it to change, and what every answer carries."""

    def __init__(self, state: State, config: RegistryConfig, waiters: Gauge) -> None:
        self._state = state
        self._config = config
        self._waiters = waiters

    def lookup(self, ens: EnsembleId) -> EnsembleSnapshot:
        state = self._state
        snap = state.get(ens)
        if snap is not None:
            return snap
        hint = f"is the Service labelled imex-ensemble.io/ensemble={ens.name}?"
        if not state.synced:
            hint = "the host agent has not finished its first list yet, see /readyz"
        raise RegistryError(404, f"no ensemble {ens.key} ({hint})")

    async def current(self, ens: EnsembleId, wait: int | None,
                      timeout: float | None) -> EnsembleSnapshot:
        state, config = self._state, self._config
        snap = self.lookup(ens)
        if wait is None or snap.generation > wait or state.closed:
            return snap
        limit = config.longpoll_default if timeout is None else timeout
        self._waiters.inc()
        try:
            later = await state.wait_for_change(ens, wait, min(limit, config.longpoll_cap))
        finally:
            self._waiters.dec()
        if later is None:
            raise RegistryError(404, f"ensemble {ens.key} was deleted while you waited")
        return later

    def headers(self, snap: EnsembleSnapshot) -> dict[str, str]:
        """The generation, and on a replica that is shutting down a word for the guest
        to ask again at once (through the Service, so another replica answers)."""
        out = {_GENERATION_HEADER: str(snap.generation)}
        if self._state.closed:
            out[CLOSING_HEADER] = "closing"
            out["Connection"] = "close"
        return out

    def text(self, body: bytes | str, snap: EnsembleSnapshot) -> Response:
        return PlainTextResponse(body, media_type=_TEXT, headers=self.headers(snap))

    @property
    def state(self) -> State:
        return self._state

    def all(self) -> list[EnsembleSnapshot]:
        return self._state.all()


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


def add_ensemble_routes(app: FastAPI, reads: EnsembleReads, stale_after: float) -> None:
    """``GET /v1/ensembles`` and ``GET /v1/ensembles/{ns}/{name}[/nodes_config|/hosts]``."""
    rendered = RenderedJson(stale_after)
    current, text, headers = reads.current, reads.text, reads.headers

    @app.get("/v1/ensembles", summary="All ensembles", response_model=ListOut)
    async def list_ensembles() -> Response:
        return JSONResponse(views.list_json(reads.all()))

    @app.get(
        "/v1/ensembles/{ns}/{name}",
        summary="One ensemble (long-poll with ?wait=G; ?format=table for people)",
        response_model=EnsembleOut,
        responses={
            200: {"content": {"text/plain": {"schema": {"type": "string"}}}},
            **json_errors(404, 422),
        },
    )
    async def get_ensemble(
        request: Request,
        ns: Namespace,
        name: Name,
        wait: Wait = None,
        timeout: Timeout = None,
        format: Format = "json",
    ) -> Response:
        if "authorization" in request.headers:  # a guest's: never over plain HTTP if Required
            refused = plain_http_refusal(reads.lookup(EnsembleId(ns, name)).spec,
                                         request.url.scheme)
            if refused is not None:
                raise refused
        snap = await current(EnsembleId(ns, name), wait, timeout)
        if format == "table":
            return text(views.ensemble_table(snap, now(), stale_after), snap)
        return Response(
            rendered.body(snap, now()), media_type="application/json", headers=headers(snap),
        )

    @app.get(
        "/v1/ensembles/{ns}/{name}/nodes_config",
        summary="The nodes_config.cfg a guest writes",
        response_class=PlainTextResponse,
        responses={**TEXT_200, **json_errors(404, 422, 500)},
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
        responses={**TEXT_200, **json_errors(404, 422, 500)},
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
