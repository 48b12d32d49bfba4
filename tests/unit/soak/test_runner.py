"""The soak loop's ordering rules (tests/soak/runner.py), which a long run found wrong:
a crash's rejoin was undone while an API outage was held, failed with "Connection
refused", and its VM was lost to the pool for the rest of the run."""

from __future__ import annotations

from tests.soak.faults import Active
from tests.soak.runner import may_undo, undo_order
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
