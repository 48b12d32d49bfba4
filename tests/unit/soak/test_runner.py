"""The soak loop's ordering rules (tests/soak/runner.py), which a long run found wrong:
a crash's rejoin was undone while an API outage was held, failed with "Connection
refused", and its VM was lost to the pool for the rest of the run; and how long a quiesce's
convergence must hold, which CI's seed 0xd2975029 found too short (one look)."""

from __future__ import annotations

from tests.sandbox.imex_standin import PEER_TIMEOUT_S
from tests.soak.faults import Active
from tests.soak.runner import SETTLE_S, Held, may_undo, undo_order
from tests.soak.schedule import Fault


def active(fid: int, kind: str, targets: tuple[tuple[str, int], ...] = ()) -> Active:
    return Active(Fault(fid, kind, at=float(fid), hold=1.0, targets=targets),
                  injected_at=0.0, undo_at=0.0)


def test_a_rejoin_or_migration_waits_for_the_api_and_other_undos_do_not() -> None:
    crash, migration = active(1, "vm-crash", (("a", 3),)), active(2, "migration", (("a", 1),))
    clobber = active(3, "hosts-clobber", (("a", 2),))
    assert not may_undo(crash, api_held=True)
    assert not may_undo(migration, api_held=True)
    assert may_undo(clobber, api_held=True)
    assert may_undo(crash, api_held=False)


def test_a_quiesce_undoes_the_api_faults_first_and_keeps_the_rest_in_order() -> None:
    held = [active(1, "vm-crash", (("a", 3),)), active(2, "api-outage"),
            active(3, "enospc", (("b", 0),)), active(4, "api-slow")]
    assert [a.fault.id for a in undo_order(held)] == [2, 4, 1, 3]


def test_convergence_counts_only_once_it_has_held_without_a_break() -> None:
    held = Held(4.0)
    assert not held.observe(10.0, True)
    assert not held.observe(12.0, True)
    # a link IMEX drops late (its ping timed out) breaks the run; it starts again
    assert not held.observe(13.5, False) and held.since is None
    assert not held.observe(14.0, True)
    assert not held.observe(17.5, True)
    assert held.observe(18.0, True) and held.since == 14.0


def test_a_quiesce_outwaits_a_peer_timeout_and_its_redial() -> None:
    assert SETTLE_S > PEER_TIMEOUT_S
