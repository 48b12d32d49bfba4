"""The pure IMEX decision (guest_agent.imex.supervisor.decide / after): tables, no event loop."""

from __future__ import annotations

import pytest

from guest_agent.imex.supervisor import Action, Policy, Told, Want, after, decide, freeze_pins
from guest_agent.imex.supervisor_io import Backoff

A = freeze_pins({0: "10.0.0.1", 1: "10.0.0.2"})
B = freeze_pins({0: "10.0.0.1", 1: "10.0.0.9"})
GONE = freeze_pins({0: "10.0.0.1"})
GONE_MOVED = freeze_pins({0: "10.0.0.7"})
NAMES = Policy(mode="names", on_change="signal", signal_interval=5.0, settle_time=2.0,
               ready_grace=120.0, signal_slack=0.0)
IPS = Policy(mode="ips", signal_interval=5.0, settle_time=2.0, ready_grace=120.0)
RESTARTS = Policy(mode="names", on_change="restart", settle_time=2.0)


def want(pins=A, sha="n1", own=True, changed_at=100.0) -> Want:
    return Want(pins, sha, own, changed_at)


def told(**kw: object) -> Told:
    base = dict(running=True, pins=A, nodes_sha="n1", last_signal_at=0.0)
    base.update(kw)
    return Told(**base)  # type: ignore[arg-type]


CASES = [
    # (name, told, want, policy, now, action, wake_at)
    ("own slot unpinned: never start", Told(), want(own=False), NAMES, 100, Action.NOTHING, None),
    ("own slot unpinned: no restart of a dead one", told(running=False), want(own=False), NAMES,
     100, Action.NOTHING, None),
    ("never started: start", Told(), want(), NAMES, 100, Action.START, None),
    ("dead: restart", told(running=False), want(), NAMES, 100, Action.RESTART, None),
    ("dead, backing off", told(running=False, hold_until=103.0), want(), NAMES, 100,
     Action.NOTHING, 103.0),
    ("up to date", told(), want(), NAMES, 100, Action.NOTHING, None),
    ("peers changed, window open: signal", told(), want(pins=B), NAMES, 100, Action.SIGNAL, None),
    ("peers changed inside the window: hold until it ends", told(last_signal_at=97.0),
     want(pins=B), NAMES, 100, Action.NOTHING, 102.0),
    ("window just ended: signal", told(last_signal_at=95.0), want(pins=B), NAMES, 100,
     Action.SIGNAL, None),
    ("only peers left: told three windows later", told(), want(pins=GONE), NAMES, 100,
     Action.NOTHING, 115.0),
    ("only peers left, the hold over: signal", told(), want(pins=GONE), NAMES, 115,
     Action.SIGNAL, None),
    ("only peers left, the hold over but inside the window: hold for it",
     told(last_signal_at=112.0), want(pins=GONE), NAMES, 115, Action.NOTHING, 117.0),
    ("a peer left and another moved: signal at once", told(), want(pins=GONE_MOVED), NAMES,
     100, Action.SIGNAL, None),
    ("a peer came back: signal at once", told(pins=GONE), want(pins=A), NAMES, 100,
     Action.SIGNAL, None),
    ("adopted without known pins: signal", told(pins=None), want(), NAMES, 100,
     Action.SIGNAL, None),
    ("names: nodes file changed: restart at once", told(nodes_sha="old"), want(), NAMES, 100,
     Action.RESTART, None),
    ("ips: nodes file changed, not settled", told(nodes_sha="old"), want(changed_at=99.0), IPS,
     100, Action.NOTHING, 101.0),
    ("ips: nodes file changed and settled: restart", told(nodes_sha="old"),
     want(changed_at=97.0), IPS, 100, Action.RESTART, None),
    ("on_change=restart: peers changed, not settled", told(), want(pins=B, changed_at=99.5),
     RESTARTS, 100, Action.NOTHING, 101.5),
    ("on_change=restart: settled: restart, never a signal", told(), want(pins=B, changed_at=90),
     RESTARTS, 100, Action.RESTART, None),
    ("own address moved: restart (IMEX listens on the old one)", told(own_ip="10.0.0.1"),
     Want(A, "n1", True, 100.0, "10.0.0.7"), NAMES, 100, Action.RESTART, None),
    ("own address unknown (adopted): no restart", told(own_ip=None),
     Want(A, "n1", True, 100.0, "10.0.0.7"), NAMES, 100, Action.NOTHING, None),
    ("not READY within grace: wait", told(not_ready_since=50.0), want(), NAMES, 100,
     Action.NOTHING, 170.0),
    ("not READY past grace: restart", told(not_ready_since=50.0), want(), NAMES, 171,
     Action.RESTART, None),
]


@pytest.mark.parametrize(("name", "t", "w", "policy", "now", "action", "wake"), CASES,
                         ids=[c[0] for c in CASES])
def test_decision_table(name: str, t: Told, w: Want, policy: Policy, now: float,
                        action: Action, wake: float | None) -> None:
    d = decide(t, w, policy, now)
    assert d.action is action, d.reason
    assert d.wake_at == wake


def test_after_signal_records_pins_and_window() -> None:
    t = after(told(), want(pins=B), Action.SIGNAL, 200.0)
    assert t.pins == B and t.last_signal_at == 200.0
    # The next change inside the window is held until 205.
    d = decide(t, want(pins=A), NAMES, 201.0)
    assert (d.action, d.wake_at) == (Action.NOTHING, 205.0)


def test_after_start_holds_first_signal_one_window() -> None:
    """A SIGUSR1 before IMEX installs its handler would kill it: hold one window."""
    t = after(Told(), want(), Action.START, 10.0)
    assert t.running and t.nodes_sha == "n1" and t.pins == A
    d = decide(t, want(pins=B), NAMES, 11.0)
    assert (d.action, d.wake_at) == (Action.NOTHING, 15.0)
    assert decide(t, want(pins=B), NAMES, 15.0).action is Action.SIGNAL


def test_burst_settles_into_one_signal_per_window() -> None:
    """Ten changes in two seconds: one signal at once, one at the window's end, final state."""
    t = told(last_signal_at=None)
    sent: list[tuple[float, tuple[tuple[int, str], ...]]] = []
    now = 0.0
    for k in range(10):
        w = want(pins=freeze_pins({0: "10.0.0.1", 1: f"10.0.1.{k}"}), changed_at=now)
        d = decide(t, w, NAMES, now)
        if d.action is Action.SIGNAL:
            t = after(t, w, d.action, now)
            sent.append((now, w.pins))
        now += 0.2
    final = w
    d = decide(t, final, NAMES, now)
    assert d.action is Action.NOTHING and d.wake_at == 5.0
    d = decide(t, final, NAMES, 5.0)
    assert d.action is Action.SIGNAL
    t = after(t, final, d.action, 5.0)
    sent.append((5.0, final.pins))
    assert len(sent) == 2
    assert sent[1][0] - sent[0][0] >= 5.0
    assert sent[-1][1] == final.pins
    assert decide(t, final, NAMES, 9.0).action is Action.NOTHING


def test_ips_burst_settles_into_one_restart() -> None:
    t = told()
    restarts = 0
    now = 0.0
    for k in range(18):
        w = want(sha=f"n{k}", changed_at=now)
        d = decide(t, w, IPS, now)
        if d.action is Action.RESTART:
            restarts += 1
            t = after(t, w, d.action, now)
        now += 0.5
    # Once the burst is over and settle_time has passed: exactly one restart.
    d = decide(t, w, IPS, now + 2.0)
    assert restarts == 0 and d.action is Action.RESTART
    t = after(t, w, d.action, now + 2.0)
    assert decide(t, w, IPS, now + 10.0).action is Action.NOTHING


def test_signal_slack_widens_the_window() -> None:
    """IMEX times its window from when it acted, a little after we sent: keep a margin."""
    policy = Policy(signal_interval=5.0, signal_slack=0.15)
    t = told(last_signal_at=100.0)
    d = decide(t, want(pins=B), policy, 105.0)
    assert (d.action, d.wake_at) == (Action.NOTHING, 105.15)
    assert decide(t, want(pins=B), policy, 105.15).action is Action.SIGNAL


def test_absent_pins_equal_missing_pins() -> None:
    """A block read back from disk lists 127.0.0.2 for absent slots; that is no change."""
    assert freeze_pins({0: "10.0.0.1", 1: "127.0.0.2"}) == freeze_pins({0: "10.0.0.1"})
    assert freeze_pins({1: "10.0.0.2", 0: "10.0.0.1"}) == A


def test_backoff_doubles_and_resets_after_a_stable_run() -> None:
    b = Backoff(base=0.5, cap=4.0, stable_after=60.0)
    assert [b.next_delay(1.0) for _ in range(5)] == [0.5, 1.0, 2.0, 4.0, 4.0]
    assert b.next_delay(61.0) == 0.5
