"""When to signal, start or restart IMEX: a pure decision, tested as tables.

Why the rules are what they are (FACTS.md "The IMEX daemon"):

- IMEX reads the nodes file only at start, so a changed nodes file needs a
  restart. In names mode the file depends only on the ensemble and never
  changes, so a moving peer costs a SIGUSR1 (re-resolve names), not a restart.
- IMEX acts on at most one SIGUSR1 per 5 s and ignores the rest. So signals
  are spaced ``signal_interval`` apart and a change inside the window is
  *held*, not dropped: when the window ends the latest state is signalled
  once. Ten changes in two seconds cost at most two signals.
- The first signal after a (re)start is held for one window too: a SIGUSR1
  that arrives before the daemon has installed its handler would kill it,
  and a freshly started daemon has just resolved every name anyway.
- IMEX binds to the nodes-file entry that matches a local address; started
  before our own slot is pinned it exits ("No matching network interface").
  So nothing is started (or restarted) until the own slot is pinned.
- ips mode (and ``on_change = "restart"``): every change is a restart, so a
  burst is debounced: act once the state has been still for ``settle_time``.
- A daemon that has not said READY (``nvidia-imex-ctl -q``) for
  ``ready_grace`` is restarted; so is a dead one (process mode with backoff).
- One more restart reason: our own pinned address moved (DHCP gave a new
  one) while IMEX runs. IMEX bound its server socket to the old address at
  start and SIGUSR1 only redials outgoing connections, so without a restart
  no peer could reach it again. An unknown bind address (a daemon we found
  running) never triggers this.

``decide`` is a pure function of (what IMEX was told, what the files now
say, policy, now) and returns the action plus when to look again; the
``Supervisor`` task only observes, calls ``decide`` and executes. All times
are ``time.monotonic()`` seconds.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Literal

from imex_shared.model import ABSENT_IP

Pins = tuple[tuple[int, str], ...]

READY = "READY"


def freeze_pins(pins: Mapping[int, str]) -> Pins:
    """A hashable, order-independent form of an index -> IP map.

    A slot pinned to ABSENT_IP renders exactly like a slot without a pin, so
    both compare equal (a hosts block read back from disk lists every slot).
    """
    return tuple(sorted((i, ip) for i, ip in pins.items() if ip != ABSENT_IP))


class Action(enum.Enum):
    NOTHING = "nothing"
    SIGNAL = "signal"
    RESTART = "restart"
    START = "start"


@dataclass(frozen=True, slots=True)
class Policy:
    mode: Literal["names", "ips"] = "names"
    on_change: Literal["signal", "restart"] = "signal"
    signal_interval: float = 5.0
    settle_time: float = 2.0
    ready_grace: float = 120.0
    #: added to the window: IMEX times its window from when it acted, which is a
    #: little after we sent (scheduling), so a signal at exactly +5 s could be ignored.
    signal_slack: float = 0.15
    #: a change that only takes peers away is told this many windows after it (below)
    removal_windows: float = 3.0


@dataclass(frozen=True, slots=True)
class Want:
    """What the files say now (the agent's side)."""

    pins: Pins
    nodes_sha: str
    own_pinned: bool
    #: monotonic time of the last change of ``pins`` or ``nodes_sha``.
    changed_at: float
    #: the address our own slot is pinned to (what IMEX binds to at start).
    own_ip: str | None = None
    #: digest of the TLS files IMEX reads (authEncryption), None when there are none.
    creds: str | None = None
    #: authEncryption: IMEX must not start before ``creds`` exist.
    creds_needed: bool = False


@dataclass(frozen=True, slots=True)
class Told:
    """What the daemon knows (our record of it) and what we observed of it."""

    running: bool = False
    #: pins the daemon last resolved (at start or at the last acted-on SIGUSR1);
    #: None while it has never been started by or adopted by us.
    pins: Pins | None = None
    nodes_sha: str | None = None
    last_signal_at: float | None = None
    #: when the daemon was first seen not READY (None: READY or unknown).
    not_ready_since: float | None = None
    #: no start/restart before this time (backoff after a crash).
    hold_until: float = 0.0
    #: the own address IMEX bound to at its start (None: unknown, e.g. adopted).
    own_ip: str | None = None
    #: the TLS files' digest IMEX loaded (at start or the last acted-on SIGUSR1).
    creds: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    #: when ``decide`` should run again even without news (None: only on news).
    wake_at: float | None = None


def earliest(*times: float | None) -> float | None:
    real = [t for t in times if t is not None]
    return min(real) if real else None


def decide(told: Told, want: Want, policy: Policy, now: float) -> Decision:
    """What IMEX needs now; pure, see the module docstring for the rules."""
    if not want.own_pinned:
        return Decision(Action.NOTHING, "own slot is not pinned yet: IMEX could not bind")
    if not told.running:
        if want.creds_needed and want.creds is None:
            return Decision(Action.NOTHING, "waiting for the IMEX certificate (authEncryption)")
        if now < told.hold_until:
            return Decision(Action.NOTHING, "IMEX is down, backing off", told.hold_until)
        if told.nodes_sha is None:
            return Decision(Action.START, "IMEX is not running")
        return Decision(Action.RESTART, "IMEX is dead")
    settle_at = want.changed_at + policy.settle_time
    if told.nodes_sha != want.nodes_sha:
        if policy.mode == "ips" and now < settle_at:
            return Decision(Action.NOTHING, "nodes file changed, waiting to settle", settle_at)
        return Decision(Action.RESTART, "the nodes file changed (IMEX reads it only at start)")
    if told.own_ip is not None and want.own_ip is not None and told.own_ip != want.own_ip:
        # IMEX bound its server socket to the old own address at start; SIGUSR1 only
        # restarts outgoing connections, so peers could never reach it again.
        return Decision(
            Action.RESTART, f"own address moved from {told.own_ip} to {want.own_ip}"
        )
    grace_at = (
        told.not_ready_since + policy.ready_grace if told.not_ready_since is not None else None
    )
    if grace_at is not None and now >= grace_at:
        return Decision(Action.RESTART, f"IMEX not READY for {policy.ready_grace:g}s")
    pins_changed = told.pins != want.pins
    # SIGUSR1 reloads IMEX's TLS credentials too: a renewal rides the same window as a
    # membership change, so both together cost one signal, and neither is dropped.
    creds_changed = want.creds is not None and told.creds != want.creds
    if pins_changed and (policy.on_change == "restart" or policy.mode == "ips"):
        if now < settle_at:
            return Decision(Action.NOTHING, "peers changed, waiting to settle", settle_at)
        return Decision(Action.RESTART, "peers changed (on_change = restart)")
    if pins_changed and not creds_changed and told.pins is not None and (
        set(want.pins) <= set(told.pins)
    ):
        # Only peers gone (a deletion, a clique split): IMEX's retries re-resolve every
        # attempt (FACTS.md), so they already dial nothing but 127.0.0.2; a signal would
        # only drop links still up, and it would close the 5 s window in the seconds when
        # a replacement's new address typically follows. So it waits: a gain in the
        # meantime carries it, or it is told when the hold ends.
        hold_at = want.changed_at + policy.removal_windows * policy.signal_interval
        if now < hold_at:
            return Decision(Action.NOTHING, "peers left, telling IMEX later", hold_at)
    if pins_changed or creds_changed:
        what = " and ".join(w for w, c in (("peers changed", pins_changed),
                                            ("credentials renewed", creds_changed)) if c)
        window = (
            told.last_signal_at + policy.signal_interval + policy.signal_slack
            if told.last_signal_at is not None
            else None
        )
        if window is not None and now < window:
            return Decision(
                Action.NOTHING, f"{what} inside the SIGUSR1 window, holding", window
            )
        return Decision(Action.SIGNAL, what)
    return Decision(Action.NOTHING, "IMEX is up to date", grace_at)


def after(told: Told, want: Want, action: Action, now: float) -> Told:
    """Our record of the daemon once ``action`` has been carried out."""
    if action is Action.SIGNAL:
        return replace(told, pins=want.pins, creds=want.creds, last_signal_at=now)
    if action in (Action.START, Action.RESTART):
        return replace(
            told,
            running=True,
            pins=want.pins,
            creds=want.creds,
            nodes_sha=want.nodes_sha,
            last_signal_at=now,
            not_ready_since=now,
            own_ip=want.own_ip,
        )
    return told
