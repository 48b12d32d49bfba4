"""One work queue for every controller of the host agent (client-go's workqueue rules).

A key is queued at most once. While a worker holds it (``get`` made it active), a new
request only marks it dirty, and ``done`` says so, so the worker queues it again: passes
of one key never overlap, and a burst of requests for one key collapses into one pass.
Different keys run in parallel on as many workers as the controller starts.

Delayed requests are one timer per key, kept here and cancelled by ``close``, so
nothing fires after the controller has stopped. Which of two timers of one key wins
is the caller's policy (``earliest``): the reconciler keeps the first (a key backing
off after an error is not retried sooner because a new event came), the status writer
the earliest (a report due now is not held behind a staleness check due later), or,
inside a burst, the last request's (``cancel_timer`` first: served once it is quiet).

Everything runs on the event loop thread; nothing here blocks or raises.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class WorkQueue(Generic[K]):
    def __init__(self) -> None:
        self._queue: asyncio.Queue[K] = asyncio.Queue()
        self._queued: set[K] = set()
        self._active: set[K] = set()
        self._dirty: set[K] = set()
        self._timers: dict[K, asyncio.TimerHandle] = {}

    # -- requests ------------------------------------------------------------

    def add(self, key: K) -> None:
        """Queue ``key`` now; if a worker holds it, mark it dirty instead."""
        if key in self._active:
            self._dirty.add(key)
        elif key not in self._queued:
            self._queued.add(key)
            self._queue.put_nowait(key)

    def add_at(self, key: K, when: float, *, earliest: bool = False) -> None:
        """``add(key)`` at loop time ``when``. A timer the key already has stays, unless
        ``earliest`` and ``when`` comes before it."""
        handle = self._timers.get(key)
        if handle is not None:
            if not earliest or handle.when() <= when:
                return
            handle.cancel()
        self._timers[key] = asyncio.get_running_loop().call_at(when, self._fire, key)

    def add_after(self, key: K, delay: float, *, earliest: bool = False) -> None:
        """``add_at`` ``delay`` seconds from now."""
        self.add_at(key, asyncio.get_running_loop().time() + delay, earliest=earliest)

    def mark_dirty(self, key: K) -> None:
        """The held ``key`` must be looked at again after its pass."""
        self._dirty.add(key)

    def cancel_timer(self, key: K) -> None:
        handle = self._timers.pop(key, None)
        if handle is not None:
            handle.cancel()

    def _fire(self, key: K) -> None:
        self._timers.pop(key, None)
        self.add(key)

    # -- workers ---------------------------------------------------------------

    async def get(self) -> K:
        """The next key; it is active (held by the caller) until ``done``."""
        key = await self._queue.get()
        self._queued.discard(key)
        self._active.add(key)
        return key

    def done(self, key: K) -> bool:
        """The pass of ``key`` ended; True when it was requested meanwhile (dirty).

        The dirty mark is consumed: the caller decides when the key comes back."""
        self._active.discard(key)
        if key in self._dirty:
            self._dirty.discard(key)
            return True
        return False

    # -- state -----------------------------------------------------------------

    def backlog(self) -> int:
        """Keys waiting, held or on a timer: how far behind the workers are."""
        return len(self._queued) + len(self._active) + len(self._timers)

    def is_active(self, key: K) -> bool:
        return key in self._active

    def is_queued(self, key: K) -> bool:
        return key in self._queued

    def has_timer(self, key: K) -> bool:
        return key in self._timers

    def busy(self) -> bool:
        """A key is queued or held (timers aside)."""
        return bool(self._queued or self._active)

    def next_timer(self) -> float | None:
        """Loop time of the earliest timer (None: no timer)."""
        return min((h.when() for h in self._timers.values()), default=None)

    def pending(self) -> int:
        """Keys queued, held or waiting on a timer."""
        return len(self._queued) + len(self._active) + len(self._timers)

    def close(self) -> None:
        """Cancel every timer (the controller stops)."""
        for handle in self._timers.values():
            handle.cancel()
        self._timers.clear()
