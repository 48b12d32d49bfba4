"""Peer discovery over cluster DNS: what one answer says, and what we believe after many.

Pure (no sockets, no clock); the queries are :mod:`guest_agent.peers.dns_io`. Two layers,
data flowing one way:

1. **Interpretation**: :func:`interpret_srv` and :func:`interpret_address` turn one
   DNS response into a verdict about our slots. Only names of *our* slots in *our*
   Service (``<slot>.<service>.<ns>.svc.<zone>``, index below ``max_members``) count;
   everything else in an answer (names outside the zone, other slot prefixes, indices out
   of range, loopback/link-local/unusable addresses, records of the wrong type or owner) is
   ignored with one log line. Nothing but a validated ``index -> IP`` pin leaves here.
2. **Tracking**: :class:`DnsTracker` folds observations into pins with hysteresis.
   NXDOMAIN, or a slot missing from a successful SRV answer, is an *authoritative
   absence*; a slot is unpinned only after two consecutive ones, so one blip never unpins
   a live peer. SERVFAIL, REFUSED, timeouts and garbage are *unknown*: they change
   nothing, neither pins nor the absence count.

:func:`parse_resolv_conf` reads the nameservers out of ``/etc/resolv.conf``'s text.
"""

from __future__ import annotations

import ipaddress
import logging
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rdtypes.IN.SRV
import dns.rrset

from guest_agent.config import Nameserver
from imex_shared.model import EnsembleId, ModelError, usable_ip

log = logging.getLogger("guest_agent.dnsquery")  # logger name pinned

Warn = Callable[[str], None]
SlotVerdict = Literal["present", "absent", "nodata", "unknown"]

ABSENCES_TO_UNPIN = 2


# --------------------------------------------------------------------------- tracking


@dataclass(frozen=True, slots=True)
class DnsObservation:
    """What one DNS pass said. Slots in neither ``present`` nor ``absent`` are unknown."""

    present: Mapping[int, str] = field(default_factory=dict)
    absent: frozenset[int] = frozenset()
    via: Literal["srv", "slots", "none"] = "none"

    @property
    def learned(self) -> bool:
        """True when the pass said anything authoritative."""
        return bool(self.present) or bool(self.absent)


@dataclass(frozen=True, slots=True)
class DnsState:
    """What we believe after all observations so far."""

    pins: Mapping[int, str]
    absent: frozenset[int]
    #: seen absent once since the last presence: still pinned, one more absence unpins
    pending: frozenset[int]


class DnsTracker:
    """Folds observations into pins with hysteresis (no sockets, no clock).

    Per slot: present -> pinned to the observed IP, absence count reset; authoritative
    absence -> count + 1, and at ``absences_to_unpin`` the pin is dropped and the slot is
    reported absent; unknown -> nothing changes.
    """

    def __init__(self, max_members: int, *, absences_to_unpin: int = ABSENCES_TO_UNPIN) -> None:
        if absences_to_unpin < 1:
            raise ValueError("absences_to_unpin must be at least 1")
        self.max_members = max_members
        self.absences_to_unpin = absences_to_unpin
        self._pins: dict[int, str] = {}
        self._misses: dict[int, int] = {}
        self._observed = False

    @property
    def observed(self) -> bool:
        """True once any observation taught us something authoritative."""
        return self._observed

    def observe(self, obs: DnsObservation) -> DnsState:
        if obs.learned:
            self._observed = True
        for index in range(self.max_members):
            if index in obs.present:
                self._pins[index] = obs.present[index]
                self._misses[index] = 0
            elif index in obs.absent:
                self._misses[index] = self._misses.get(index, 0) + 1
                if self._misses[index] >= self.absences_to_unpin:
                    self._pins.pop(index, None)
        return self.state

    def adopt(self, pins: Mapping[int, str], absent: Iterable[int]) -> None:
        """Take a newer authoritative belief (a registry answer) as the baseline.

        Without it, a slot whose DNS passes were only "unknown" (timeouts)
        keeps the pin DNS saw last, possibly from before a migration, and a
        failover to DNS would put that stale address back. After adopting,
        DNS can only change a slot by observing it again.
        """
        gone = set(absent)
        for index in range(self.max_members):
            if index in pins:
                self._pins[index] = pins[index]
                self._misses[index] = 0
            elif index in gone:
                self._pins.pop(index, None)
                self._misses[index] = self.absences_to_unpin

    @property
    def state(self) -> DnsState:
        absent = frozenset(
            i for i, n in self._misses.items() if n >= self.absences_to_unpin
        )
        pending = frozenset(
            i for i, n in self._misses.items() if 0 < n < self.absences_to_unpin
        )
        return DnsState(dict(sorted(self._pins.items())), absent, pending)


# --------------------------------------------------------------------------- answers


@dataclass(frozen=True, slots=True)
class SrvVerdict:
    """One SRV response, interpreted.

    ``kind``: ``records`` (NOERROR with SRV records: ``named`` are the slots the answer
    lists, ``addresses`` the usable addresses the additional section gave for them),
    ``nxdomain``, ``nodata`` (NOERROR without SRV records) or ``error``.
    """

    kind: Literal["records", "nxdomain", "nodata", "error"]
    named: frozenset[int] = frozenset()
    addresses: Mapping[int, tuple[str, ...]] = field(default_factory=dict)


def _slot_of(
    name: dns.name.Name, ens: EnsembleId, zone: str, max_members: int, warn: Warn, what: str
) -> int | None:
    """Index of ``name`` if it is ``<our slot>.<service fqdn>.``, else None (with a log line)."""
    service = dns.name.from_text(ens.service_fqdn(zone))
    text = name.to_text()
    if not name.is_subdomain(service) or len(name) != len(service) + 1:
        warn(f"DNS {what}: ignoring {text}: not a slot name of {service.to_text()}")
        return None
    label = name.labels[0].decode("ascii", "replace").lower()
    index = ens.slot_index(label)
    if index is None:
        warn(f"DNS {what}: ignoring {text}: {label!r} is not a slot of ensemble {ens.key}")
        return None
    if index >= max_members:
        warn(
            f"DNS {what}: ignoring {text}: slot index {index} is out of range "
            f"(max_members = {max_members})"
        )
        return None
    return index


def _addresses(rrset: dns.rrset.RRset, warn: Warn, what: str) -> list[str]:
    out = []
    for rd in rrset:
        raw = getattr(rd, "address", None)
        try:
            if not isinstance(raw, str):
                raise ModelError(f"{rd!r} carries no address")
            out.append(usable_ip(raw))
        except ModelError as exc:
            warn(f"DNS {what}: ignoring address of {rrset.name.to_text()}: {exc}")
    return out


def best_address(addrs: Iterable[str]) -> str | None:
    """Deterministic pick: the lowest IPv4 address, else the lowest IPv6 address."""
    parsed = sorted({ipaddress.ip_address(a) for a in addrs}, key=lambda a: (a.version, a))
    return str(parsed[0]) if parsed else None


def interpret_srv(
    response: dns.message.Message | None,
    ens: EnsembleId,
    zone: str,
    max_members: int,
    warn: Warn,
) -> SrvVerdict:
    """Interpret the answer to ``_imex._tcp.<service>...`` SRV (None = no answer at all)."""
    if response is None:
        return SrvVerdict("error")
    rcode = response.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return SrvVerdict("nxdomain")
    if rcode != dns.rcode.NOERROR:
        return SrvVerdict("error")
    qname = dns.name.from_text(ens.srv_name(zone))
    named: dict[dns.name.Name, int] = {}
    ours = foreign = 0
    for rrset in response.answer:
        if rrset.rdtype == dns.rdatatype.CNAME:
            continue
        if rrset.name != qname or rrset.rdtype != dns.rdatatype.SRV:
            foreign += 1
            warn(
                f"DNS SRV: ignoring {rrset.name.to_text()} "
                f"{dns.rdatatype.to_text(rrset.rdtype)} in the answer: not what was asked"
            )
            continue
        for rd in rrset:
            assert isinstance(rd, dns.rdtypes.IN.SRV.SRV)
            ours += 1
            index = _slot_of(rd.target, ens, zone, max_members, warn, "SRV target")
            if index is not None:
                named[rd.target] = index
    if not named:
        if ours or foreign:
            # Records, but not one usable target: a broken or hostile answer says nothing
            # about our slots (treating it as "all absent" would unpin every peer).
            warn(f"DNS SRV {qname.to_text()}: answer without a usable target; ignored")
            return SrvVerdict("error")
        return SrvVerdict("nodata")
    addresses: dict[int, list[str]] = {}
    for rrset in response.additional:
        if rrset.rdtype not in (dns.rdatatype.A, dns.rdatatype.AAAA):
            continue  # OPT, TSIG, ...: not ours to read
        if rrset.name not in named:
            warn(f"DNS SRV: ignoring additional record {rrset.name.to_text()}: not an SRV target")
            continue
        addresses.setdefault(named[rrset.name], []).extend(
            _addresses(rrset, warn, "SRV additional")
        )
    return SrvVerdict(
        "records",
        frozenset(named.values()),
        {i: tuple(a) for i, a in addresses.items() if a},
    )


def interpret_address(
    response: dns.message.Message | None,
    qname: dns.name.Name,
    rdtype: dns.rdatatype.RdataType,
    warn: Warn,
) -> tuple[SlotVerdict, str | None]:
    """Interpret the answer to ``qname`` A or AAAA: (verdict, IP for ``present``)."""
    if response is None:
        return "unknown", None
    rcode = response.rcode()
    if rcode == dns.rcode.NXDOMAIN:
        return "absent", None
    if rcode != dns.rcode.NOERROR:
        return "unknown", None
    found: list[str] = []
    saw_records = False
    for rrset in response.answer:
        if rrset.rdtype == dns.rdatatype.CNAME:
            continue
        if rrset.name != qname or rrset.rdtype != rdtype:
            warn(
                f"DNS {dns.rdatatype.to_text(rdtype)}: ignoring {rrset.name.to_text()} "
                f"{dns.rdatatype.to_text(rrset.rdtype)}: not what was asked"
            )
            continue
        saw_records = True
        found.extend(_addresses(rrset, warn, dns.rdatatype.to_text(rdtype)))
    best = best_address(found)
    if best is not None:
        return "present", best
    if saw_records:
        return "unknown", None  # records, but none usable: not evidence of absence
    return "nodata", None


# --------------------------------------------------------------------------- resolv.conf


def parse_resolv_conf(text: str, path: str | Path) -> tuple[Nameserver, ...]:
    """``nameserver`` lines of resolv.conf (scoped IPv6 skipped); 127.0.0.1 if none, as libc.

    ``path`` names the file in the log lines."""
    out = []
    for line in text.splitlines():
        fields = re.split(r"\s+", line.strip())
        if len(fields) >= 2 and fields[0] == "nameserver":
            if "%" in fields[1]:
                log.info("%s: skipping scoped nameserver %s", path, fields[1])
                continue
            try:
                out.append(Nameserver(str(ipaddress.ip_address(fields[1]))))
            except ValueError:
                log.warning("%s: ignoring nameserver %r", path, fields[1])
    return tuple(out) or (Nameserver("127.0.0.1"),)
