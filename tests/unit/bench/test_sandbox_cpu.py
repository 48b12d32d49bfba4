"""The stand-ins' reconnects per SIGUSR1 are counted across their restarts (issue 27:
a stand-in that does less must not pass for a cheaper one, so the figure must exist)."""

from __future__ import annotations

from tests.bench.sandbox_cpu import ReconnectTally


def test_a_phase_that_restarts_every_daemon_still_counts_the_intervals_between() -> None:
    # (starts, outgoing attempts, SIGUSR1 acted) per VM, as the state files say
    tally = ReconnectTally({"a": (1, 17, 0), "b": (1, 17, 0)})
    tally.sample({"a": (1, 34, 1), "b": (1, 34, 1)})  # a change: both redial 17
    tally.sample({"a": (2, 17, 0), "b": (1, 53, 2)})  # a moved: its daemon restarted
    tally.sample({"a": (2, 34, 1), "b": (2, 17, 0)})  # b moved; a redialled
    tally.sample({"a": (2, 51, 2), "b": (2, 34, 1)})
    # a: 17 + 17 + 17 attempts over 3 signals; b: 17 + 19 + 17 over 3; the intervals
    # with a restart (its first dials, no signal) are left out
    assert tally.sums == {"a": [51, 3], "b": [53, 3]}
    assert tally.per_signal() == [17.0, 53 / 3]


def test_a_vm_that_acted_on_no_signal_is_left_out() -> None:
    tally = ReconnectTally({"a": (1, 17, 0)})
    tally.sample({"a": (1, 20, 0)})  # retries only: no ratio to give
    assert tally.per_signal() == []
