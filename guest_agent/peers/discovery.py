"""What discovery hands the daemon: a :class:`View`, one source's word on the ensemble.

Pure; the loops that ask the registry and DNS and publish Views are
:mod:`guest_agent.peers.discovery_io`. A View carries only validated ``index -> IP`` pins
and the slots known to be absent, nothing else can reach a file:

* a **registry** View (:func:`registry_view`) is authoritative for *all* slots: absent is
  every slot not among its members;
* a **DNS** View (:func:`dns_view`) asserts only what DNS said authoritatively (with the
  two-absences hysteresis of :mod:`guest_agent.peers.dns`); slots it knows nothing about
  are neither pinned nor absent.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from guest_agent.peers.registry import RegistrySnapshot
from imex_shared.model import Member

if TYPE_CHECKING:  # dnspython: the pins stage, ``once`` and ``status`` do without it
    from guest_agent.peers.dns import DnsState


@dataclass(frozen=True, slots=True)
class View:
    """What one source says about the ensemble right now."""

    source: Literal["registry", "dns"]
    #: index -> IP of slots known present (validated by the shared model)
    pins: Mapping[int, str]
    #: slots authoritatively absent (DNS: after two consecutive absences)
    absent: frozenset[int]
    #: registry generation; None for DNS
    generation: int | None
    #: registry: with vmi/node/phase/ready; DNS: index and ip only
    members: tuple[Member, ...]
    #: registry: sha256 of the ensemble's CA bundle (authEncryption), else None
    ca_bundle_sha256: str | None = None


def registry_view(snap: RegistrySnapshot, max_members: int) -> View:
    """A registry answer as a view: authoritative for every slot."""
    pins = snap.pins
    return View(
        source="registry",
        pins=pins,
        absent=frozenset(range(max_members)) - frozenset(pins),
        generation=snap.generation,
        members=snap.members,
        ca_bundle_sha256=snap.ca_bundle_sha256,
    )


def dns_view(state: DnsState) -> View:
    """The DNS tracker's belief as a view: only what DNS said authoritatively."""
    return View(
        source="dns",
        pins=dict(state.pins),
        absent=state.absent,
        generation=None,
        members=tuple(Member(i, ip) for i, ip in sorted(state.pins.items())),
    )
