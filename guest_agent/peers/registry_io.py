"""The registry long-poll: ``GET {registry_url}/v1/ensembles/{ns}/{name}?wait=G&timeout=S``.

The first request has no ``wait`` and returns at once; every later one passes the last
generation seen and is held by the host agent until the generation differs or ``timeout``
seconds pass (DESIGN.md "Registry HTTP API"). A restarted host agent starts at a new,
larger generation, so a guest's ``wait`` never matches it and the next answer is
immediate.

What an answer may say is :mod:`guest_agent.peers.registry` (pure: the validation, the
errors). Every failure here is one of its :class:`RegistryError` subclasses, chained to
the HTTP error. An ``https://`` registry is checked by :mod:`guest_agent.registry_trust`
(the pinned registry CA) before the request, and its token, is written; a refused
certificate is :class:`RegistryUnavailable` with the reason, so DNS takes over and the
log says why.
"""

from __future__ import annotations

import logging
from urllib.parse import quote

from guest_agent import http
from guest_agent.config import Settings
from guest_agent.peers.registry import (
    RegistryBadResponse,
    RegistryDropped,
    RegistrySnapshot,
    RegistryUnavailable,
    parse_ensemble,
)
from guest_agent.registry_trust import trust_for
from imex_shared.model import EnsembleId

log = logging.getLogger("guest_agent.registry_client")  # logger name pinned

#: A long-poll answer may legitimately take ``timeout`` seconds; allow this much more.
LONGPOLL_GRACE = 5.0
#: TCP keepalive on every registry connection: a request parked on a replica whose node
#: vanished (no FIN or RST ever arrives) fails after 2 + 3 x 2 = 8 s of silence, not at
#: the read timeout (``longpoll_timeout`` + 5 s + ``dns_timeout``).
KEEPALIVE = http.Keepalive(idle=2, interval=2, count=3)
CLOSING_HEADER = "x-imex-registry"
MAX_RESPONSE = 1 << 20


class RegistryClient:
    """Fetches the ensemble document; one call is one request (no retries here)."""

    def __init__(self, settings: Settings, ens: EnsembleId, *, token: str | None = None) -> None:
        if settings.registry_url is None:
            raise ValueError("RegistryClient needs settings.registry_url")
        self.settings = settings
        self.ens = ens
        self.token = token
        self.base = settings.registry_url.rstrip("/")
        self.trust = trust_for(self.base, settings.registry_ca_sha256)
        self._warned: set[str] = set()

    def url(self, wait: int | None = None) -> str:
        path = (
            f"{self.base}/v1/ensembles/{quote(self.ens.namespace, safe='')}/"
            f"{quote(self.ens.name, safe='')}"
        )
        if wait is None:
            return path
        return f"{path}?wait={wait}&timeout={self.settings.longpoll_timeout:g}"

    def _warn(self, message: str) -> None:
        # Same bad member on every poll: say it once, then at debug level.
        if message in self._warned:
            log.debug("%s", message)
            return
        if len(self._warned) < 1024:
            self._warned.add(message)
        log.warning("%s", message)

    async def fetch(self, wait: int | None = None) -> RegistrySnapshot:
        """The ensemble now (``wait`` None) or once its generation exceeds ``wait``."""
        url = self.url(wait)
        read_timeout = self.settings.dns_timeout + (
            self.settings.longpoll_timeout + LONGPOLL_GRACE if wait is not None else 5.0
        )
        try:
            resp = await http.request(
                "GET",
                url,
                token=self.token,
                connect_timeout=max(self.settings.dns_timeout, 1.0),
                read_timeout=read_timeout,
                max_body=MAX_RESPONSE,
                keepalive=KEEPALIVE,
                ssl_context=await self.trust.context(),
            )
        except http.HttpConnectionClosed as exc:
            raise RegistryDropped(str(exc)) from exc
        except http.HttpError as exc:
            raise RegistryUnavailable(str(exc)) from exc
        self.trust.observe(resp)
        if not 200 <= resp.status < 300:
            snippet = resp.body[:200].decode("utf-8", "replace")
            raise RegistryUnavailable(f"GET {url}: HTTP {resp.status} {resp.reason}: {snippet}")
        try:
            data = resp.json()
        except http.HttpJsonError as exc:  # its message names the request
            raise RegistryBadResponse(str(exc)) from exc
        snap = parse_ensemble(data, self.ens, self.settings.max_members, self._warn)
        if resp.headers.get(CLOSING_HEADER, "").strip().lower() == "closing":
            snap = RegistrySnapshot(snap.generation, snap.members, snap.max_members, snap.port,
                                    closing=True)
        return snap
