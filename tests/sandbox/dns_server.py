"""A DNS server that answers as CoreDNS's kubernetes plugin does for headless Services.

Why it exists: this machine has no CoreDNS (FACTS.md, "This machine"). The guest agent
discovers its peers through cluster DNS, so its tests need a server that speaks real DNS
over real UDP and TCP sockets and answers what CoreDNS would answer for an ensemble's
headless, selector-less Service from its EndpointSlices (FACTS.md, "Kubernetes DNS for a
headless Service without selector"):

* for each *ready* endpoint (``conditions.ready`` true or absent)
  ``<hostname>.<svc>.<ns>.svc.<zone>`` A/AAAA; an endpoint without a hostname gets the
  dashed-address name CoreDNS uses (``10-0-0-1.<svc>...``);
* ``<svc>.<ns>.svc.<zone>`` A/AAAA of all ready endpoints;
* per *named* port ``_<port>._<proto>.<svc>.<ns>.svc.<zone>`` SRV, one record per ready
  endpoint, target ``<hostname>.<svc>.<ns>.svc.<zone>``, the targets' A/AAAA in the
  additional section;
* no ready endpoint, or a name nobody serves: NXDOMAIN; a served name asked for another type
  (including the empty non-terminals ``svc.<zone>``, ``<ns>.svc.<zone>``): NOERROR without
  answers (NODATA); both negative kinds carry the zone's SOA in the authority section;
* TTL 5 s (the plugin's default; the stock Corefile's ``ttl 30`` is a constructor argument);
* over UDP an answer larger than 512 bytes (or the client's EDNS payload size) is sent
  empty with the TC bit, so clients retry over TCP;
* names outside the zone: REFUSED (this server is authoritative for the zone only and
  forwards nothing).

A ClusterIP Service (``spec.clusterIP`` not ``None``) answers its cluster IP at the service
name and SRV to the service name, and no per-endpoint names, as CoreDNS does.

Data model and concurrency: :class:`ClusterDnsModel` holds the raw Kubernetes JSON of
EndpointSlices and (optionally) Services. Every change rebuilds an immutable record table
under a ``threading.Lock`` and swaps it in with one assignment; queries read whichever table
is current, so the model may be changed from any thread or task while the server answers.
Until :meth:`ClusterDnsModel.set_services` is called, every slice's Service is assumed to
exist and be headless; afterwards only listed Services are served (CoreDNS looks Services up
first and ignores slices of a Service it does not know).

Faults (``fail_mode``) let tests drive the guest agent's bad-input handling: ``servfail``,
``refused``, ``timeout`` (queries are dropped), ``garbage`` (a malformed reply), and hostile
answers: ``outside_zone`` (extra records naming hosts outside the zone), ``out_of_range``
(an extra SRV target ``<slot-prefix>-999``), ``loopback`` and ``link_local`` (every address
replaced). ``set_fail_mode(mode, names=[...])`` limits a fault to some query names;
``DnsServer.delay`` holds every answer for that many seconds (a slow server).

Bad input in the slices (a bad address, a missing label) is skipped with a log line, never
raised into the server.

Run alone::

    python -m tests.sandbox.dns_server --listen 127.0.0.1:5353 --zone cluster.local \
        --slices FILE.json [--services FILE.json] [--ttl 5]

``FILE.json`` holds a JSON list of EndpointSlices (or a ``{"items": [...]}`` list); it is
re-read when it changes and on SIGHUP.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import copy
import ipaddress
import json
import logging
import re
import signal
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import dns.edns
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.opcode
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset

if TYPE_CHECKING:
    from lightkube import AsyncClient

log = logging.getLogger("sandbox.dns")

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
# A label *value* may not hold "/": DESIGN.md's "imex-ensemble.io/host-agent" is refused by a
# real API server (422), so the stand-in's slices use a valid value in the same spirit.
MANAGED_BY = "host-agent.imex-ensemble.io"
DEFAULT_TTL = 5
UDP_DEFAULT_LIMIT = 512
OUR_EDNS_PAYLOAD = 1232

FAIL_MODES = (
    "servfail",
    "refused",
    "timeout",
    "garbage",
    "outside_zone",
    "out_of_range",
    "loopback",
    "link_local",
)
_HOSTILE_OUTSIDE = "evil.example.net."
_HOSTILE_OUTSIDE_V4 = "192.0.2.66"

JsonDict = dict[str, Any]


class DnsStandinError(Exception):
    """Base of errors raised by the DNS stand-in's setup (never by query handling)."""


class BadFailModeError(DnsStandinError, ValueError):
    """An unknown ``fail_mode`` was asked for."""


class SliceFileError(DnsStandinError):
    """A ``--slices``/``--services`` file is not a JSON list of objects."""


def _name(text: str) -> dns.name.Name:
    return dns.name.from_text(text.rstrip(".") + ".")


def _key(name: str | dns.name.Name) -> str:
    """Canonical text of a name for the query counters: lower case, no trailing dot."""
    if isinstance(name, dns.name.Name):
        name = name.to_text()
    return name.lower().rstrip(".")


def _dashed(ip: str) -> str:
    """CoreDNS's host label for an endpoint without hostname: its address with dashes."""
    return ip.replace(".", "-").replace(":", "-")


# --------------------------------------------------------------------------- record table


@dataclass(frozen=True)
class _Table:
    """Immutable answer table built from one snapshot of the model."""

    origin: dns.name.Name
    ttl: int
    records: Mapping[tuple[dns.name.Name, dns.rdatatype.RdataType], tuple[dns.rdata.Rdata, ...]]
    names: frozenset[dns.name.Name]


@dataclass
class _Builder:
    origin: dns.name.Name
    ttl: int
    records: dict[tuple[dns.name.Name, dns.rdatatype.RdataType], list[dns.rdata.Rdata]] = field(
        default_factory=lambda: collections.defaultdict(list)
    )

    def add(self, name: dns.name.Name, rdtype: dns.rdatatype.RdataType, text: str) -> None:
        rd = dns.rdata.from_text(dns.rdataclass.IN, rdtype, text)
        bucket = self.records[(name, rdtype)]
        if rd not in bucket:
            bucket.append(rd)

    def add_address(self, name: dns.name.Name, ip: str) -> None:
        addr = ipaddress.ip_address(ip)
        self.add(name, dns.rdatatype.A if addr.version == 4 else dns.rdatatype.AAAA, str(addr))

    def freeze(self) -> _Table:
        names: set[dns.name.Name] = {self.origin}
        for owner, _ in self.records:
            n = owner
            # every ancestor below the zone apex exists as an empty non-terminal
            while n != self.origin and n.is_subdomain(self.origin):
                names.add(n)
                n = n.parent()
        return _Table(
            origin=self.origin,
            ttl=self.ttl,
            records={k: tuple(v) for k, v in self.records.items()},
            names=frozenset(names),
        )


def _ready(endpoint: Mapping[str, Any]) -> bool:
    conditions = endpoint.get("conditions") or {}
    return conditions.get("ready") is not False


def _endpoint_addresses(slice_: Mapping[str, Any], endpoint: Mapping[str, Any]) -> list[str]:
    family = slice_.get("addressType", "IPv4")
    out: list[str] = []
    for raw in endpoint.get("addresses") or []:
        try:
            addr = ipaddress.ip_address(str(raw))
        except ValueError:
            log.warning("slice %s: skipping endpoint address %r: not an IP address",
                        _slice_id(slice_), raw)
            continue
        if (family == "IPv4" and addr.version != 4) or (family == "IPv6" and addr.version != 6):
            log.warning("slice %s: skipping address %s: slice addressType is %s",
                        _slice_id(slice_), addr, family)
            continue
        out.append(str(addr))
    return out


def _slice_id(slice_: Mapping[str, Any]) -> str:
    meta = slice_.get("metadata") or {}
    return f"{meta.get('namespace', '?')}/{meta.get('name', '?')}"


_RFC1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")


def _add_cluster_ip_service(
    b: _Builder, zone: str, ns: str, svc: str, svc_name: dns.name.Name,
    spec: Mapping[str, Any], cluster_ips: list[str],
) -> None:
    """A ClusterIP Service: the VIP and SRV to the service name, no endpoint names."""
    for ip in cluster_ips:
        with contextlib.suppress(ValueError):
            b.add_address(svc_name, ip)
    for port in spec.get("ports") or []:
        if port.get("name"):
            proto = str(port.get("protocol", "TCP")).lower()
            vip_srv = _name(f"_{port['name']}._{proto}.{svc}.{ns}.svc.{zone}")
            b.add(vip_srv, dns.rdatatype.SRV, f"0 100 {int(port['port'])} {svc_name}")


def _add_headless_slice(
    b: _Builder, srv: dict[dns.name.Name, list[tuple[int, str]]], zone: str, ns: str,
    svc: str, svc_name: dns.name.Name, s: Mapping[str, Any],
) -> None:
    """One slice of a headless Service: names per ready endpoint, SRV per named port."""
    named_ports = [p for p in s.get("ports") or [] if p.get("name") and p.get("port")]
    for ep in s.get("endpoints") or []:
        if not _ready(ep):
            continue
        addrs = _endpoint_addresses(s, ep)
        hostname = ep.get("hostname")
        if hostname is not None and not (
            isinstance(hostname, str) and _RFC1123_LABEL.match(hostname)
        ):
            # the API server refuses these; a hand-made slice gets a log line, no records
            log.warning("slice %s: hostname %r is not a lowercase RFC 1123 label; skipped",
                        _slice_id(s), hostname)
            continue
        for ip in addrs:
            host_name = dns.name.Name(((hostname or _dashed(ip)).encode(),)).concatenate(
                svc_name)
            b.add_address(svc_name, ip)
            b.add_address(host_name, ip)
            for port in named_ports:
                proto = str(port.get("protocol", "TCP")).lower()
                srv_name = _name(f"_{port['name']}._{proto}.{svc}.{ns}.svc.{zone}")
                entry = (int(port["port"]), host_name.to_text())
                if entry not in srv[srv_name]:
                    srv[srv_name].append(entry)


def build_table(
    zone: str,
    ttl: int,
    slices: Iterable[Mapping[str, Any]],
    services: Mapping[tuple[str, str], Mapping[str, Any]] | None,
) -> _Table:
    """Pure: turn EndpointSlices (and Services, when known) into CoreDNS's records."""
    origin = _name(zone)
    b = _Builder(origin, ttl)
    by_service: dict[tuple[str, str], list[Mapping[str, Any]]] = collections.defaultdict(list)
    srv: dict[dns.name.Name, list[tuple[int, str]]] = collections.defaultdict(list)
    for s in slices:
        try:
            meta = s.get("metadata") or {}
            svc = (meta.get("labels") or {}).get(SERVICE_NAME_LABEL)
            ns = meta.get("namespace")
        except AttributeError:
            log.warning("skipping a slice that is not a Kubernetes object: %.80r", s)
            continue
        if not svc or not ns:
            log.warning("slice %s: no %s label or namespace; CoreDNS ignores it",
                        _slice_id(s), SERVICE_NAME_LABEL)
            continue
        if s.get("addressType", "IPv4") not in ("IPv4", "IPv6"):
            continue
        by_service[(ns, svc)].append(s)

    keys = set(by_service) if services is None else set(services)
    for ns, svc in sorted(keys):
        try:
            svc_name = _name(f"{svc}.{ns}.svc.{zone}")
            spec = (services or {}).get((ns, svc), {}).get("spec") or {}
            cluster_ips = [ip for ip in (spec.get("clusterIPs") or [spec.get("clusterIP")])
                           if ip and ip != "None"]
            if cluster_ips:
                _add_cluster_ip_service(b, zone, ns, svc, svc_name, spec, cluster_ips)
                continue
        except (AttributeError, TypeError, ValueError, KeyError,
                dns.exception.DNSException) as e:
            log.warning("service %s/%s: skipped, malformed: %s", ns, svc, e)
            continue
        for s in by_service.get((ns, svc), []):
            # all or nothing per slice: build aside, merge when the whole slice made sense
            part = _Builder(origin, ttl)
            part_srv: dict[dns.name.Name, list[tuple[int, str]]] = collections.defaultdict(list)
            try:
                _add_headless_slice(part, part_srv, zone, ns, svc, svc_name, s)
            except (AttributeError, TypeError, ValueError, KeyError,
                    dns.exception.DNSException) as e:
                log.warning("slice %s: skipped, malformed: %s", _slice_id(s), e)
                continue
            for key, rds in part.records.items():
                bucket = b.records[key]
                bucket.extend(rd for rd in rds if rd not in bucket)
            for owner, entries in part_srv.items():
                srv[owner].extend(e for e in entries if e not in srv[owner])
    # CoreDNS spreads the weight evenly over the records of one SRV set
    for owner, targets in srv.items():
        weight = max(1, 100 // len(targets))
        for port_no, target in targets:
            b.add(owner, dns.rdatatype.SRV, f"0 {weight} {port_no} {target}")
    return b.freeze()


# --------------------------------------------------------------------------- model


class ClusterDnsModel:
    """Thread-safe store of EndpointSlices/Services and the answer table derived from them."""

    def __init__(self, zone: str = "cluster.local", ttl: int = DEFAULT_TTL) -> None:
        self.zone = zone.rstrip(".")
        self.ttl = ttl
        self._lock = threading.Lock()
        self._slices: dict[tuple[str, str], JsonDict] = {}
        self._services: dict[tuple[str, str], JsonDict] | None = None
        self._table = build_table(self.zone, ttl, [], None)
        self.version = 0

    # ---- feeding
    def set_endpoint_slices(self, slices: Sequence[Mapping[str, Any]]) -> None:
        """Replace all EndpointSlices (raw Kubernetes JSON) at once (nothing, on a TypeError)."""
        new = self._copies(slices)
        with self._lock:
            self._slices = new
            self._rebuild()

    def upsert_endpoint_slice(self, slice_: Mapping[str, Any]) -> None:
        with self._lock:
            key = self._obj_key(slice_)
            self._slices[key] = copy.deepcopy(dict(slice_))
            self._rebuild()

    def delete_endpoint_slice(self, namespace: str, name: str) -> None:
        with self._lock:
            self._slices.pop((namespace, name), None)
            self._rebuild()

    def set_services(self, services: Sequence[Mapping[str, Any]] | None) -> None:
        """Replace all Services; ``None`` means "every slice's Service exists, headless"."""
        new = None if services is None else self._copies(services)
        with self._lock:
            self._services = new
            self._rebuild()

    def upsert_service(self, service: Mapping[str, Any]) -> None:
        with self._lock:
            if self._services is None:
                self._services = {}
            key = self._obj_key(service)
            self._services[key] = copy.deepcopy(dict(service))
            self._rebuild()

    def delete_service(self, namespace: str, name: str) -> None:
        with self._lock:
            if self._services is not None:
                self._services.pop((namespace, name), None)
                self._rebuild()

    def set_members(
        self,
        namespace: str,
        service: str,
        members: Mapping[str, str | None],
        *,
        port: int = 50000,
        port_name: str = "imex",
        ready: Mapping[str, bool] | None = None,
    ) -> None:
        """Convenience: publish ``hostname -> IP`` (None = no endpoint) as the service's slices.

        Builds what the host agent publishes (DESIGN.md): ``<service>-imex`` for IPv4 and
        ``<service>-imex-v6`` for IPv6 members, replacing both.
        """
        by_family: dict[str, list[JsonDict]] = {"IPv4": [], "IPv6": []}
        for host, ip in members.items():
            if ip is None:
                continue
            fam = "IPv6" if ":" in ip else "IPv4"
            by_family[fam].append({
                "addresses": [ip],
                "hostname": host,
                "conditions": {"ready": True if ready is None else ready.get(host, True)},
            })
        with self._lock:
            for fam, suffix in (("IPv4", "-imex"), ("IPv6", "-imex-v6")):
                key = (namespace, service + suffix)
                if by_family[fam]:
                    self._slices[key] = endpoint_slice(
                        namespace, service, by_family[fam], port=port, port_name=port_name,
                        name=service + suffix, address_type=fam,
                    )
                else:
                    self._slices.pop(key, None)
            self._rebuild()

    @classmethod
    def _copies(cls, objs: Sequence[Mapping[str, Any]]) -> dict[tuple[str, str], JsonDict]:
        out: dict[tuple[str, str], JsonDict] = {}
        for o in objs:
            key = cls._obj_key(o)
            out[key] = copy.deepcopy(dict(o))
        return out

    @staticmethod
    def _obj_key(obj: Mapping[str, Any]) -> tuple[str, str]:
        if not isinstance(obj, Mapping):
            raise TypeError(f"not a Kubernetes object (a JSON object): {obj!r:.80}")
        meta = obj.get("metadata") or {}
        return (str(meta.get("namespace", "")), str(meta.get("name", "")))

    def _rebuild(self) -> None:
        # caller holds the lock
        self._table = build_table(self.zone, self.ttl, list(self._slices.values()),
                                  self._services)
        self.version += 1

    # ---- reading
    @property
    def table(self) -> _Table:
        return self._table

    def slices(self) -> list[JsonDict]:
        with self._lock:
            return copy.deepcopy(list(self._slices.values()))


def endpoint_slice(
    namespace: str,
    service: str,
    endpoints: list[JsonDict],
    *,
    port: int = 50000,
    port_name: str = "imex",
    name: str | None = None,
    address_type: str = "IPv4",
) -> JsonDict:
    """Raw EndpointSlice JSON shaped like the host agent's (DESIGN.md, "Names")."""
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name or f"{service}-imex",
            "namespace": namespace,
            "labels": {
                SERVICE_NAME_LABEL: service,
                "endpointslice.kubernetes.io/managed-by": MANAGED_BY,
            },
        },
        "addressType": address_type,
        "endpoints": endpoints,
        "ports": [{"name": port_name, "port": port, "protocol": "TCP"}],
    }


# --------------------------------------------------------------------------- answering


@dataclass
class Faults:
    """Current fault injection; read on every query."""

    mode: str | None = None
    names: frozenset[str] | None = None  # canonical keys; None = every name

    def applies(self, qname: dns.name.Name) -> bool:
        return self.mode is not None and (self.names is None or _key(qname) in self.names)


def _soa(table: _Table) -> dns.rrset.RRset:
    o = table.origin
    return dns.rrset.from_text(
        o, table.ttl, "IN", "SOA",
        f"ns.dns.{o} hostmaster.{o} 1 7200 1800 86400 {table.ttl}",
    )


def _hostile(
    table: _Table, mode: str, qname: dns.name.Name, rdtype: int,
    answer: list[dns.rrset.RRset], additional: list[dns.rrset.RRset],
) -> None:
    """Rewrite a positive answer into what a broken or hostile server might send."""
    ttl = table.ttl
    if mode in ("loopback", "link_local"):
        v4, v6 = ("127.0.0.1", "::1") if mode == "loopback" else ("169.254.1.1", "fe80::1")
        for rrs in (answer, additional):
            for i, rr in enumerate(rrs):
                if rr.rdtype in (dns.rdatatype.A, dns.rdatatype.AAAA):
                    ip = v4 if rr.rdtype == dns.rdatatype.A else v6
                    rrs[i] = dns.rrset.from_text(rr.name, ttl, "IN",
                                                 dns.rdatatype.to_text(rr.rdtype), ip)
        return
    if mode == "outside_zone":
        evil = dns.name.from_text(_HOSTILE_OUTSIDE)
        if rdtype == dns.rdatatype.SRV:
            answer.append(dns.rrset.from_text(qname, ttl, "IN", "SRV", f"0 0 50000 {evil}"))
        answer.append(dns.rrset.from_text(evil, ttl, "IN", "A", _HOSTILE_OUTSIDE_V4))
        additional.append(dns.rrset.from_text(evil, ttl, "IN", "A", _HOSTILE_OUTSIDE_V4))
        return
    if mode == "out_of_range" and rdtype == dns.rdatatype.SRV and answer:
        first = next(iter(answer[0]))
        target: dns.name.Name = first.target
        label = target.labels[0].decode()
        base = label.rsplit("-", 1)[0] if "-" in label else label
        bad = dns.name.Name((f"{base}-999".encode(),)).concatenate(target.parent())
        answer[0].add(dns.rdata.from_text(dns.rdataclass.IN, dns.rdatatype.SRV,
                                          f"0 1 {first.port} {bad}"))
        additional.append(dns.rrset.from_text(bad, ttl, "IN", "A", "10.255.255.99"))


def answer_query(
    table: _Table, query: dns.message.Message, faults: Faults | None = None
) -> dns.message.Message | None:
    """Pure: the response CoreDNS would give (or None to drop the query)."""
    faults = faults or Faults()
    response = dns.message.make_response(query, our_payload=OUR_EDNS_PAYLOAD)
    response.flags |= dns.flags.AA
    response.flags &= ~dns.flags.RA
    if query.opcode() != dns.opcode.QUERY or len(query.question) != 1:
        response.set_rcode(dns.rcode.NOTIMP if query.opcode() != dns.opcode.QUERY
                           else dns.rcode.FORMERR)
        return response
    q = query.question[0]
    qname, rdtype = q.name, q.rdtype
    if faults.applies(qname):
        if faults.mode == "timeout":
            return None
        if faults.mode == "servfail":
            response.set_rcode(dns.rcode.SERVFAIL)
            return response
        if faults.mode == "refused":
            response.set_rcode(dns.rcode.REFUSED)
            return response
    if q.rdclass != dns.rdataclass.IN or not qname.is_subdomain(table.origin):
        response.flags &= ~dns.flags.AA
        response.set_rcode(dns.rcode.REFUSED)
        return response
    answer: list[dns.rrset.RRset] = []
    additional: list[dns.rrset.RRset] = []
    types = [rdtype] if rdtype != dns.rdatatype.ANY else [
        dns.rdatatype.A, dns.rdatatype.AAAA, dns.rdatatype.SRV]
    if qname == table.origin and rdtype in (dns.rdatatype.SOA, dns.rdatatype.ANY):
        answer.append(_soa(table))
    for t in types:
        rds = table.records.get((qname, t))
        if rds:
            rrset = dns.rrset.RRset(qname, dns.rdataclass.IN, t)
            rrset.update_ttl(table.ttl)
            for rd in rds:
                rrset.add(rd)
            answer.append(rrset)
            if t == dns.rdatatype.SRV:
                for rd in rds:
                    tgt = rd.target  # type: ignore[attr-defined]
                    for at in (dns.rdatatype.A, dns.rdatatype.AAAA):
                        ards = table.records.get((tgt, at))
                        if ards:
                            ars = dns.rrset.RRset(tgt, dns.rdataclass.IN, at)
                            ars.update_ttl(table.ttl)
                            for ard in ards:
                                ars.add(ard)
                            additional.append(ars)
    if answer and faults.applies(qname) and faults.mode in FAIL_MODES:
        _hostile(table, str(faults.mode), qname, rdtype, answer, additional)
    if answer:
        response.answer.extend(answer)
        response.additional.extend(additional)
    else:
        if qname not in table.names:
            response.set_rcode(dns.rcode.NXDOMAIN)
        response.authority.append(_soa(table))
    return response


def _garbage(query_wire: bytes) -> bytes:
    """A reply with the right id that no parser accepts: it claims records it lacks."""
    qid = query_wire[:2] if len(query_wire) >= 2 else b"\0\0"
    return qid + struct.pack("!HHHHH", 0x8180, 1, 7, 0, 0) + b"\x07garbage"


def _udp_limit(query: dns.message.Message) -> int:
    if query.edns >= 0:
        return max(UDP_DEFAULT_LIMIT, query.payload)
    return UDP_DEFAULT_LIMIT


def _truncated(query: dns.message.Message) -> bytes:
    r = dns.message.make_response(query, our_payload=OUR_EDNS_PAYLOAD)
    r.flags |= dns.flags.AA | dns.flags.TC
    r.flags &= ~dns.flags.RA
    return r.to_wire()


# --------------------------------------------------------------------------- server


class DnsServer:
    """UDP+TCP listener on one address and port, answering from a :class:`ClusterDnsModel`.

    Use ``async with DnsServer(model) as srv:`` inside a running loop, or
    :class:`ThreadedDnsServer` from synchronous code. ``port=0`` picks a free port that is
    free for both UDP and TCP.
    """

    def __init__(
        self,
        model: ClusterDnsModel,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        netns: str | None = None,
    ) -> None:
        self.model = model
        self.host = host
        self.port = port
        self.netns = netns
        self.faults = Faults()
        #: seconds to hold every answer (a slow or overloaded server); 0 = answer at once
        self.delay = 0.0
        self._counts: collections.Counter[tuple[str, str]] = collections.Counter()
        self._transports: collections.Counter[str] = collections.Counter()
        self._count_lock = threading.Lock()
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.base_events.Server | None = None
        self._tcp_tasks: set[asyncio.Task[None]] = set()

    # ---- fault injection and counters
    @property
    def fail_mode(self) -> str | None:
        return self.faults.mode

    @fail_mode.setter
    def fail_mode(self, mode: str | None) -> None:
        self.set_fail_mode(mode)

    def set_fail_mode(self, mode: str | None, names: Iterable[str] | None = None) -> None:
        """Inject a fault for every name, or only for ``names`` (absolute or relative text)."""
        if mode is not None and mode not in FAIL_MODES:
            raise BadFailModeError(f"fail_mode {mode!r} is not one of {FAIL_MODES}")
        self.faults = Faults(mode, None if names is None else frozenset(_key(n) for n in names))

    def query_count(self, name: str, rdtype: str | None = None) -> int:
        """How many queries for ``name`` (of type ``rdtype``, e.g. "SRV") have arrived."""
        k = _key(name)
        with self._count_lock:
            if rdtype is not None:
                return self._counts[(k, rdtype.upper())]
            return sum(v for (n, _), v in self._counts.items() if n == k)

    def total_queries(self) -> int:
        with self._count_lock:
            return sum(self._counts.values())

    def query_counts(self) -> dict[str, int]:
        """Snapshot: canonical name -> number of queries (all types)."""
        out: dict[str, int] = collections.Counter()
        with self._count_lock:
            for (n, _), v in self._counts.items():
                out[n] += v
        return dict(out)

    def transport_count(self, transport: str) -> int:
        """Queries seen over ``"udp"`` or ``"tcp"``."""
        with self._count_lock:
            return self._transports[transport]

    def reset_counts(self) -> None:
        with self._count_lock:
            self._counts.clear()
            self._transports.clear()

    @property
    def address(self) -> str:
        """``IP:PORT`` (``[IP]:PORT`` for IPv6), the guest agent's ``nameservers`` syntax."""
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    # ---- handling
    def _handle(self, wire: bytes, transport: str) -> bytes | None:
        try:
            query = dns.message.from_wire(wire)
        except Exception as e:  # a malformed query must never stop the server
            log.info("dropping malformed query: %s", e)
            return None
        if query.question:
            q = query.question[0]
            with self._count_lock:
                self._counts[(_key(q.name), dns.rdatatype.to_text(q.rdtype))] += 1
                self._transports[transport] += 1
            if self.faults.applies(q.name) and self.faults.mode == "garbage":
                return _garbage(wire)
        try:
            response = answer_query(self.model.table, query, self.faults)
        except Exception:
            log.exception("answering failed; sending SERVFAIL")
            response = dns.message.make_response(query)
            response.set_rcode(dns.rcode.SERVFAIL)
        if response is None:
            return None
        out = response.to_wire()
        if transport == "udp" and len(out) > _udp_limit(query):
            return _truncated(query)
        return out

    # ---- lifecycle
    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        with _maybe_netns(self.netns):
            family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
            for _attempt in range(20):
                udp_sock = socket.socket(family, socket.SOCK_DGRAM)
                tcp_sock = socket.socket(family, socket.SOCK_STREAM)
                try:
                    udp_sock.bind((self.host, self.port))
                    port = udp_sock.getsockname()[1]
                    tcp_sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                    tcp_sock.bind((self.host, port))
                except OSError:
                    udp_sock.close()
                    tcp_sock.close()
                    if self.port:
                        raise
                    continue
                break
            else:
                raise DnsStandinError(f"no port free for both UDP and TCP on {self.host}")
        self.port = port
        server = self

        class _Udp(asyncio.DatagramProtocol):
            def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
                out = server._handle(data, "udp")
                if out is None:
                    return
                if server.delay > 0:
                    loop.call_later(server.delay, server._send_udp, out, addr)
                else:
                    server._send_udp(out, addr)

        transport, _ = await loop.create_datagram_endpoint(_Udp, sock=udp_sock)
        self._udp = transport
        self._tcp = await asyncio.start_server(self._serve_tcp, sock=tcp_sock)
        log.info("DNS stand-in for zone %s on %s (udp+tcp)", self.model.zone, self.address)

    def _send_udp(self, out: bytes, addr: tuple[str, int]) -> None:
        if self._udp is not None:
            self._udp.sendto(out, addr)

    async def _serve_tcp(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._tcp_tasks.add(task)
        try:
            while True:
                hdr = await reader.readexactly(2)
                (length,) = struct.unpack("!H", hdr)
                wire = await reader.readexactly(length)
                out = self._handle(wire, "tcp")
                if self.delay > 0:
                    await asyncio.sleep(self.delay)
                if out is None:
                    continue
                writer.write(struct.pack("!H", len(out)) + out)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()
            if task is not None:
                self._tcp_tasks.discard(task)

    async def stop(self) -> None:
        if self._udp is not None:
            self._udp.close()
            self._udp = None
        if self._tcp is not None:
            self._tcp.close()
            for t in list(self._tcp_tasks):
                t.cancel()
            with contextlib.suppress(Exception):
                await asyncio.gather(*self._tcp_tasks, return_exceptions=True)
            await self._tcp.wait_closed()
            self._tcp = None

    async def __aenter__(self) -> DnsServer:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()


@contextlib.contextmanager
def _maybe_netns(name: str | None) -> Iterator[None]:
    if name is None:
        yield
        return
    from tests.sandbox.netns import in_netns  # type: ignore[import-not-found,unused-ignore]

    with in_netns(name):
        yield


class ThreadedDnsServer:
    """A :class:`DnsServer` on its own event loop in a daemon thread, for synchronous callers.

    ``with ThreadedDnsServer(model) as srv: ...``; ``srv.server`` is the :class:`DnsServer`
    (fault injection and counters are thread-safe).
    """

    def __init__(self, model: ClusterDnsModel, host: str = "127.0.0.1", port: int = 0,
                 *, netns: str | None = None) -> None:
        self.server = DnsServer(model, host, port, netns=netns)
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="dns-standin",
                                        daemon=True)

    def start(self) -> ThreadedDnsServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self._loop).result(10)
        return self

    def stop(self) -> None:
        if not self._thread.is_alive():
            return
        asyncio.run_coroutine_threadsafe(self.server.stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def address(self) -> str:
        return self.server.address

    def __enter__(self) -> ThreadedDnsServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- kubernetes feeder


async def follow_kubernetes(
    model: ClusterDnsModel,
    client: AsyncClient,
    *,
    namespace: str | None = None,
    backoff: Callable[[int], float] = lambda n: min(0.2 * 2**n, 5.0),
    synced: asyncio.Event | None = None,
) -> None:
    """Keep ``model`` equal to the API's EndpointSlices and Services, as CoreDNS does.

    List, then watch from the list's resourceVersion; on any error (410 included) back off
    and relist. Runs until cancelled. ``synced`` is set once both first lists are in.
    ``namespace=None`` watches all namespaces.
    """
    from lightkube.resources.core_v1 import Service
    from lightkube.resources.discovery_v1 import EndpointSlice

    got = {"slices": asyncio.Event(), "services": asyncio.Event()}

    async def follow(res: Any, kind: str) -> None:
        failures = 0
        ns_arg = namespace if namespace is not None else "*"
        while True:
            try:
                listing = client.list(res, namespace=ns_arg)
                items = [o.to_dict() async for o in listing]
                if kind == "slices":
                    model.set_endpoint_slices(items)
                else:
                    model.set_services(items)
                got[kind].set()
                if synced is not None and all(e.is_set() for e in got.values()):
                    synced.set()
                failures = 0
                async for etype, obj in client.watch(
                    res, namespace=ns_arg, resource_version=listing.resourceVersion
                ):
                    d = obj.to_dict()
                    meta = d.get("metadata") or {}
                    if kind == "slices":
                        if etype == "DELETED":
                            model.delete_endpoint_slice(meta.get("namespace", ""),
                                                        meta.get("name", ""))
                        else:
                            model.upsert_endpoint_slice(d)
                    elif etype == "DELETED":
                        model.delete_service(meta.get("namespace", ""), meta.get("name", ""))
                    else:
                        model.upsert_service(d)
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("following %s failed (%s); relisting", kind, e)
                await asyncio.sleep(backoff(failures))
                failures += 1

    async with asyncio.TaskGroup() as tg:
        tg.create_task(follow(EndpointSlice, "slices"))
        tg.create_task(follow(Service, "services"))


# --------------------------------------------------------------------------- CLI


def _load_list(path: Path) -> list[JsonDict]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise SliceFileError(f"{path}: cannot read JSON: {e}") from e
    if isinstance(data, dict) and isinstance(data.get("items"), list):
        data = data["items"]
    if not isinstance(data, list) or not all(isinstance(x, dict) for x in data):
        raise SliceFileError(f"{path}: expected a JSON list of objects (or {{'items': [...]}})")
    return data


def _parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise argparse.ArgumentTypeError(f"--listen {text!r}: expected HOST:PORT")
    return host.strip("[]"), int(port)


async def _amain(args: argparse.Namespace) -> int:
    model = ClusterDnsModel(args.zone, args.ttl)
    stop = asyncio.Event()
    reload_now = asyncio.Event()

    def load() -> None:
        try:
            if args.slices:
                model.set_endpoint_slices(_load_list(args.slices))
            if args.services:
                model.set_services(_load_list(args.services))
        except SliceFileError as e:
            log.error("%s (keeping the previous data)", e)

    load()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    loop.add_signal_handler(signal.SIGINT, stop.set)
    loop.add_signal_handler(signal.SIGHUP, reload_now.set)
    server = DnsServer(model, args.listen[0], args.listen[1])
    if args.fail_mode:
        server.set_fail_mode(args.fail_mode)
    await server.start()
    print(f"listening {server.address}", flush=True)

    def mtimes() -> tuple[float, ...]:
        out = []
        for p in (args.slices, args.services):
            try:
                out.append(p.stat().st_mtime_ns if p else 0)
            except OSError:
                out.append(-1)
        return tuple(out)

    async def watch_files() -> None:
        seen = mtimes()
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(reload_now.wait(), 0.2)
            now = mtimes()
            if reload_now.is_set() or now != seen:
                reload_now.clear()
                seen = now
                load()

    try:
        async with asyncio.TaskGroup() as tg:
            watcher = tg.create_task(watch_files())
            feeder = None
            if args.kubeconfig:
                from lightkube import AsyncClient, KubeConfig

                client = AsyncClient(KubeConfig.from_file(args.kubeconfig))
                feeder = tg.create_task(follow_kubernetes(model, client))
            await stop.wait()
            watcher.cancel()
            if feeder is not None:
                feeder.cancel()
    finally:
        await server.stop()
    return 0


def configure(p: argparse.ArgumentParser) -> None:
    """The CLI's options (also usable by the ``python -m tests.sandbox`` dispatcher)."""
    p.add_argument("--listen", type=_parse_listen, default=("127.0.0.1", 5353),
                   help="HOST:PORT for UDP and TCP (port 0: pick one; printed on stdout)")
    p.add_argument("--zone", default="cluster.local")
    p.add_argument("--ttl", type=int, default=DEFAULT_TTL)
    p.add_argument("--slices", type=Path, help="JSON list of EndpointSlices (re-read on change)")
    p.add_argument("--services", type=Path, help="JSON list of Services (optional)")
    p.add_argument("--kubeconfig", help="follow EndpointSlices/Services of this API server")
    p.add_argument("--fail-mode", choices=FAIL_MODES)
    p.add_argument("-v", "--verbose", action="store_true")


def main(argv: Sequence[str] | argparse.Namespace | None = None) -> int:
    """Run the server; ``argv`` may also be already parsed options (see :func:`configure`)."""
    if isinstance(argv, argparse.Namespace):
        args = argv
    else:
        p = argparse.ArgumentParser(prog="python -m tests.sandbox.dns_server",
                                    description="CoreDNS-like DNS stand-in for headless Services")
        configure(p)
        args = p.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s dns-standin %(levelname)s %(message)s")
    try:
        return asyncio.run(_amain(args))
    except (DnsStandinError, OSError) as e:
        print(f"dns_server: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
