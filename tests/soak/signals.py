"""Invariant 3's second half: no SIGUSR1 is lost.

TEST CODE. In names mode IMEX dials its peers by the names ``/etc/hosts`` pins, and a
connected link re-resolves only when the daemon acts on a SIGUSR1 (FACTS.md; the
stand-in does the same) or when the daemon starts. So every change of a VM's pins must be
followed, within the agent's window, by a *resolution*: an acted SIGUSR1 or a start. The
agent's window (docs/guest-agent.md, "What a membership change does to IMEX"): one
``signal_interval`` (5 s, + 0.15 s) for a gained or moved peer, a change inside it held
to its end; three windows (15 s) for a change that only takes peers away; the first
signal after a start one window. :data:`ALLOW_S` is the longest of these plus slack for
a loaded 2-core machine.

The rule (:func:`lost_signal`): take the pins as they were at the VM's last resolution
``resolved_at``. If the pins now differ from them, the first change after it is the
*obligation*: once :data:`ALLOW_S` has passed since that change, a resolution must have
followed it, and since ``resolved_at`` is the last one, none did. A change that only
came and went (cloud-init's rewrite of ``/etc/hosts`` and the agent's restore, the same
pins) owes nothing.

Judged only on what the stand-in wrote after the deadline: its state file (and with it
its signal log) is written when something changes, and not at all while its file
system is full (the ``enospc`` fault), so a state older than the deadline may not show a
signal that came; such an obligation waits, and counts as unjudged if the run ends first.
Pure: invariants.Continuous feeds it the reader's records and the stand-in's state.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

#: three windows of 5 s (a change that only takes peers away), the agent's 0.15 s, and
#: 10 s for timers that run late on a loaded machine
ALLOW_S = 3 * 5.0 + 0.15 + 10.0

Pins = Mapping[str, Any]


def lost_signal(changes: Sequence[tuple[float, Pins]], resolved_at: float, now: float,
                state_updated: float, allow: float = ALLOW_S
                ) -> tuple[str, float | None]:
    """Judge one VM. ``changes``: the hosts block's pins each time they changed, as
    (file mtime, pins), in order; ``resolved_at``: the daemon's start or last acted
    SIGUSR1, whichever is later; ``state_updated``: when the stand-in last wrote its
    state. Returns (verdict, the obligation's change time): verdict "ok" (nothing owed,
    or not yet due), "wait" (due, but the state is too old to tell) or the violation."""
    before = [pins for t, pins in changes if t <= resolved_at]
    after = [(t, pins) for t, pins in changes if t > resolved_at]
    if not after:
        return "ok", None
    known = before[-1] if before else None
    if known is not None and after[-1][1] == known:
        return "ok", None
    first = next((t for t, pins in after if pins != known), after[0][0])
    due = first + allow
    if now < due:
        return "ok", first
    if state_updated < due:
        return "wait", first
    return (f"the pins changed at {first:.1f} (now {_pins(after[-1][1])}, were "
            f"{_pins(known)}) and IMEX neither acted on a SIGUSR1 nor started in the "
            f"{allow:.1f} s after (its last resolution {resolved_at:.1f})"), first


def resolved_at(state: Mapping[str, Any], started: float) -> float:
    """The later of the daemon's start and its last acted SIGUSR1 (the state file's log)."""
    acted = [float(e["t"]) for e in state.get("signal_log") or ()
             if isinstance(e, Mapping) and e.get("acted") and isinstance(e.get("t"), (int, float))]
    return max([started, *acted])


def _pins(pins: Pins | None) -> str:
    if pins is None:
        return "unknown"
    return ", ".join(f"{k}={v}" for k, v in sorted(pins.items(), key=lambda kv: str(kv[0])))
