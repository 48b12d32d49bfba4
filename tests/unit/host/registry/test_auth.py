"""The registry's pure request checks: caller address behind proxies, bearer token, body schema."""

from __future__ import annotations

import hashlib
import ipaddress

import pytest
from pydantic import ValidationError

from host_agent.registry.auth import RegistryError, caller_address, check_token
from host_agent.registry.models import StatusReport
from host_agent.state.snapshot import EnsembleSpec
from imex_shared.model import EnsembleId

PROXIES = (ipaddress.ip_network("10.96.0.0/12"), ipaddress.ip_network("fd00:96::/64"))


def addr(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def test_direct_peer_is_the_caller_and_forwarded_for_is_ignored() -> None:
    assert caller_address("10.1.2.3", ["10.9.9.9"], PROXIES) == addr("10.1.2.3")
    assert caller_address("10.1.2.3", ["10.9.9.9"], ()) == addr("10.1.2.3")


def test_trusted_proxy_names_the_caller() -> None:
    assert caller_address("10.96.0.5", ["10.1.2.3"], PROXIES) == addr("10.1.2.3")
    # the rightmost hop that is not one of our proxies; what the client wrote is ignored
    chain = ["10.66.6.6, 10.1.2.3", "10.96.1.1"]
    assert caller_address("10.96.0.5", chain, PROXIES) == addr("10.1.2.3")
    # all hops trusted: the leftmost one
    assert caller_address("10.96.0.5", ["10.96.0.7"], PROXIES) == addr("10.96.0.7")
    # a trusted proxy without the header is itself the caller
    assert caller_address("10.96.0.5", [], PROXIES) == addr("10.96.0.5")


def test_ipv4_mapped_and_bracketed_addresses() -> None:
    assert caller_address("::ffff:10.1.2.3", [], ()) == addr("10.1.2.3")
    assert caller_address("fd00:96::1", ["[fd00::7]"], PROXIES) == addr("fd00::7")


def test_bad_addresses() -> None:
    with pytest.raises(RegistryError) as bad_hop:
        caller_address("10.96.0.5", ["not-an-ip"], PROXIES)
    assert bad_hop.value.status == 400 and "not-an-ip" in bad_hop.value.message
    for peer in (None, "testclient"):
        with pytest.raises(RegistryError) as no_peer:
            caller_address(peer, [], PROXIES)
        assert no_peer.value.status == 403


TOKEN = "s3cret"
SPEC = EnsembleSpec(
    EnsembleId("gpu", "gb200"), 4, 50000, token_sha256=hashlib.sha256(b"s3cret").hexdigest()
)


def test_token_check() -> None:
    assert check_token(SPEC, f"Bearer {TOKEN}") is None
    assert check_token(SPEC, f"bearer   {TOKEN}  ") is None
    upper = EnsembleSpec(SPEC.ens, 4, 50000, token_sha256=SPEC.token_sha256.upper())  # type: ignore[union-attr]
    assert check_token(upper, f"Bearer {TOKEN}") is None
    assert check_token(SPEC, None) == "missing_token"
    assert check_token(SPEC, "Bearer ") == "missing_token"
    assert check_token(SPEC, f"Basic {TOKEN}") == "missing_token"
    assert check_token(SPEC, "Bearer s3cret2") == "wrong_token"
    # the digest itself is not the token
    assert check_token(SPEC, f"Bearer {SPEC.token_sha256}") == "wrong_token"
    no_token = EnsembleSpec(SPEC.ens, 4, 50000)
    assert check_token(no_token, f"Bearer {TOKEN}") == "no_token_configured"
    garbage = EnsembleSpec(SPEC.ens, 4, 50000, token_sha256="not hex")
    assert check_token(garbage, f"Bearer {TOKEN}") == "bad_token_annotation"


def test_report_schema() -> None:
    ok = StatusReport.model_validate_json('{"imex_state": "READY"}')
    assert ok.model_dump() == {
        "imex_state": "READY",
        "generation_applied": None,
        "nodes_config_sha256": None,
        "hosts_sha256": None,
        "signals": 0,
        "restarts": 0,
        "agent_version": None,
        "cert_not_after": None,
        "imex_domain": None,
        "fabric": None,
        "imex_channel0": None,
        "registry_ca_sha256": None,
        "imex_channels": None,
        "preflight": None,
        "sent": None,
    }
    stamped = StatusReport.model_validate_json(
        '{"imex_state": "READY", "sent": {"boot_id": "6f1c-ab", "boottime_ns": 12, "x": 1}}')
    assert stamped.sent is not None and (stamped.sent.boot_id, stamped.sent.boottime_ns) == \
        ("6f1c-ab", 12)  # a key the registry does not know inside the stamp: ignored
    newer = StatusReport.model_validate_json('{"imex_state": "READY", "extra": 1}')
    assert newer.model_extra == {"extra": 1}  # a newer guest's field: the route drops it
    for bad in (
        '{"imex_state": "READY", "imex_channels": [2048]}',
        '{"imex_state": "READY", "imex_channels": ["0"]}',
        '{"imex_state": "READY", "preflight": [{"name": "x", "result": "OK", "message": ""}]}',
        '{"imex_state": "READY", "preflight": [{"name": "x", "result": "PASS", "message": "'
        + "m" * 256 + '"}]}',
        '{"imex_state": "READY", "preflight": [' + ",".join(
            ['{"name": "x", "result": "PASS", "message": ""}'] * 33) + "]}",
        '{"imex_state": "READY", "preflight": [{"name": "Bad Name", "result": "PASS", '
        '"message": ""}]}',
        '{"imex_state": "READY", "cert_not_after": "tomorrow"}',
        '{"imex_state": "READY", "sent": {"boot_id": "b", "boottime_ns": -1}}',
        '{"imex_state": "READY", "sent": {"boot_id": "b", "boottime_ns": "1"}}',
        '{"imex_state": "READY", "sent": {"boot_id": "", "boottime_ns": 1}}',
        '{"imex_state": "READY", "sent": {"boot_id": "a b", "boottime_ns": 1}}',
        '{"imex_state": "READY", "sent": {"boottime_ns": 1}}',
        '{"imex_state": "READY", "sent": 5}',
        "{}",  # imex_state missing
        '{"imex_state": "READY", "registry_ca_sha256": "ABC"}',
        '{"imex_state": "READY", "signals": -1}',
        '{"imex_state": "READY", "signals": "3"}',  # strict: no strings for numbers
        '{"imex_state": "READY", "restarts": true}',
        '{"imex_state": "READY", "hosts_sha256": "ABC"}',
        '{"imex_state": ""}',
        '{"imex_state": "' + "x" * 65 + '"}',
        "[]",
        "not json",
    ):
        with pytest.raises(ValidationError):
            StatusReport.model_validate_json(bad)
