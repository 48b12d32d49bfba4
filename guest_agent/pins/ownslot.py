"""The "Own slot" rule of DESIGN.md: which slot is this guest, and what does it pin there.

Pure: a function of the settings, what discovery published, the guest's local addresses,
its hostname and the source address of its default route. No I/O, so the daemon can
re-evaluate it on every view and every address change, and tests are tables.

Finding the index, first match wins:

1. ``own_index`` from the config;
2. a published member whose IP is on a local interface (bridge binding, secondary
   networks);
3. the member whose ``vmi`` equals the hostname (KubeVirt sets the guest hostname to the
   VMI name unless ``spec.hostname`` says otherwise);
4. the hostname's trailing ``-<n>`` (VirtualMachinePool naming), when in range.

What the own slot is pinned to (``own_slot``):

* ``published``: the published IP, as every peer pins it;
* ``local``: the local address of the default-route interface, always;
* ``auto`` (default): the published IP when it is local; when it is not (masquerade
  binding: peers dial the pod IP, the guest only has 10.0.2.2, FACTS.md), the local
  address of the default-route interface, so IMEX finds a nodes-file entry that matches
  a local address. ``note`` says so, for the status. In names mode, a slot that is not
  published yet but whose index the guest knows itself (``own_index``, hostname) is
  pinned provisionally to the default-route address, so IMEX starts before the host
  agent publishes it; a published IP that is another local address re-pins it.

``pin_ip`` None means "nothing to pin yet" (own slot unknown or not published); the
daemon must not start IMEX then.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from guest_agent.config import Settings
from imex_shared.model import Member, UnusableAddress, index_from_name, parse_ip

How = Literal["own_index", "local_ip", "vmi", "hostname", "unknown"]


@dataclass(frozen=True, slots=True)
class OwnSlot:
    """The guest's own slot: ``index`` (None = unknown) pinned to ``pin_ip``."""

    index: int | None
    pin_ip: str | None
    how: How
    note: str
    published_ip: str | None = None
    #: True when the published IP is not a local address (masquerade binding).
    masquerade: bool = False


def _canon(text: str) -> str | None:
    try:
        return str(parse_ip(text))
    except UnusableAddress:
        return None


def _local_pin_ok(text: str | None) -> str | None:
    """A local address IMEX may bind: not loopback/unspecified/link-local/multicast.

    Unlike peers' addresses, the masquerade-internal 10.0.2.2 is fine here: it is exactly
    the local address IMEX will match.
    """
    if text is None:
        return None
    try:
        addr = parse_ip(text)
    except UnusableAddress:
        return None
    if addr.is_loopback or addr.is_unspecified or addr.is_link_local or addr.is_multicast:
        return None
    return str(addr)


def _short(hostname: str) -> str:
    return hostname.strip().lower().split(".", 1)[0]


def resolve_own(
    settings: Settings,
    members: Sequence[Member] | Mapping[int, str],
    local_addrs: Iterable[str],
    hostname: str,
    default_route_addr: str | None,
) -> OwnSlot:
    """Apply the own-slot rule (module docstring) to what is known right now."""
    if isinstance(members, Mapping):
        published: dict[int, str] = {}
        for i, ip in members.items():
            canon = _canon(ip)
            if canon is not None:
                published[i] = canon
        vmis: dict[str, int] = {}
    else:
        published = {}
        vmis = {}
        for m in members:
            canon = _canon(m.ip)
            if canon is not None:
                published[m.index] = canon
            if m.vmi:
                vmis[m.vmi.lower()] = m.index
    local = {c for c in (_canon(a) for a in local_addrs) if c is not None}

    index: int | None
    how: How
    note_extra = ""
    if settings.own_index is not None:
        index, how = settings.own_index, "own_index"
    else:
        local_hits = sorted(i for i, ip in published.items() if ip in local)
        short = _short(hostname)
        from_name = index_from_name(short) if short else None
        if local_hits:
            index, how = local_hits[0], "local_ip"
        elif short and short in vmis:
            index, how = vmis[short], "vmi"
        elif from_name is not None and from_name < settings.max_members:
            index, how = from_name, "hostname"
        else:
            return OwnSlot(
                None,
                None,
                "unknown",
                "own slot unknown: no own_index, no published IP is local, no member's vmi "
                f"is the hostname {hostname!r} and it has no usable trailing -<n>",
            )
        if how == "local_ip" and len(local_hits) > 1:
            # Two slots on our own addresses: report it; the lowest index wins.
            note_extra = f" (also local: slots {local_hits[1:]})"

    pub = published.get(index)
    is_local = pub is not None and pub in local
    route = _local_pin_ok(default_route_addr)
    where = f"slot {index} (found by {how})"

    if settings.own_slot == "published":
        if pub is None:
            return OwnSlot(index, None, how, f"{where}: not published yet", None, False)
        note = f"{where}: pinned to the published IP {pub}"
        if not is_local:
            note += " (not a local address: IMEX may not find itself; own_slot = published)"
        return OwnSlot(index, pub, how, note + note_extra, pub, not is_local)

    if settings.own_slot == "local":
        pin = route or (pub if is_local else None)
        if pin is None:
            return OwnSlot(
                index, None, how, f"{where}: no usable local address to pin yet", pub, False
            )
        note = f"{where}: pinned to the local address {pin} (own_slot = local)"
        return OwnSlot(index, pin, how, note + note_extra, pub, pub is not None and not is_local)

    # auto
    if pub is None:
        if settings.mode == "names" and route is not None and how in ("own_index", "hostname"):
            # A replacement VM whose slot is free: start IMEX now on the address it will
            # most likely be published with, rather than after the host agent published
            # it (its peers dial the moment they hear; a daemon that is not listening yet
            # sends them into backoff). A published IP that is another local address
            # (a secondary network) re-pins it, and IMEX restarts once.
            note = (f"{where}: not published yet; pinned provisionally to the default-route "
                    f"address {route} so IMEX can start now")
            return OwnSlot(index, route, how, note + note_extra, None, False)
        return OwnSlot(index, None, how, f"{where}: not published yet", None, False)
    if is_local:
        note = f"{where}: pinned to the published IP {pub}, a local address"
        return OwnSlot(index, pub, how, note + note_extra, pub, False)
    if route is not None:
        note = (
            f"{where}: the published IP {pub} is not a local address (masquerade binding); "
            f"pinned to the default-route address {route} so IMEX finds itself, peers use {pub}"
        )
        return OwnSlot(index, route, how, note + note_extra, pub, True)
    note = (
        f"{where}: the published IP {pub} is not a local address and there is no "
        f"default-route address; pinned to {pub}, IMEX may not find itself"
    )
    return OwnSlot(index, pub, how, note + note_extra, pub, True)
