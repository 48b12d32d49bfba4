"""The registry long-poll: ``GET {registry_url}/v1/ensembles/{ns}/{name}?wait=G&timeout=S``.

The first request has no ``wait`` and returns at once; every later one passes the last
generation seen and is held by the host agent until the generation differs or ``timeout``
seconds pass (DESIGN.md "Registry HTTP API"). A restarted host agent starts at a new,
larger generation, so a guest's ``wait`` never matches it and the next answer is
immediate.

Parsing is defensive and pure (:func:`parse_ensemble`): the envelope (namespace, name,
generation, members list) must be right or the whole response is refused
(:class:`RegistryBadResponse`); each member is validated with the shared model (index
in range for *our* ``max_members``, slot name matching the index when given, usable IP)
and a bad one is ignored with one log line. Two members on one index: neither is used
(the host agent never publishes a duplicated slot; a registry that does is not trusted
for that slot). Nothing but validated members leaves this module.

Errors: :class:`RegistryError` and subclasses, chained to the HTTP error.
A 404 (the registry does not know the ensemble yet, e.g. still syncing) is
:class:`RegistryUnavailable` too: it is not evidence that every slot is absent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from urllib.parse import quote

from guest_agent import http
from guest_agent.config import Settings
from imex_shared.model import EnsembleId, Member, ModelError

log = logging.getLogger("guest_agent.registry_client")  # logger name pinned

Warn = Callable[[str], None]

#: A long-poll answer may legitimately take ``timeout`` seconds; allow this much more.
LONGPOLL_GRACE = 5.0
#: TCP keepalive on every registry connection: a request parked on a replica whose node
#: vanished (no FIN or RST ever arrives) fails after 2 + 3 x 2 = 8 s of silence, not at
#: the read timeout (``longpoll_timeout`` + 5 s + ``dns_timeout``).
KEEPALIVE = http.Keepalive(idle=2, interval=2, count=3)
CLOSING_HEADER = "x-imex-registry"
MAX_RESPONSE = 1 << 20


class RegistryError(Exception):
    """The registry could not tell us the membership."""


class RegistryUnavailable(RegistryError):
    """Connection, timeout, non-2xx status (including 404)."""


class RegistryBadResponse(RegistryError):
    """A response that is not the ensemble document of the contract."""


class RegistryDropped(RegistryUnavailable):
    """A long-poll the registry held was ended without an answer (the replica stopped,
    or its node vanished and TCP keepalive gave up): ask again at once, through the
    Service, where another replica answers. Not evidence that the registry is down."""


@dataclass(frozen=True, slots=True)
class RegistrySnapshot:
    """One validated answer of the registry."""

    generation: int
    members: tuple[Member, ...]  # sorted by index, unique indices, validated
    max_members: int | None = None  # what the registry said (informational)
    port: int | None = None
    #: sha256 of the ensemble's CA bundle (authEncryption); a change means renew now.
    ca_bundle_sha256: str | None = None
    #: the answering replica is shutting down (its ``X-Imex-Registry: closing`` header)
    closing: bool = False

    @property
    def pins(self) -> dict[int, str]:
        return {m.index: m.ip for m in self.members}


def _opt_str(entry: Mapping[str, object], key: str) -> str | None:
    value = entry.get(key)
    return value if isinstance(value, str) and value else None


def _opt_int(doc: Mapping[str, object], key: str) -> int | None:
    value = doc.get(key)
    return value if isinstance(value, int) and not isinstance(value, bool) else None


_CLIQUE = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                     r"[0-9a-fA-F]{12}\.(0|[1-9][0-9]{0,9})$")


def _clique(value: object) -> str | None:
    """A member's ``clique`` (``"<cluster_uuid>.<clique_id>"``); anything else: unknown."""
    return value if isinstance(value, str) and _CLIQUE.match(value) else None


def parse_ensemble(
    data: object, ens: EnsembleId, max_members: int, warn: Warn | None = None
) -> RegistrySnapshot:
    """Validate the ensemble document; see the module docstring for the rules."""
    say: Warn = warn if warn is not None else (lambda m: log.warning("%s", m))
    if not isinstance(data, dict):
        raise RegistryBadResponse(f"registry answer is {type(data).__name__}, not an object")
    if data.get("namespace") != ens.namespace or data.get("name") != ens.name:
        raise RegistryBadResponse(
            f"registry answer is about {data.get('namespace')!r}/{data.get('name')!r}, "
            f"not {ens.key}"
        )
    domain = data.get("domain_id")
    if domain is not None and domain != ens.domain_id:
        raise RegistryBadResponse(
            f"registry answer has domain_id {domain!r}, expected {ens.domain_id}"
        )
    generation = data.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise RegistryBadResponse(f"registry answer has no valid generation: {generation!r}")
    raw_members = data.get("members")
    if not isinstance(raw_members, list):
        raise RegistryBadResponse("registry answer has no members list")
    their_size = _opt_int(data, "max_members")
    if their_size is not None and their_size != max_members:
        say(
            f"registry says max_members = {their_size} but this guest is configured for "
            f"{max_members}; using {max_members}"
        )
    by_index: dict[int, Member] = {}
    duplicated: set[int] = set()
    for pos, entry in enumerate(raw_members):
        where = f"registry member #{pos}"
        if not isinstance(entry, dict):
            say(f"{where}: ignored: not an object")
            continue
        ip = entry.get("ip")
        if ip is None:
            continue  # a member without an address yet: nothing to pin, not an error
        if not isinstance(ip, str):
            say(f"{where}: ignored: ip {ip!r} is not a string")
            continue
        ready = entry.get("ready")
        try:
            member = Member.checked(
                entry.get("index"),
                ip,
                max_members,
                vmi=_opt_str(entry, "vmi"),
                node=_opt_str(entry, "node"),
                phase=_opt_str(entry, "phase"),
                ready=ready if isinstance(ready, bool) else None,
                clique=_clique(entry.get("clique")),
            )
        except ModelError as exc:
            say(f"{where}: ignored: {exc}")
            continue
        slot = entry.get("slot")
        if slot is not None and slot != ens.slot(member.index):
            say(
                f"{where}: ignored: slot {slot!r} does not match index {member.index} "
                f"({ens.slot(member.index)})"
            )
            continue
        if member.index in by_index or member.index in duplicated:
            say(f"{where}: slot {member.index} appears twice; using neither entry")
            by_index.pop(member.index, None)
            duplicated.add(member.index)
            continue
        by_index[member.index] = member
    return RegistrySnapshot(
        generation=generation,
        members=tuple(by_index[i] for i in sorted(by_index)),
        max_members=their_size,
        port=_opt_int(data, "port"),
        ca_bundle_sha256=_ca_bundle(data),
    )


def _ca_bundle(data: Mapping[str, object]) -> str | None:
    tls = data.get("tls")
    value = tls.get("ca_bundle_sha256") if isinstance(tls, dict) else None
    if isinstance(value, str) and len(value) == 64:
        return value
    return None


class RegistryClient:
    """Fetches the ensemble document; one call is one request (no retries here)."""

    def __init__(self, settings: Settings, ens: EnsembleId, *, token: str | None = None) -> None:
        if settings.registry_url is None:
            raise ValueError("RegistryClient needs settings.registry_url")
        self.settings = settings
        self.ens = ens
        self.token = token
        self.base = settings.registry_url.rstrip("/")
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
            )
        except http.HttpConnectionClosed as exc:
            raise RegistryDropped(str(exc)) from exc
        except http.HttpError as exc:
            raise RegistryUnavailable(str(exc)) from exc
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
