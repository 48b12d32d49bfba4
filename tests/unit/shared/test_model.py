"""The shared model: names, indices and address validation (DESIGN.md "Names")."""

from __future__ import annotations

import pytest

from imex_shared.model import (
    EnsembleId,
    InvalidIndex,
    InvalidName,
    Member,
    ModelError,
    UnusableAddress,
    check_index,
    domain_id,
    index_from_name,
    members_from_json,
    parse_ip,
    usable_ip,
)


def test_domain_id_is_sha256_prefix_of_namespace_slash_name() -> None:
    # printf 'gpu/gb200' | sha256sum | cut -c1-8
    assert domain_id("gpu", "gb200") == "93a7a316"
    assert EnsembleId("gpu", "other").domain_id == "cc395df1"


def test_slot_names_and_dns_names() -> None:
    ens = EnsembleId("gpu", "gb200")
    assert ens.slot(0) == "imex-93a7a316-0"
    assert ens.slot(17) == "imex-93a7a316-17"
    assert ens.slot_fqdn(3) == "imex-93a7a316-3.gb200.gpu.svc.cluster.local"
    assert ens.srv_name("example.org.") == "_imex._tcp.gb200.gpu.svc.example.org"
    assert ens.block_begin == "# BEGIN imex-ensemble gpu/gb200"
    assert ens.block_end == "# END imex-ensemble gpu/gb200"


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("imex-93a7a316-0", 0),
        ("imex-93a7a316-17", 17),
        ("IMEX-93A7A316-4", 4),
        ("imex-93a7a316-07", None),
        ("imex-93a7a316-", None),
        ("imex-93a7a316-1x", None),
        ("imex-cc395df1-1", None),
        ("localhost", None),
    ],
)
def test_slot_index_recognises_only_our_names(name: str, index: int | None) -> None:
    assert EnsembleId("gpu", "gb200").slot_index(name) == index


def test_slot_names_differ_between_ensembles() -> None:
    a, b = EnsembleId("gpu", "gb200"), EnsembleId("gpu2", "gb200")
    assert a.slot(0) != b.slot(0)
    assert b.slot_index(a.slot(0)) is None


@pytest.mark.parametrize("bad", ["GB200", "gb_200", "-gb", "", "a" * 64, "gb200."])
def test_ensemble_names_must_be_dns_labels(bad: str) -> None:
    with pytest.raises(InvalidName, match="RFC 1123"):
        EnsembleId("gpu", bad)


@pytest.mark.parametrize(
    ("text", "canonical"),
    [
        ("10.244.0.23/24", "10.244.0.23"),
        (" 10.0.0.1 ", "10.0.0.1"),
        ("FD00:0::5", "fd00::5"),
        ("2001:db8::1/64", "2001:db8::1"),
    ],
)
def test_usable_ip_strips_prefix_and_canonicalises(text: str, canonical: str) -> None:
    assert usable_ip(text) == canonical


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("10.0.2.2", "guest-internal masquerade"),
        ("10.0.2.2/24", "guest-internal masquerade"),
        ("fd10:0:2::2", "guest-internal masquerade"),
        ("127.0.0.1", "loopback"),
        ("::1", "loopback"),
        ("169.254.1.1", "link-local"),
        ("fe80::1", "link-local"),
        ("0.0.0.0", "unspecified"),
        ("::", "unspecified"),
        ("224.0.0.1", "multicast"),
        ("::ffff:10.0.0.1", "IPv4-mapped"),
        ("fe80::1%eth0", "zone index"),
        ("10.0.0.256", "not an IP address"),
        ("10.0.0.1\nevil", "not an IP address"),
        ("", "not an IP address"),
    ],
)
def test_unusable_addresses_are_refused_with_reason(text: str, reason: str) -> None:
    with pytest.raises(UnusableAddress, match=reason):
        usable_ip(text)


def test_parse_ip_accepts_guest_internal_but_usable_ip_does_not() -> None:
    # The own slot of a masquerade guest is pinned locally to 10.0.2.2.
    assert str(parse_ip("10.0.2.2")) == "10.0.2.2"


@pytest.mark.parametrize(
    ("index", "message"),
    [(18, "out of range"), (-1, "negative"), ("3", "not an integer"), (True, "not an integer")],
)
def test_check_index(index: object, message: str) -> None:
    with pytest.raises(InvalidIndex, match=message):
        check_index(index, 18)
    assert check_index(17, 18) == 17


@pytest.mark.parametrize(
    ("name", "index"),
    [("gb200-3", 3), ("pool-a-17", 17), ("gb200", None), ("gb200-03", None), ("gb-x", None)],
)
def test_index_from_vmi_name(name: str, index: int | None) -> None:
    assert index_from_name(name) == index


def test_members_from_json_validates_each_entry() -> None:
    members = members_from_json([{"index": 2, "ip": "10.0.0.3/16"}, {"index": 0, "ip": "fd::1"}], 4)
    assert members == [Member(0, "fd::1"), Member(2, "10.0.0.3")]
    with pytest.raises(InvalidIndex, match=r"members\[1\]: slot index 4 is out of range"):
        members_from_json([{"index": 0, "ip": "10.0.0.1"}, {"index": 4, "ip": "10.0.0.2"}], 4)
    with pytest.raises(UnusableAddress, match=r"members\[0\]: 127.0.0.1 is a loopback"):
        members_from_json([{"index": 0, "ip": "127.0.0.1"}], 4)
    with pytest.raises(InvalidIndex, match="appears twice"):
        members_from_json([{"index": 0, "ip": "10.0.0.1"}, {"index": 0, "ip": "10.0.0.2"}], 4)
    with pytest.raises(ModelError, match="unknown field"):
        members_from_json([{"index": 0, "ip": "10.0.0.1", "evil": 1}], 4)
    with pytest.raises(ModelError, match="JSON list"):
        members_from_json({"index": 0}, 4)
