"""pacing.py: how long an ensemble's event waits before its pass (a pure decision)."""

from __future__ import annotations

from host_agent.reconcile.pacing import (
    BUSY_BACKLOG_PER_WORKER,
    BUSY_SETTLE_SECONDS,
    LAST_EVENT_LIMIT,
    Pacing,
)

SETTLE, QUIET, WORKERS = 0.05, 1.0, 4
BUSY = BUSY_BACKLOG_PER_WORKER * WORKERS


def test_a_first_event_and_one_after_a_quiet_second_wait_for_nothing() -> None:
    p = Pacing(SETTLE, QUIET, WORKERS)
    assert p.wait("a", now=100.0, backlog=0) == 0.0
    assert p.wait("a", now=100.0 + QUIET, backlog=0) == 0.0
    assert p.wait("b", now=100.0 + QUIET, backlog=0) == 0.0  # keys are apart


def test_events_inside_a_burst_settle_and_each_extends_the_burst() -> None:
    p = Pacing(SETTLE, QUIET, WORKERS)
    assert p.wait("a", now=10.0, backlog=0) == 0.0
    # 0.9 s apart each: every one is inside the burst the previous one left open
    for k in range(1, 5):
        assert p.wait("a", now=10.0 + 0.9 * k, backlog=0) == SETTLE


def test_behind_a_backlog_even_a_quiet_key_settles_the_busy_time() -> None:
    p = Pacing(SETTLE, QUIET, WORKERS)
    assert p.wait("a", now=0.0, backlog=BUSY) == BUSY_SETTLE_SECONDS
    assert p.wait("b", now=0.0, backlog=BUSY - 1) == 0.0
    assert p.wait("b", now=0.1, backlog=BUSY - 1) == SETTLE
    # a settle longer than the busy time is never shortened by being busy
    assert Pacing(5.0, QUIET, WORKERS).wait("c", 0.0, BUSY) == 5.0


def test_memory_is_bounded_and_keeps_the_keys_still_inside_a_burst() -> None:
    p = Pacing(SETTLE, QUIET, WORKERS)
    for k in range(LAST_EVENT_LIMIT):
        p.wait(k, now=0.0, backlog=0)
    p.wait("recent", now=5.0, backlog=0)  # at the limit: the quiet keys are dropped
    for k in range(LAST_EVENT_LIMIT - 1):  # fill again, inside the burst this time
        p.wait(("burst", k), now=5.1, backlog=0)
    p.wait("late", now=5.2, backlog=0)  # at the limit again: nothing is quiet yet
    assert p.wait("recent", now=5.3, backlog=0) == SETTLE
    assert p.wait(("burst", 0), now=5.3, backlog=0) == SETTLE
    assert p.wait(0, now=5.3, backlog=0) == 0.0  # forgotten: as good as quiet
