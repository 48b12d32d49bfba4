"""decide(): a certificate renewal shares the SIGUSR1 window with membership changes
(one signal for both, never dropped), and IMEX never starts before its credentials."""

from __future__ import annotations

from guest_agent.imex.supervisor import Action, Policy, Told, Want, after, decide

P = Policy()
PINS = ((0, "10.0.0.1"), (1, "10.0.0.2"))
MOVED = ((0, "10.0.0.1"), (1, "10.0.0.9"))


def want(pins: tuple[tuple[int, str], ...] = PINS, creds: str | None = "c1",
         needed: bool = True) -> Want:
    return Want(pins, "n", True, 0.0, "10.0.0.1", creds, needed)


def running(last_signal_at: float = 0.0, creds: str | None = "c1") -> Told:
    return Told(running=True, pins=PINS, nodes_sha="n", last_signal_at=last_signal_at,
                own_ip="10.0.0.1", creds=creds)


def test_no_start_before_the_credentials_exist() -> None:
    d = decide(Told(), want(creds=None), P, 100.0)
    assert d.action is Action.NOTHING and "certificate" in d.reason
    assert decide(Told(), want(), P, 100.0).action is Action.START
    # without authEncryption nothing waits
    assert decide(Told(), want(creds=None, needed=False), P, 100.0).action is Action.START


def test_a_renewal_alone_is_one_sigusr1() -> None:
    d = decide(running(), want(creds="c2"), P, 100.0)
    assert (d.action, d.reason) == (Action.SIGNAL, "credentials renewed")
    told = after(running(), want(creds="c2"), d.action, 100.0)
    assert told.creds == "c2" and told.pins == PINS
    assert decide(told, want(creds="c2"), P, 101.0).action is Action.NOTHING


def test_renewal_and_membership_in_one_window_cost_one_signal_and_none_is_lost() -> None:
    told = running(last_signal_at=100.0)
    # both arrive inside the window: held until it ends, then one signal for both
    d = decide(told, want(pins=MOVED, creds="c2"), P, 102.0)
    assert d.action is Action.NOTHING and d.wake_at == 100.0 + 5.0 + P.signal_slack
    assert "peers changed and credentials renewed" in d.reason
    d = decide(told, want(pins=MOVED, creds="c2"), P, 105.2)
    assert d.action is Action.SIGNAL
    told = after(told, want(pins=MOVED, creds="c2"), d.action, 105.2)
    assert (told.pins, told.creds) == (MOVED, "c2")
    # a renewal right after that signal waits for the next window, then is sent
    d = decide(told, want(pins=MOVED, creds="c3"), P, 106.0)
    assert d.action is Action.NOTHING and d.wake_at == 105.2 + 5.0 + P.signal_slack
    assert decide(told, want(pins=MOVED, creds="c3"), P, 110.4).action is Action.SIGNAL


def test_a_restart_loads_the_current_credentials() -> None:
    told = after(Told(), want(creds="c5"), Action.START, 50.0)
    assert told.creds == "c5"
    assert decide(told, want(creds="c5"), P, 60.0).action is Action.NOTHING
