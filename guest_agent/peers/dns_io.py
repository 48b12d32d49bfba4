"""Asking cluster DNS about our ensemble: one :meth:`DnsClient.observe` call is one pass.

What an answer means, and what we believe after many, is :mod:`guest_agent.peers.dns`
(pure); this module only queries. :class:`DnsClient` asks the configured nameservers
(``IP`` or ``IP:PORT``, else ``/etc/resolv.conf``), each query bounded by
``dns_timeout``, over UDP with a TCP retry when the answer is truncated. One pass asks
the SRV record ``_imex._tcp.<service>.<ns>.svc.<zone>`` (targets are slot names,
addresses from the additional section, A/AAAA follow-ups for targets without one); when
the SRV query is not a usable answer (error, NXDOMAIN, NODATA) it asks every slot's A
(then AAAA) instead, and every ``crosscheck_every`` passes it asks the SRV-listed slots'
A/AAAA too and logs disagreements (SRV wins).

Every query is independent and idempotent; concurrency is a TaskGroup inside one pass,
and a pass is never run twice at once by the discovery loop.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Sequence
from pathlib import Path

import dns.asyncquery
import dns.exception
import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdatatype

from guest_agent.config import Nameserver, Settings
from guest_agent.peers.dns import (
    DnsObservation,
    SlotVerdict,
    Warn,
    best_address,
    interpret_address,
    interpret_srv,
    parse_resolv_conf,
)
from imex_shared.model import EnsembleId

log = logging.getLogger("guest_agent.dnsquery")  # logger name pinned

RESOLV_CONF = "/etc/resolv.conf"


def nameservers_from_resolv_conf(path: str | Path = RESOLV_CONF) -> tuple[Nameserver, ...]:
    """The nameservers of resolv.conf (:func:`parse_resolv_conf`); 127.0.0.1 when it
    cannot be read, as libc."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as exc:
        log.warning("cannot read %s (%s); using 127.0.0.1", path, exc.strerror)
        return (Nameserver("127.0.0.1"),)
    return parse_resolv_conf(text, path)


class _OnceLogger:
    """One WARNING per distinct message, later repeats at DEBUG (answers repeat every poll)."""

    def __init__(self, limit: int = 1024) -> None:
        self._seen: set[str] = set()
        self._limit = limit

    def __call__(self, message: str) -> None:
        if message in self._seen:
            log.debug("%s", message)
            return
        if len(self._seen) < self._limit:
            self._seen.add(message)
        log.warning("%s", message)


class DnsClient:
    """Asks cluster DNS about our ensemble; one :meth:`observe` call is one pass."""

    def __init__(
        self,
        settings: Settings,
        ens: EnsembleId,
        *,
        crosscheck_every: int = 5,
        resolv_conf: str = RESOLV_CONF,
    ) -> None:
        self.settings = settings
        self.ens = ens
        self.zone = settings.cluster_domain
        self.resolv_conf = resolv_conf
        self._resolv_cache: tuple[tuple[int, int] | None, tuple[Nameserver, ...]] | None = None
        self.crosscheck_every = crosscheck_every
        self.warn: Warn = _OnceLogger()
        self._passes = 0
        #: transport bookkeeping, for status and tests
        self.tcp_fallbacks = 0
        self.queries = 0
        self.failures = 0

    @property
    def nameservers(self) -> tuple[Nameserver, ...]:
        """The configured nameservers, else resolv.conf's, re-read when the file changes
        (DHCP or NetworkManager may rewrite it while the agent runs)."""
        if self.settings.nameservers:
            return self.settings.nameservers
        stamp: tuple[int, int] | None
        try:
            st = os.stat(self.resolv_conf)
            stamp = (st.st_mtime_ns, st.st_ino)
        except OSError:
            stamp = None
        if self._resolv_cache is None or self._resolv_cache[0] != stamp:
            self._resolv_cache = (stamp, nameservers_from_resolv_conf(self.resolv_conf))
        return self._resolv_cache[1]

    async def query(
        self, qname: dns.name.Name, rdtype: dns.rdatatype.RdataType
    ) -> dns.message.Message | None:
        """Ask each nameserver in turn; the first NOERROR/NXDOMAIN response wins.

        None when every nameserver failed (timeout, SERVFAIL, REFUSED, garbage, socket
        error): the caller treats that as unknown.
        """
        for ns in self.nameservers:  # one snapshot per query
            request = dns.message.make_query(qname, rdtype)
            request.flags |= dns.flags.RD
            self.queries += 1
            try:
                response, used_tcp = await dns.asyncquery.udp_with_fallback(
                    request, ns.ip, timeout=self.settings.dns_timeout, port=ns.port
                )
            except dns.exception.Timeout:
                self.failures += 1
                log.debug("DNS %s %s @%s: timeout", qname, rdtype.name, ns)
                continue
            except (dns.exception.DNSException, OSError, ValueError, EOFError) as exc:
                self.failures += 1
                self.warn(f"DNS {qname} {rdtype.name} @{ns}: bad or no answer: {exc!r}")
                continue
            if used_tcp:
                self.tcp_fallbacks += 1
            rcode = response.rcode()
            if rcode in (dns.rcode.NOERROR, dns.rcode.NXDOMAIN):
                return response
            self.failures += 1
            log.info("DNS %s %s @%s: %s", qname, rdtype.name, ns, dns.rcode.to_text(rcode))
        return None

    async def slot_verdict(self, index: int) -> tuple[SlotVerdict, str | None]:
        """A, then AAAA when A has no data, of one slot's name."""
        qname = dns.name.from_text(self.ens.slot_fqdn(index, self.zone))
        verdict, ip = interpret_address(
            await self.query(qname, dns.rdatatype.A), qname, dns.rdatatype.A, self.warn
        )
        if verdict != "nodata":
            return verdict, ip
        verdict, ip = interpret_address(
            await self.query(qname, dns.rdatatype.AAAA), qname, dns.rdatatype.AAAA, self.warn
        )
        if verdict == "nodata":
            self.warn(f"DNS: {qname} exists but has no address: slot {index} unknown")
            return "unknown", None
        return verdict, ip

    async def _slots(self, indices: Sequence[int]) -> dict[int, tuple[SlotVerdict, str | None]]:
        async with asyncio.TaskGroup() as tg:
            tasks = {i: tg.create_task(self.slot_verdict(i)) for i in indices}
        return {i: t.result() for i, t in tasks.items()}

    async def observe(self) -> DnsObservation:
        """One pass (see the module docstring)."""
        self._passes += 1
        size = self.settings.max_members
        srv_name = dns.name.from_text(self.ens.srv_name(self.zone))
        srv = interpret_srv(
            await self.query(srv_name, dns.rdatatype.SRV), self.ens, self.zone, size, self.warn
        )
        if srv.kind == "records":
            present = {i: a for i, addrs in srv.addresses.items() if (a := best_address(addrs))}
            follow = [i for i in sorted(srv.named) if i not in present]
            cross = (
                sorted(present)
                if self.crosscheck_every and self._passes % self.crosscheck_every == 0
                else []
            )
            verdicts = await self._slots(follow + cross)
            for i in follow:
                verdict, ip = verdicts[i]
                if verdict == "present" and ip is not None:
                    present[i] = ip
                # else: SRV lists it, its address is unknown: neither present nor absent
            for i in cross:
                verdict, ip = verdicts[i]
                if verdict == "present" and ip != present[i]:
                    self.warn(
                        f"DNS cross-check: slot {i} is {present[i]} by SRV but {ip} by its own "
                        "name; using the SRV answer"
                    )
                elif verdict == "absent":
                    self.warn(
                        f"DNS cross-check: slot {i} is listed by SRV but its name is NXDOMAIN"
                    )
            absent = frozenset(range(size)) - srv.named
            return DnsObservation(present, absent, "srv")
        # SRV not usable (error, NXDOMAIN, NODATA): ask every slot by name.
        verdicts = await self._slots(range(size))
        present = {i: ip for i, (v, ip) in verdicts.items() if v == "present" and ip}
        absent = frozenset(i for i, (v, _) in verdicts.items() if v == "absent")
        if srv.kind != "error" and present:
            self.warn(
                f"DNS: SRV {srv_name} says {srv.kind} but slot names answer "
                f"({sorted(present)}): is the Service port named 'imex'?"
            )
        learned = bool(present) or bool(absent)
        return DnsObservation(present, absent, "slots" if learned else "none")
