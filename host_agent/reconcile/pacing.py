"""How long an ensemble's event waits before its pass: the reconciler's pacing.

Three cases, decided per event (``Pacing.wait``):
- behind a backlog (``BUSY_BACKLOG_PER_WORKER`` keys per worker waiting, held or
  settling): ``BUSY_SETTLE_SECONDS``, so a storm's changes to one ensemble share a
  pass and its writes rather than each paying them;
- the ensemble has been quiet for ``quiet_seconds``: no wait at all. An isolated
  change (one VM's new address) has no company coming, and every guest is waiting;
- otherwise (an event inside a burst): ``settle_seconds``, so the rest of the burst
  joins one pass. A burst therefore costs at most two passes: its first event's, and
  the settled rest's.

Only the time of each key's last event is kept; clock and backlog are arguments, so
the decision is a pure function of them.
"""

from __future__ import annotations

from collections.abc import Hashable

#: Behind by this many keys per worker (waiting, held or settling), a key settles longer
BUSY_BACKLOG_PER_WORKER = 2
BUSY_SETTLE_SECONDS = 1.0
#: Past this many remembered keys, the ones no longer inside a burst are dropped.
LAST_EVENT_LIMIT = 8192


class Pacing:
    """The settle decision, and the one piece of memory it needs (last event times)."""

    def __init__(self, settle_seconds: float, quiet_seconds: float, workers: int) -> None:
        self._settle = settle_seconds
        self._quiet = quiet_seconds
        self._busy_at = BUSY_BACKLOG_PER_WORKER * max(1, workers)
        self._last: dict[Hashable, float] = {}
        self._limit = LAST_EVENT_LIMIT

    def wait(self, key: Hashable, now: float, backlog: int) -> float:
        """Seconds ``key``'s event waits before its pass; records the event."""
        last = self._last.get(key)
        if len(self._last) >= self._limit:  # amortized: the limit follows what is kept
            self._last = {k: t for k, t in self._last.items() if now - t < self._quiet}
            self._limit = max(LAST_EVENT_LIMIT, 2 * len(self._last))
        self._last[key] = now
        if backlog >= self._busy_at:
            return max(self._settle, BUSY_SETTLE_SECONDS)
        if last is None or now - last >= self._quiet:
            return 0.0
        return self._settle
