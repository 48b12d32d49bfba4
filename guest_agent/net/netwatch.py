"""The guest's own addresses, over rtnetlink (pyroute2's asyncio ``AsyncIPRoute``,
imported through rtnl_import.py, which can skip pyroute2's eager package init).

Why: the own slot depends on which addresses are local (DESIGN.md "Own slot"), and a
migration or a DHCP renewal changes them; the daemon must rediscover and re-evaluate
at once rather than at the next poll.

* :func:`local_addresses` and :func:`default_route_address` are one dump each; the
  choice of "the default-route address" is a pure function (:func:`pick_route_address`)
  of the dumped routes and addresses.
* :func:`watch_addresses` subscribes to the link, IPv4/IPv6 address and route multicast
  groups and calls ``on_change()`` (synchronously, in the event loop) after an
  RTM_NEWADDR/DELADDR/NEWLINK/DELLINK/NEWROUTE/DELROUTE, debounced: a burst of events
  (an interface coming up emits a dozen) gives one call ``debounce`` seconds after the
  last event. It runs until cancelled; when the netlink socket fails it reopens it after
  a second and calls ``on_change()`` once, since events may have been missed meanwhile.
  One ``get()`` on the socket yields one batch of messages, so it is called in a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from guest_agent.net import rtnl_import

AsyncIPRoute, _rtnl = rtnl_import.load()
RTM_NEWADDR: Final[int] = _rtnl.RTM_NEWADDR
RTM_DELADDR: Final[int] = _rtnl.RTM_DELADDR
RTM_NEWLINK: Final[int] = _rtnl.RTM_NEWLINK
RTM_DELLINK: Final[int] = _rtnl.RTM_DELLINK
RTM_NEWROUTE: Final[int] = _rtnl.RTM_NEWROUTE
RTM_DELROUTE: Final[int] = _rtnl.RTM_DELROUTE
RTMGRP_LINK: Final[int] = _rtnl.RTMGRP_LINK
RTMGRP_IPV4_IFADDR: Final[int] = _rtnl.RTMGRP_IPV4_IFADDR
RTMGRP_IPV6_IFADDR: Final[int] = _rtnl.RTMGRP_IPV6_IFADDR
RTMGRP_IPV4_ROUTE: Final[int] = _rtnl.RTMGRP_IPV4_ROUTE
RTMGRP_IPV6_ROUTE: Final[int] = _rtnl.RTMGRP_IPV6_ROUTE

log = logging.getLogger("guest_agent.netwatch")  # logger name pinned

GROUPS: Final = (
    RTMGRP_LINK | RTMGRP_IPV4_IFADDR | RTMGRP_IPV6_IFADDR | RTMGRP_IPV4_ROUTE | RTMGRP_IPV6_ROUTE
)
EVENTS: Final = frozenset(
    {RTM_NEWADDR, RTM_DELADDR, RTM_NEWLINK, RTM_DELLINK, RTM_NEWROUTE, RTM_DELROUTE}
)
MAIN_TABLE: Final = 254
IFA_F_TENTATIVE: Final = 0x40
IFA_F_DADFAILED: Final = 0x08
IFA_F_DEPRECATED: Final = 0x20


class NetwatchError(OSError):
    """Netlink could not be opened or dumped."""


@dataclass(frozen=True, slots=True)
class Addr:
    """One interface address as the kernel reports it."""

    ip: str
    ifindex: int
    flags: int = 0


@dataclass(frozen=True, slots=True)
class Route:
    """One main-table route: ``dst_len`` 0 is a default route."""

    family: int
    dst_len: int
    oif: int | None
    prefsrc: str | None = None
    priority: int = 0


def _good_local(addr: Addr) -> bool:
    try:
        ip = ipaddress.ip_address(addr.ip)
    except ValueError:
        return False
    if ip.is_loopback or ip.is_link_local or ip.is_unspecified or ip.is_multicast:
        return False
    return not addr.flags & (IFA_F_TENTATIVE | IFA_F_DADFAILED | IFA_F_DEPRECATED)


def pick_route_address(routes: Iterable[Route], addrs: Iterable[Addr]) -> str | None:
    """Source address of the default route: IPv4 before IPv6, lowest metric first.

    The route's ``prefsrc`` when it is a local address, else the lowest usable address
    (not loopback, link-local, tentative or deprecated) of the route's interface.
    """
    addr_list = list(addrs)
    local = {a.ip for a in addr_list}
    defaults = sorted(
        (r for r in routes if r.dst_len == 0 and r.oif is not None),
        key=lambda r: (0 if r.family == socket.AF_INET else 1, r.priority, r.oif or 0),
    )
    for route in defaults:
        if route.prefsrc and route.prefsrc in local:
            return route.prefsrc
        want = 4 if route.family == socket.AF_INET else 6
        candidates = sorted(
            (
                ipaddress.ip_address(a.ip)
                for a in addr_list
                if a.ifindex == route.oif and _good_local(a)
                and ipaddress.ip_address(a.ip).version == want
            ),
        )
        if candidates:
            return str(candidates[0])
    return None


def _addr_of(msg: Mapping[str, Any]) -> Addr | None:
    ip = msg.get("address") if hasattr(msg, "get") else None
    if not isinstance(ip, str):
        return None
    flags = msg.get("IFA_FLAGS")
    return Addr(ip.split("%", 1)[0], int(msg["index"]), int(flags or msg.get("flags", 0) or 0))


async def _dump_addrs(ipr: Any) -> list[Addr]:
    out = []
    async for msg in await ipr.addr("dump"):
        addr = _addr_of(msg)
        if addr is not None:
            out.append(addr)
    return out


async def _dump_routes(ipr: Any) -> list[Route]:
    out = []
    for family in (socket.AF_INET, socket.AF_INET6):
        async for msg in await ipr.route("dump", family=family, table=MAIN_TABLE):
            out.append(
                Route(
                    family=int(msg["family"]),
                    dst_len=int(msg["dst_len"]),
                    oif=msg.get("oif"),
                    prefsrc=msg.get("prefsrc"),
                    priority=int(msg.get("priority") or 0),
                )
            )
    return out


async def local_addresses() -> set[str]:
    """Every address on a local interface (canonical text, loopback included)."""
    try:
        async with AsyncIPRoute() as ipr:
            addrs = await _dump_addrs(ipr)
    except OSError as exc:
        raise NetwatchError(exc.errno, f"cannot dump addresses over netlink: {exc}") from exc
    out = set()
    for a in addrs:
        with contextlib.suppress(ValueError):
            out.add(str(ipaddress.ip_address(a.ip)))
    return out


async def default_route_address() -> str | None:
    """Source address of the default-route interface (see :func:`pick_route_address`)."""
    try:
        async with AsyncIPRoute() as ipr:
            addrs = await _dump_addrs(ipr)
            routes = await _dump_routes(ipr)
    except OSError as exc:
        raise NetwatchError(exc.errno, f"cannot dump routes over netlink: {exc}") from exc
    return pick_route_address(routes, addrs)


async def follow_addresses(on_change: Callable[[], Awaitable[None]]) -> None:
    """:func:`watch_addresses` with an async follow-up, one at a time: changes that come
    while it runs are coalesced into the next call."""
    from guest_agent.daemon import run_all

    changed = asyncio.Event()

    async def follow() -> None:
        while True:
            await changed.wait()
            changed.clear()
            await on_change()

    await run_all({"netwatch-follow": follow(),
                   "netwatch-watch": watch_addresses(changed.set)})


async def watch_addresses(
    on_change: Callable[[], None], *, debounce: float = 0.1, reopen_after: float = 1.0
) -> None:
    """Call ``on_change()`` after address/link/route changes, forever (until cancelled)."""
    while True:
        try:
            await _watch_once(on_change, debounce)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # netlink trouble must not end the watch
            log.warning("netlink watch failed (%s); reopening in %g s", exc, reopen_after)
        await asyncio.sleep(reopen_after)
        _safe_call(on_change)  # events may have been missed while the socket was down


def _safe_call(on_change: Callable[[], None]) -> None:
    try:
        on_change()
    except Exception:
        log.exception("address change callback failed")


async def _watch_once(on_change: Callable[[], None], debounce: float) -> None:
    loop = asyncio.get_running_loop()
    pending: asyncio.TimerHandle | None = None

    def fire() -> None:
        nonlocal pending
        pending = None
        _safe_call(on_change)

    async with AsyncIPRoute() as ipr:
        await ipr.bind(groups=GROUPS)
        # A change between the caller's first read and this bind sent no event to us:
        # call back once now, so the caller reads again (seen in the soak: a migration
        # as the agent started left it pinning a gone address for 40 s).
        _safe_call(on_change)
        try:
            while True:
                relevant = False
                async for msg in ipr.get():
                    event = msg.get("event") if hasattr(msg, "get") else None
                    kind = msg["header"]["type"] if "header" in msg else None
                    if kind in EVENTS or event in {
                        "RTM_NEWADDR", "RTM_DELADDR", "RTM_NEWLINK",
                        "RTM_DELLINK", "RTM_NEWROUTE", "RTM_DELROUTE",
                    }:
                        relevant = True
                if relevant:
                    if pending is not None:
                        pending.cancel()
                    pending = loop.call_later(debounce, fire)
        finally:
            if pending is not None:
                pending.cancel()
