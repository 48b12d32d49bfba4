"""Invariant 3's lost-signal rule (tests/soak/signals.py), on hand-made pin histories."""

from __future__ import annotations

from tests.soak.signals import ALLOW_S, lost_signal, resolved_at

P0 = {"0": "10.0.0.1", "1": "10.0.0.2"}
P1 = {"0": "10.0.0.1", "1": "10.0.0.9"}  # member 1 moved
P2 = {"0": "10.0.0.1", "1": "127.0.0.2"}  # member 1 gone


def test_a_change_before_the_last_resolution_owes_nothing() -> None:
    assert lost_signal([(10, P0), (20, P1)], resolved_at=21, now=500,
                       state_updated=500) == ("ok", None)


def test_a_change_after_it_is_owed_and_due_after_the_window() -> None:
    changes = [(10, P0), (20, P1)]
    assert lost_signal(changes, 15, now=20 + ALLOW_S - 1, state_updated=500) == ("ok", 20)
    verdict, first = lost_signal(changes, 15, now=20 + ALLOW_S + 1, state_updated=500)
    assert first == 20
    assert "neither acted on a SIGUSR1 nor started" in verdict
    assert "1=10.0.0.9" in verdict and "1=10.0.0.2" in verdict


def test_a_state_written_before_the_deadline_cannot_tell() -> None:
    """The stand-in writes its state only when something changes (and not on a full
    disk): a signal may have come after its last write."""
    assert lost_signal([(10, P0), (20, P1)], 15, now=20 + ALLOW_S + 5,
                       state_updated=20 + ALLOW_S - 1) == ("wait", 20)


def test_a_change_that_came_and_went_owes_nothing() -> None:
    """cloud-init's rewrite and the agent's restore: the same pins at the end."""
    assert lost_signal([(10, P0), (20, P1), (25, P0)], 15, now=500,
                       state_updated=500) == ("ok", None)


def test_the_obligation_runs_from_the_first_change_after_the_resolution() -> None:
    """A departure (which the agent signals three windows later) followed by a move:
    the window counts from the departure."""
    verdict, first = lost_signal([(10, P0), (20, P2), (30, P1)], 15, now=20 + ALLOW_S + 1,
                                 state_updated=500)
    assert first == 20 and verdict not in ("ok", "wait")


def test_no_pins_before_the_start_makes_every_later_change_owed() -> None:
    assert lost_signal([(20, P1)], 15, now=20 + ALLOW_S + 1, state_updated=500)[1] == 20


def test_resolution_is_the_start_or_the_last_acted_signal() -> None:
    log = [{"t": 30.0, "acted": True}, {"t": 33.0, "acted": False},
           {"t": 12.0, "acted": False, "early": True}, {"t": "bad", "acted": True}]
    assert resolved_at({"signal_log": log}, started=10.0) == 30.0
    assert resolved_at({"signal_log": []}, started=10.0) == 10.0
    assert resolved_at({}, started=40.0) == 40.0
