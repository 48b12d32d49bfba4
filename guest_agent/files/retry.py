"""A write that failed is tried again by itself, on a doubling delay.

A pass that could not write its files (a full disk, a read-only file system) cannot wait
for the next view: on the registry path that is the next membership change, which may
be hours away, so a VM filled at boot would keep an empty nodes file long after the
space came back (the soak found it, docs/reliability.md). :class:`Retry` calls the pass
again 1 s later, then after 2, 4, 8, 16 and every 30 s, until one succeeds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

FIRST_S = 1.0
MOST_S = 30.0


class Retry:
    """One pending call of ``again`` at most; :meth:`ok` cancels it and resets the delay."""

    def __init__(self, again: Callable[[], object], first: float = FIRST_S,
                 most: float = MOST_S) -> None:
        self._again, self._first, self._most = again, first, most
        self.delay = first
        self._timer: asyncio.TimerHandle | None = None

    def failed(self) -> None:
        """Schedule ``again`` after the current delay (outside a loop: nothing to do,
        the caller reports the error), and double the next delay."""
        if self._timer is not None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            return
        self._timer = loop.call_later(self.delay, self._fire)
        self.delay = min(self.delay * 2, self._most)

    def ok(self) -> None:
        self.delay = self._first
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _fire(self) -> None:
        self._timer = None
        self._again()
