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
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import sys
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run(coro)``, minus the wait for the default executor's threads."""
    loop = asyncio.new_event_loop()
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
