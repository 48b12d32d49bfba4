"""The memoized address verdicts (a benchmark-driven speed-up, issue 7) decide exactly
as the shared model does, keep pick_address's refusal lines, and stay bounded."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from host_agent.ensembles.members import classify_address, pick_address, vmi_addresses
from host_agent.ensembles.slices import _family
from imex_shared.model import ModelError, parse_ip, unusable_reason


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
    assert _family.cache_info().maxsize == 8192


@settings(deadline=None)
@given(st.ip_addresses())
def test_family(addr: ipaddress.IPv4Address | ipaddress.IPv6Address) -> None:
    assert _family(str(addr)) == ("IPv6" if addr.version == 6 else "IPv4")
