"""Views -> the pins this guest writes and what IMEX is told: merge, own slot, cliques.

Pure. Stage order: discovery yields Views (:mod:`guest_agent.peers.discovery`);
:func:`learn` folds each into what the guest knows (:class:`Known`; its published pins
follow :func:`merge_view`); :func:`plan_pins` turns that and the guest's own addresses
into a :class:`PinPlan`; ``guest_agent.files.apply`` writes it and the IMEX supervisor
is told ``PinPlan.told``.

Merge rules:

- a registry View is the whole truth: it replaces every pin (and the members' VMI
  names and NVLink cliques);
- a DNS View only speaks for the slots it asserts: it sets those it pins,
  unpins those it calls absent (already debounced by discovery: two
  authoritative absences), and every other slot keeps its last value, so a
  timeout or SERVFAIL never unpins a live peer.

The plan, in order: the own slot (:func:`guest_agent.pins.ownslot.resolve_own`); the
local pins, where the own slot is pinned to the address IMEX must find locally
(:func:`local_pins`; masquerade, DESIGN.md "Own slot"); the hosts block's pins, where
members of other NVLink cliques are pinned away (:func:`imex_shared.cliques.pins_for`;
the nodes file never depends on them); and what IMEX is told: in names mode IMEX
resolves through the hosts block, so a clique split is news for it (SIGUSR1); in ips
mode the nodes file holds the addresses and the split is not.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

from guest_agent.config import Settings
from guest_agent.peers.discovery import View
from guest_agent.pins.ownslot import OwnSlot, resolve_own
from imex_shared.cliques import pins_for
from imex_shared.model import Member


def merge_view(current: Mapping[int, str], view: View) -> dict[int, str]:
    """Published pins after ``view`` (rules in the module docstring)."""
    if view.source == "registry":
        return dict(view.pins)
    merged = dict(current)
    for index in view.absent:
        merged.pop(index, None)
    merged.update(view.pins)
    return merged


def local_pins(
    published: Mapping[int, str], own_index: int | None, own_ip: str | None
) -> dict[int, str]:
    """The pins this guest writes: published ones, own slot pinned to ``own_ip``."""
    pins = dict(published)
    if own_index is not None and own_ip is not None:
        pins[own_index] = own_ip
    return pins


@dataclass(frozen=True, slots=True)
class Known:
    """What the guest has learned from the Views so far."""

    #: index -> IP, as the Views published them (:func:`merge_view`)
    published: Mapping[int, str] = field(default_factory=dict)
    #: index -> VMI name and index -> NVLink clique, from the last registry View
    #: (DNS says neither)
    vmis: Mapping[int, str] = field(default_factory=dict)
    cliques: Mapping[int, str] = field(default_factory=dict)
    #: the last View's source, and the last registry generation
    source: str | None = None
    generation: int | None = None

    def members(self) -> list[Member]:
        """The published members (with their VMI names), for the own-slot rule."""
        return [Member(i, ip, vmi=self.vmis.get(i)) for i, ip in sorted(self.published.items())]


def learn(known: Known | None, view: View) -> Known:
    """What the guest knows after ``view`` (``known`` None: nothing learned before)."""
    base = known if known is not None else Known()
    vmis, cliques = base.vmis, base.cliques
    if view.source == "registry":
        vmis = {m.index: m.vmi for m in view.members if m.vmi}
        cliques = {m.index: m.clique for m in view.members if m.clique}
    generation = view.generation if view.generation is not None else base.generation
    return Known(merge_view(base.published, view), vmis, cliques, view.source, generation)


@dataclass(frozen=True, slots=True)
class PinPlan:
    """What one pass writes and tells IMEX (see the module docstring)."""

    own: OwnSlot
    #: the nodes file's pins: the published ones, the own slot pinned locally
    pins: dict[int, str]
    #: the hosts block's pins: ``pins`` less the members of other NVLink cliques
    hosts_pins: dict[int, str]
    #: what IMEX is told: ``hosts_pins`` in names mode, ``pins`` in ips mode
    told: dict[int, str]


def plan_pins(
    settings: Settings,
    known: Known,
    local_addrs: Iterable[str],
    hostname: str,
    default_route: str | None,
) -> PinPlan:
    """Own slot, local pins, the hosts block's pins and what IMEX is told, for ``known``."""
    own = resolve_own(settings, known.members(), local_addrs, hostname, default_route)
    pins = local_pins(known.published, own.index, own.pin_ip)
    hosts_pins = pins_for(pins, known.cliques, own.index)
    told = hosts_pins if settings.mode == "names" else pins
    return PinPlan(own, pins, hosts_pins, told)
