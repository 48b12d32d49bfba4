"""The daemon's event loop, run so that a thread stuck in the resolver cannot hold a stop.

``asyncio.open_connection`` to a host *name* resolves it with ``getaddrinfo`` in the loop's
default executor, a thread that cannot be interrupted. When the guest's DNS is unreachable
that call blocks for the resolver's whole timeout (``options timeout:`` x attempts x search
domains: 30 s and more). Cancelling the awaiting task frees the loop at once, but
``asyncio.run()`` then joins the executor on its way out, and the interpreter joins every
executor thread again at exit: a SIGTERM took until the lookup gave up (found by
tests/integration/guest/test_agent_stop.py; the agent's stop watchdog ended it at 20 s).

So :func:`run` closes the loop without waiting for its executor, and :func:`leave` ends the
process at once when such a thread is still blocked, after flushing logs and streams.
Nothing is lost: the thread only ever held a name lookup whose result nobody awaits.

Every task the daemon starts belongs to a TaskGroup, so none outlives the code that
started it. :func:`race` is how a task waits for the first of several things (an answer,
news, a child's exit, a deadline): the racers are tasks of one TaskGroup, the losers are
cancelled and awaited before it returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

T = TypeVar("T")


def _wait_children_by_pidfd() -> None:
    """On Python 3.11, wait for child processes through pidfds, as 3.12 does by default.

    3.11's default child watcher starts a thread for every child (each ``nvidia-imex-ctl``
    query, every IMEX start) to block in ``waitpid``; a pidfd is one more reader on the
    loop. Only from the main thread (where 3.11's policy attaches the watcher to the loop
    that ``set_event_loop`` installs) and only when the kernel has ``pidfd_open`` (5.3+).
    """
    if sys.version_info >= (3, 12) or threading.current_thread() is not threading.main_thread():
        return
    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return
    asyncio.set_child_watcher(asyncio.PidfdChildWatcher())


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, minus the wait for the default executor's threads."""
    loop = asyncio.new_event_loop()
    _wait_children_by_pidfd()
    asyncio.set_event_loop(loop)
    try:
        return loop.run_until_complete(coro)
    finally:
        try:
            left = asyncio.all_tasks(loop)
            for task in left:
                task.cancel()
            if left:
                loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            asyncio.set_event_loop(None)
            loop.close()  # shuts the default executor down without waiting


def stuck_threads() -> list[str]:
    """Threads the interpreter would wait for at exit (executor workers included)."""
    return [t.name for t in threading.enumerate()
            if t is not threading.main_thread() and t.is_alive() and not t.daemon]


def leave(code: int) -> int:
    """Return ``code``, or end the process with it now when a thread would hold the exit."""
    if not stuck_threads():
        return code
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(code)


@dataclass
class Outcome(Generic[T]):
    """How a racer ended: ``done`` (with a value or an exception) or not (cancelled, because
    another racer ended first or the time ran out)."""

    done: bool = False
    value: T | None = None
    error: Exception | None = None

    def result(self) -> T:
        """The value, or the exception raised again (only for a racer that is ``done``)."""
        assert self.done, "the racer did not end"
        if self.error is not None:
            raise self.error
        return cast(T, self.value)


async def race(first: Coroutine[Any, Any, T], *others: Coroutine[Any, Any, object],
               timeout: float | None = None, names: Sequence[str] = ()) -> Outcome[T]:
    """Run ``first`` and ``others`` until one of them ends or ``timeout`` seconds pass.

    The racers are tasks of one TaskGroup (named after ``names``); when this returns, every
    one has ended or was cancelled and awaited. Returns how ``first`` ended; an exception
    of one of ``others`` is raised here. Cancelling the caller cancels every racer.
    """
    racers = (first, *others)
    labels = [*names, *[None] * (len(racers) - len(names))]
    outcomes: list[Outcome[Any]] = [Outcome() for _ in racers]
    ended = asyncio.Event()

    async def run_one(coro: Coroutine[Any, Any, Any], out: Outcome[Any]) -> None:
        try:
            out.value = await coro
        except Exception as exc:  # the caller's to see, not the TaskGroup's
            out.error = exc
        out.done = True
        ended.set()

    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(run_one(coro, out), name=label)
                 for coro, out, label in zip(racers, outcomes, labels, strict=True)]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await ended.wait()
        for task in tasks:
            task.cancel()
    for out in outcomes[1:]:
        if out.error is not None:
            raise out.error
    return cast(Outcome[T], outcomes[0])
