"""DNS answers from an in-process server returning generated messages (issue 30): wrong
ids, truncation (UDP then TCP), compression loops, records of every type (and raw rdata
of any type code), names outside the zone, every rcode, bit flips and garbage.

Properties: one discovery pass (``DnsClient.observe``) never raises and ends in bounded
time; what it learns is sound (slots inside the ensemble, usable addresses, no slot both
present and absent); every warning it logs names DNS and the query.
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rdata
import dns.rdataclass
import dns.rdatatype
import dns.rrset
from hypothesis import example, given
from hypothesis import strategies as st

from guest_agent.config import Nameserver, Settings
from guest_agent.peers.dns_io import DnsClient
from imex_shared.model import EnsembleId, unusable_reason
from tests.fuzz.budget import count, fuzz
from tests.sandbox.fuzz_dns import FuzzDnsServer

ENS = EnsembleId("gpu", "gb200")
SIZE = 3
ZONE = "cluster.local"

_names = [ENS.slot_fqdn(i, ZONE) + "." for i in range(SIZE + 2)] + [
    ENS.srv_name(ZONE) + ".", "evil.example.", f"{ENS.slot(0)}.other.gpu.svc.{ZONE}.",
    f"x.{ENS.slot_fqdn(1, ZONE)}.", ".", "query"]  # "query": the question's own name
_texts = {
    "A": ["10.0.0.5", "10.0.0.6", "127.0.0.1", "169.254.1.1", "0.0.0.0", "224.0.0.1"],
    "AAAA": ["fd00::5", "::1", "fe80::1", "::ffff:10.0.0.7", "::"],
    "SRV": [f"0 0 50000 {n}" for n in _names[:6]] + ["0 0 0 .", "65535 65535 65535 a."],
    "CNAME": [_names[0], "evil.example.", "query"], "TXT": ['"x"', '"" "y"'],
    "MX": ["10 evil.example."], "NS": ["ns.evil.example."], "PTR": ["evil.example."],
    "SOA": [f"ns.{ZONE}. h.{ZONE}. 1 2 3 4 5"], "CAA": ['0 issue "x"'],
    "SVCB": ['1 . alpn="h2"'], "HINFO": ['"a" "b"'],
}
_record = st.one_of(
    st.tuples(st.sampled_from(_names), st.sampled_from(sorted(_texts)), st.data()).map(
        lambda t: (t[0], t[1], t[2].draw(st.sampled_from(_texts[t[1]])))),
    st.tuples(st.sampled_from(_names), st.integers(1, 65535), st.binary(max_size=24)),
)


@dataclass(frozen=True)
class Recipe:
    """How to answer one query."""

    kind: str  # message, mutate, loop, raw, drop
    rcode: int = 0
    id_delta: int = 0
    tc: bool = False
    answers: tuple[tuple[str, object, object], ...] = ()
    additional: tuple[tuple[str, object, object], ...] = ()
    flips: tuple[int, ...] = ()
    raw: bytes = b""


_recipe = st.one_of(
    st.builds(Recipe, st.just("message"),
              st.sampled_from([0, 0, 0, 3, 2, 5, 1, 4, 9]),
              st.sampled_from([0, 0, 0, 0, 1, 0xFFFF]), st.booleans(),
              st.lists(_record, max_size=5).map(tuple),
              st.lists(_record, max_size=4).map(tuple)),
    st.builds(Recipe, st.just("mutate"), answers=st.lists(_record, max_size=3).map(tuple),
              flips=st.lists(st.integers(0, 4000), min_size=1, max_size=6).map(tuple)),
    st.builds(Recipe, st.sampled_from(["loop", "drop"])),
    st.builds(Recipe, st.just("raw"), raw=st.binary(max_size=80)),
)


def _rrset(qname: dns.name.Name, rec: tuple[str, object, object]) -> dns.rrset.RRset:
    owner_text, rtype, data = rec
    owner = qname if owner_text == "query" else dns.name.from_text(str(owner_text))
    if isinstance(rtype, int):
        assert isinstance(data, bytes)
        rdtype = dns.rdatatype.RdataType.make(rtype)
        rdata: dns.rdata.Rdata = dns.rdata.GenericRdata(dns.rdataclass.IN, rdtype, data)
    else:
        rdtype = dns.rdatatype.from_text(str(rtype))
        text = qname.to_text() if data == "query" else str(data)
        rdata = dns.rdata.from_text(dns.rdataclass.IN, rdtype, text)
    rrset = dns.rrset.RRset(owner, dns.rdataclass.IN, rdtype)
    rrset.add(rdata, 5)
    return rrset


def build(recipe: Recipe, wire: bytes, how: str) -> bytes | None:
    query = dns.message.from_wire(wire)
    if recipe.kind == "drop":
        return None
    if recipe.kind == "raw":
        return recipe.raw
    if recipe.kind == "loop":  # an answer whose owner name points at itself
        head = bytearray(wire[:12])
        head[2] |= 0x80
        head[6:8] = b"\x00\x01"
        body = wire[12:]
        here = len(head) + len(body)
        return bytes(head) + body + bytes([0xC0 | (here >> 8), here & 0xFF]) \
            + b"\x00\x01\x00\x01\x00\x00\x00\x05\x00\x04\x0a\x00\x00\x05"
    reply = dns.message.make_response(query)
    reply.set_rcode(dns.rcode.Rcode.make(recipe.rcode))
    qname = query.question[0].name
    for rec in recipe.answers:
        reply.answer.append(_rrset(qname, rec))
    for rec in recipe.additional:
        reply.additional.append(_rrset(qname, rec))
    if recipe.tc and how == "udp":
        reply.flags |= dns.flags.TC
    reply.id = (reply.id + recipe.id_delta) & 0xFFFF
    out = bytearray(reply.to_wire())
    for bit in recipe.flips:
        if bit // 8 < len(out):
            out[bit // 8] ^= 1 << (bit % 8)
    return bytes(out)


def _pass(recipes: list[Recipe]) -> tuple[object, list[str], int]:
    async def run() -> tuple[object, list[str], int]:
        asked = 0

        def answer(wire: bytes, how: str) -> bytes | None:
            nonlocal asked
            asked += 1
            return build(recipes[(asked - 1) % len(recipes)], wire, how)

        server = FuzzDnsServer(answer)
        async with server as port:
            settings = Settings(ensemble=ENS.name, namespace=ENS.namespace, max_members=SIZE,
                                nameservers=(Nameserver("127.0.0.1", port),), dns_timeout=0.1)
            client = DnsClient(settings, ENS, crosscheck_every=1)
            warnings: list[str] = []
            client.warn = warnings.append
            obs = await asyncio.wait_for(client.observe(), 30)
        return obs, warnings, server.queries

    return asyncio.run(run())


GOOD_SRV = Recipe("message", answers=tuple(
    (ENS.srv_name(ZONE) + ".", "SRV", f"0 0 50000 {ENS.slot_fqdn(i, ZONE)}.")
    for i in range(2)))


@fuzz
@given(st.lists(_recipe, min_size=1, max_size=6))
@example([Recipe("loop")])
@example([Recipe("message", tc=True), GOOD_SRV])
@example([Recipe("message", id_delta=1), Recipe("message", rcode=3)])
@example([GOOD_SRV, Recipe("message", answers=(("query", "A", "10.0.0.5"),
                                               ("query", "A", "10.0.0.6")))])
def test_any_dns_answer_gives_a_sound_observation(recipes: list[Recipe]) -> None:
    count("dns_answers")
    obs, warnings, queries = _pass(recipes)
    assert queries >= 1
    present, absent = obs.present, obs.absent  # type: ignore[attr-defined]
    assert not set(present) & set(absent)
    for index, ip in present.items():
        assert 0 <= index < SIZE
        assert unusable_reason(ipaddress.ip_address(ip)) is None, ip
    assert all(index in range(SIZE) for index in absent)
    for text in warnings:
        assert text.startswith("DNS"), text
