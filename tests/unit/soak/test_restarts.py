"""Invariant 3's restart policy (tests/soak/restarts.py): an IMEX process may end only
for a fault on its own VM, one end per fault, until the next quiesce."""

from __future__ import annotations

from tests.soak.restarts import CAUSES, STARTUP_CAUSES, Credits


def test_an_end_needs_a_fault_on_its_own_vm() -> None:
    c = Credits()
    c.grant("migration", (("a", 1),))
    # a peer moved: a SIGUSR1, never a restart, for a0
    why = c.ended(("a", 0), 4242, "gb200-0")
    assert why is not None and "gb200-0" in why and "4242" in why
    assert c.ended(("a", 1), 4243, "gb200-1") is None
    assert c.ends == 2


def test_one_end_per_fault_and_none_after_the_quiesce() -> None:
    c = Credits()
    c.grant("imex-crash", (("b", 0),))
    c.grant("agent-kill", (("b", 0),))
    assert c.ended(("b", 0), 1, "gb300-0") is None
    assert c.ended(("b", 0), 2, "gb300-0") is None
    assert c.ended(("b", 0), 3, "gb300-0") is not None  # a third end had no cause
    c.grant("vm-crash", (("b", 1),))
    c.quiesced()
    assert c.ended(("b", 1), 4, "gb300-1") is not None


def test_only_a_guest_fault_on_the_vm_itself_is_a_cause() -> None:
    assert {"imex-crash", "agent-kill", "migration", "vm-crash"} == CAUSES
    c = Credits()
    for kind in ("hosts-clobber", "enospc", "dns-fail", "registry-block", "leader-kill"):
        c.grant(kind, (("a", 2),))
    # an imex-oneway names two VMs and causes no restart on either
    c.grant("imex-oneway", (("a", 2), ("a", 3)))
    assert c.ended(("a", 2), 5, "gb200-2") is not None


def test_a_hosts_clobber_explains_only_a_start_up_no_match_once() -> None:
    # IMEX resolves its own name once, at start-up: a clobbered /etc/hosts can make a
    # starting daemon exit "No matching network interface ...", and nothing else.
    assert {"hosts-clobber"} == STARTUP_CAUSES
    c = Credits()
    c.grant("hosts-clobber", (("a", 1),))
    assert c.ended(("a", 1), 7, "gb200-1") is not None  # a running daemon's end: no
    assert c.ended(("a", 1), 8, "gb200-1", no_match=True) is None
    why = c.ended(("a", 1), 9, "gb200-1", no_match=True)  # one end per clobber
    assert why is not None and "no local address" in why
    c.grant("hosts-clobber", (("a", 1),))
    assert c.ended(("a", 0), 10, "gb200-0", no_match=True) is not None  # another VM's
    c.quiesced()
    assert c.ended(("a", 1), 11, "gb200-1", no_match=True) is not None
