"""The registry's ensemble document, validated: what a guest may believe of an answer.

Pure (the request itself is :mod:`guest_agent.peers.registry_io`). Parsing is defensive
(:func:`parse_ensemble`): the envelope (namespace, name, generation, members list) must
be right or the whole response is refused (:class:`RegistryBadResponse`); each member is
validated with the shared model (index in range for *our* ``max_members``, slot name
matching the index when given, usable IP) and a bad one is ignored with one log line.
Two members on one index: neither is used (the host agent never publishes a duplicated
slot; a registry that does is not trusted for that slot). Nothing but validated members
leaves this module.

Errors: :class:`RegistryError` and subclasses. A 404 (the registry does not know the
ensemble yet, e.g. still syncing) is :class:`RegistryUnavailable` too: it is not
evidence that every slot is absent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from imex_shared.model import EnsembleId, Member, ModelError

log = logging.getLogger("guest_agent.registry_client")  # logger name pinned

Warn = Callable[[str], None]


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
