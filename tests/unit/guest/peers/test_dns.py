"""Pure parts of DNS discovery: answer interpretation and the two-absences tracker."""

from __future__ import annotations

import dns.message
import dns.name
import dns.rcode
import dns.rdatatype
import dns.rrset
import pytest

from guest_agent.peers.dns import (
    DnsObservation,
    DnsTracker,
    interpret_address,
    interpret_srv,
    parse_resolv_conf,
)
from imex_shared.model import EnsembleId

ENS = EnsembleId("team-a", "rack1")
ZONE = "cluster.local"
SIZE = 4


def slot_name(i: int, ens: EnsembleId = ENS) -> str:
    return ens.slot_fqdn(i, ZONE) + "."


def srv_response(
    targets: list[str],
    additional: list[tuple[str, str, str]] = (),  # type: ignore[assignment]
    rcode: int = dns.rcode.NOERROR,
) -> dns.message.Message:
    q = dns.message.make_query(ENS.srv_name(ZONE), "SRV")
    r = dns.message.make_response(q)
    r.set_rcode(rcode)
    if targets:
        r.answer.append(
            dns.rrset.from_text_list(
                ENS.srv_name(ZONE) + ".", 5, "IN", "SRV", [f"0 100 50000 {t}" for t in targets]
            )
        )
    for name, rdtype, addr in additional:
        r.additional.append(dns.rrset.from_text(name, 5, "IN", rdtype, addr))
    return r


class Log(list[str]):
    def __call__(self, message: str) -> None:
        self.append(message)


# ------------------------------------------------------------------------- tracker


def obs(present: dict[int, str] | None = None, absent: set[int] | None = None) -> DnsObservation:
    return DnsObservation(present or {}, frozenset(absent or ()), "srv")


def test_join_pins_at_once() -> None:
    t = DnsTracker(SIZE)
    state = t.observe(obs({0: "10.0.0.1", 2: "10.0.0.3"}, {1, 3}))
    assert state.pins == {0: "10.0.0.1", 2: "10.0.0.3"}
    assert state.absent == frozenset()  # one absence is not enough
    assert state.pending == {1, 3}


def test_crash_unpins_only_after_two_consecutive_absences() -> None:
    t = DnsTracker(SIZE)
    t.observe(obs({0: "10.0.0.1", 1: "10.0.0.2"}))
    s1 = t.observe(obs({0: "10.0.0.1"}, {1}))
    assert s1.pins[1] == "10.0.0.2" and 1 not in s1.absent and 1 in s1.pending
    s2 = t.observe(obs({0: "10.0.0.1"}, {1}))
    assert 1 not in s2.pins and 1 in s2.absent and 1 not in s2.pending


def test_blip_between_absences_resets_the_count() -> None:
    t = DnsTracker(SIZE)
    t.observe(obs({1: "10.0.0.2"}))
    t.observe(obs({}, {1}))
    t.observe(obs({1: "10.0.0.2"}))
    s = t.observe(obs({}, {1}))
    assert s.pins == {1: "10.0.0.2"}


def test_unknown_changes_nothing_not_even_the_count() -> None:
    t = DnsTracker(SIZE)
    t.observe(obs({1: "10.0.0.2"}))
    t.observe(obs({}, {1}))
    s = t.observe(DnsObservation())  # a timeout
    assert s.pins == {1: "10.0.0.2"} and s.pending == {1}
    s = t.observe(obs({}, {1}))
    assert s.absent == {1} and s.pins == {}


def test_adopted_registry_belief_replaces_stale_dns_pins() -> None:
    """Seen in the e2e sandbox: DNS timed out for a migrated slot, the registry
    knew the new IP; on failover DNS must not put the pre-migration IP back."""
    t = DnsTracker(SIZE)
    t.observe(obs({0: "10.0.0.1", 1: "10.0.0.2", 3: "10.0.0.4"}))
    t.observe(DnsObservation())  # slot 1 migrates; DNS only times out
    t.adopt({0: "10.0.0.1", 1: "10.0.9.9"}, {2, 3})
    s = t.observe(DnsObservation())  # still unknown after failover
    assert s.pins == {0: "10.0.0.1", 1: "10.0.9.9"}
    assert s.absent == {2, 3} and s.pending == frozenset()
    s = t.observe(obs({0: "10.0.0.1", 1: "10.0.9.9", 3: "10.0.0.44"}))  # DNS catches up
    assert s.pins == {0: "10.0.0.1", 1: "10.0.9.9", 3: "10.0.0.44"} and s.absent == {2}


def test_rejoin_with_new_ip() -> None:
    t = DnsTracker(SIZE)
    t.observe(obs({2: "10.0.0.3"}))
    t.observe(obs({}, {2}))
    t.observe(obs({}, {2}))
    s = t.observe(obs({2: "10.0.0.9"}))
    assert s.pins == {2: "10.0.0.9"} and 2 not in s.absent


def test_observed_only_after_something_authoritative() -> None:
    t = DnsTracker(SIZE)
    t.observe(DnsObservation())
    assert not t.observed
    t.observe(obs({}, {0}))
    assert t.observed


# ------------------------------------------------------------------------- SRV


def test_srv_records_with_additional_addresses() -> None:
    r = srv_response(
        [slot_name(0), slot_name(2)],
        [(slot_name(0), "A", "10.0.0.1"), (slot_name(2), "AAAA", "fd00::3")],
    )
    log = Log()
    v = interpret_srv(r, ENS, ZONE, SIZE, log)
    assert v.kind == "records"
    assert v.named == {0, 2}
    assert v.addresses == {0: ("10.0.0.1",), 2: ("fd00::3",)}
    assert log == []


def test_srv_nxdomain_and_errors() -> None:
    log = Log()
    assert interpret_srv(srv_response([], rcode=dns.rcode.NXDOMAIN), ENS, ZONE, SIZE, log).kind == (
        "nxdomain"
    )
    assert interpret_srv(srv_response([], rcode=dns.rcode.SERVFAIL), ENS, ZONE, SIZE, log).kind == (
        "error"
    )
    assert interpret_srv(srv_response([], rcode=dns.rcode.REFUSED), ENS, ZONE, SIZE, log).kind == (
        "error"
    )
    assert interpret_srv(None, ENS, ZONE, SIZE, log).kind == "error"
    assert interpret_srv(srv_response([]), ENS, ZONE, SIZE, log).kind == "nodata"


@pytest.mark.parametrize(
    ("target", "why"),
    [
        ("evil.example.com.", "not a slot name"),
        (f"{ENS.slot(1)}.other.team-a.svc.cluster.local.", "not a slot name"),
        ("imex-deadbeef-1.rack1.team-a.svc.cluster.local.", "not a slot of ensemble"),
        (slot_name(999), "out of range"),
        (f"x.{slot_name(1)}", "not a slot name"),
    ],
)
def test_srv_hostile_targets_are_ignored_with_one_line_each(target: str, why: str) -> None:
    r = srv_response([slot_name(0), target], [(target, "A", "10.0.0.66")])
    log = Log()
    v = interpret_srv(r, ENS, ZONE, SIZE, log)
    assert v.named == {0}
    assert 1 not in v.addresses and 999 not in v.addresses
    # one line for the target, one for its additional record
    assert len(log) == 2
    assert why in log[0]


@pytest.mark.parametrize("addr", ["127.0.0.1", "169.254.1.1", "0.0.0.0", "10.0.2.2", "fe80::1"])
def test_srv_unusable_additional_address_ignored_but_slot_still_named(addr: str) -> None:
    rdtype = "AAAA" if ":" in addr else "A"
    r = srv_response([slot_name(1)], [(slot_name(1), rdtype, addr)])
    log = Log()
    v = interpret_srv(r, ENS, ZONE, SIZE, log)
    assert v.named == {1}  # listed: not absent
    assert v.addresses == {}  # but nothing to pin
    assert len(log) == 1 and "ignoring address" in log[0]


def test_srv_answer_for_another_name_is_ignored() -> None:
    r = srv_response([slot_name(0)])
    r.answer.append(
        dns.rrset.from_text("_imex._tcp.other.team-a.svc.cluster.local.", 5, "IN", "SRV",
                            f"0 100 50000 {slot_name(1)}")
    )
    log = Log()
    v = interpret_srv(r, ENS, ZONE, SIZE, log)
    assert v.named == {0}
    assert len(log) == 1 and "not what was asked" in log[0]


# ------------------------------------------------------------------------- A / AAAA


def addr_response(
    qname: str, rdtype: str, addrs: list[str], rcode: int = dns.rcode.NOERROR,
    owner: str | None = None,
) -> dns.message.Message:
    q = dns.message.make_query(qname, rdtype)
    r = dns.message.make_response(q)
    r.set_rcode(rcode)
    if addrs:
        r.answer.append(dns.rrset.from_text_list(owner or qname, 5, "IN", rdtype, addrs))
    return r


def test_address_verdicts() -> None:
    name = slot_name(1)
    q = dns.name.from_text(name)
    log = Log()
    A = dns.rdatatype.A
    assert interpret_address(addr_response(name, "A", ["10.0.0.2"]), q, A, log) == (
        "present", "10.0.0.2")
    assert interpret_address(addr_response(name, "A", ["10.0.0.9", "10.0.0.2"]), q, A, log) == (
        "present", "10.0.0.2")
    assert interpret_address(addr_response(name, "A", [], dns.rcode.NXDOMAIN), q, A, log) == (
        "absent", None)
    assert interpret_address(addr_response(name, "A", [], dns.rcode.SERVFAIL), q, A, log) == (
        "unknown", None)
    assert interpret_address(addr_response(name, "A", []), q, A, log) == ("nodata", None)
    assert interpret_address(None, q, A, log) == ("unknown", None)
    assert log == []


def test_address_hostile_records() -> None:
    name = slot_name(1)
    q = dns.name.from_text(name)
    log = Log()
    A = dns.rdatatype.A
    # only a loopback address: not present, and not evidence of absence either
    assert interpret_address(addr_response(name, "A", ["127.0.0.1"]), q, A, log) == (
        "unknown", None)
    assert len(log) == 1
    # a record for another owner: ignored
    assert interpret_address(
        addr_response(name, "A", ["10.0.0.5"], owner="evil.example.com."), q, A, log
    ) == ("nodata", None)
    assert len(log) == 2 and "evil.example.com" in log[1]


def test_resolv_conf_text() -> None:
    text = ("search a.svc\nnameserver 10.96.0.10\nnameserver fe80::1%eth0\n"
            "nameserver ::1\nnameserver not-an-ip\noptions ndots:5\n")
    assert [str(n) for n in parse_resolv_conf(text, "r")] == ["10.96.0.10:53", "[::1]:53"]
    assert [str(n) for n in parse_resolv_conf("# nothing\n", "r")] == ["127.0.0.1:53"]


def test_srv_with_only_hostile_targets_says_nothing() -> None:
    # all targets bogus: not "every slot absent", which would unpin every peer
    log = Log()
    v = interpret_srv(srv_response(["evil.example.com.", slot_name(99)]), ENS, ZONE, SIZE, log)
    assert v.kind == "error"
    assert any("without a usable target" in m for m in log)


def test_srv_answer_only_for_another_name_says_nothing() -> None:
    r = srv_response([])
    r.answer.append(
        dns.rrset.from_text("_imex._tcp.other.team-a.svc.cluster.local.", 5, "IN", "SRV",
                            f"0 100 50000 {slot_name(1)}")
    )
    assert interpret_srv(r, ENS, ZONE, SIZE, Log()).kind == "error"
