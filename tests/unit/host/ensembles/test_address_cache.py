"""The memoized address verdicts (a benchmark-driven speed-up, issue 7) decide exactly
as the shared model does, keep pick_address's refusal lines, and stay bounded."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_agent.ensembles.members import classify_address, pick_address, vmi_addresses
from host_agent.ensembles.slices import _family
from imex_shared.model import ModelError, ipv4_octets, parse_ip, unusable_reason


def reference(raw: str) -> tuple[str | None, str | None, bool]:
    try:
        addr = parse_ip(raw)
    except ModelError as exc:
        return None, str(exc), False
    reason = unusable_reason(addr)
    return (str(addr), None, True) if reason is None else (None, reason, True)


@pytest.mark.parametrize("raw", [
    "10.244.0.23", "10.244.0.23/24", " 10.1.2.3 ", "10.0.2.2", "10.0.2.2/24", "127.0.0.1",
    "169.254.1.1", "0.0.0.0", "224.0.0.1", "fd10:0:2::2", "fe80::1", "::1", "::ffff:10.1.2.3",
    "2001:DB8::1", "2001:db8::1%eth0", "", "garbage", "10.1.2", "10.1.2.300",
    # the edges of classify_address's dotted-quad fast path (issue 27)
    "010.1.2.3", "1.2.3.04", "0.1.2.3", "126.255.255.255", "128.0.0.0", "169.253.255.255",
    "169.255.0.1", "223.255.255.255", "240.0.0.1", "255.255.255.255", "10.0.2.3",
    "10.0.2.2.", ".10.0.2.2", "1.2.3.4.5", "\u0661.\u0662.\u0663.\u0664", "1.2.3.+4",
])
def test_verdict_matches_the_shared_model(raw: str) -> None:
    assert classify_address(raw) == reference(raw)
    assert classify_address(raw) == reference(raw)  # and again, from the cache


@settings(deadline=None)  # a loaded CI core must not turn a slow example into a failure
@given(st.one_of(st.ip_addresses().map(str), st.text(max_size=40)))
def test_verdict_matches_for_any_text(raw: str) -> None:
    assert classify_address(raw) == reference(raw)


def test_pick_address_keeps_one_line_per_unusable_address_and_every_garbage_line() -> None:
    ip, refused = pick_address({"ipAddress": "10.0.2.2",
                                "ipAddresses": ["10.0.2.2/24", "x", "x", "fe80::1"]})
    assert ip is None
    assert refused == [reference("10.0.2.2")[1], reference("x")[1], reference("x")[1],
                       reference("fe80::1")[1]]
    assert pick_address({"ipAddresses": ["10.0.2.2", "10.9.8.7/16"]}) == (
        "10.9.8.7", [reference("10.0.2.2")[1]])


def test_vmi_addresses_uses_the_same_verdicts() -> None:
    vmi = {"status": {"interfaces": [
        {"ipAddress": "10.0.2.2", "ipAddresses": ["10.0.2.2", "10.5.0.1/24"]},
        {"ipAddresses": ["2001:DB8::7", "fe80::2", 7]}]}}
    assert vmi_addresses(vmi) == frozenset({"10.5.0.1", "2001:db8::7"})


def test_caches_are_bounded() -> None:
    assert classify_address.cache_info().maxsize == 8192


_OCTET = st.one_of(st.integers(0, 255).map(str), st.integers(0, 999).map(str),
                   st.integers(0, 99).map(lambda n: f"0{n}"), st.sampled_from(["", "+1", " 1"]))


@settings(deadline=None)
@given(st.tuples(st.sampled_from(["10", "127", "169", "0", "224", "223", "240"]), _OCTET,
                 _OCTET, _OCTET).map(".".join))
def test_verdict_matches_for_dotted_quads_near_every_rule(raw: str) -> None:
    assert classify_address.__wrapped__(raw) == reference(raw)


@settings(deadline=None)
@given(st.tuples(_OCTET, _OCTET, _OCTET, _OCTET).map(".".join))
def test_ipv4_octets_reads_exactly_what_ipaddress_reads_as_canonical(raw: str) -> None:
    try:
        canonical = str(ipaddress.IPv4Address(raw)) == raw
    except ValueError:
        canonical = False
    octets = ipv4_octets(raw)
    assert (octets is not None) == canonical
    if octets is not None:
        assert ".".join(map(str, octets)) == raw


@settings(deadline=None)
@given(st.ip_addresses())
def test_family(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert _family(str(addr)) == ("IPv6" if addr.version == 6 else "IPv4")
