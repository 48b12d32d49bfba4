"""What the guest agent needs as a daemon process, apart from its work.

Logs a person can read (or ``--json`` for machines), systemd's notify socket,
a watchdog that ends a shutdown that hangs, and a cancel that sticks on Python
3.11. Nothing here knows about ensembles or IMEX.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import logging
import os
import socket
import sys
import threading
import traceback
from collections.abc import Coroutine
from typing import Any

from imex_shared.jsonlog import JsonFormatter

log = logging.getLogger("guest_agent")

#: The agent's exit codes: 3 is ``once`` when it learned nothing (no View).
EXIT_OK = 0
EXIT_FAILED = 1
EXIT_NOTHING_LEARNED = 3


# --- logging -------------------------------------------------------------------


def setup_logging(as_json: bool, level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if as_json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(
            logging.Formatter("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # watchfiles logs every batch of changes at INFO; our own line says what mattered.
    logging.getLogger("watchfiles").setLevel(logging.WARNING)


# --- systemd notify ----------------------------------------------------------------


def sd_notify(message: str) -> bool:
    """Send ``message`` to systemd's NOTIFY_SOCKET (Type=notify); False when not under systemd."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as sock:
            sock.sendto(message.encode(), path)
    except OSError as exc:
        log.warning("sd_notify failed: %s", exc)
        return False
    return True


# --- shutdown watchdog -----------------------------------------------------------------

#: SIGTERM must end the agent: the IMEX child gets up to 10 s, the rest is margin
#: (systemd's TimeoutStopSec is 30 s).
STOP_DEADLINE = 20.0


def stop_watchdog(seconds: float) -> threading.Timer:
    """A thread that ends the process if shutdown hangs, after dumping every stack.

    It runs outside the event loop, so it fires even when a task swallowed its
    cancellation or something blocks the loop; the stacks say which.
    """

    def fire() -> None:
        log.error("shutdown did not finish within %gs; dumping stacks and exiting", seconds)
        with contextlib.suppress(Exception):
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        os._exit(EXIT_FAILED)

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    return timer


async def cancel_all(tasks: list[asyncio.Task[Any]], every: float = 0.5) -> None:
    """Cancel ``tasks`` and make it stick.

    On Python 3.11 a cancellation can be lost when it races with a timeout or
    an inner future finishing at the same moment (``wait_for``, ``timeout``);
    the task then carries on and the TaskGroup would wait for it forever. So
    a task still running ``every`` seconds after its cancel is cancelled
    again, with its stack logged once. (The file watcher's thread has seen
    the stop event already and returns within one step.)
    """
    for t in tasks:
        t.cancel()
    logged: set[str] = set()
    while pending := [t for t in tasks if not t.done()]:
        await asyncio.wait(pending, timeout=every)
        for t in pending:
            if t.done():
                continue
            if t.get_name() not in logged:
                logged.add(t.get_name())
                stack = "".join(traceback.format_list(
                    [traceback.FrameSummary(f.f_code.co_filename, f.f_lineno, f.f_code.co_name)
                     for f in t.get_stack()]))
                log.warning("task %s survived its cancellation; cancelling again\n%s",
                            t.get_name(), stack)
            t.cancel()


async def run_all(coros: dict[str, Coroutine[Any, Any, None]]) -> None:
    """Run ``coros`` (name -> coroutine) as tasks of one TaskGroup, for a task that runs
    tasks of its own; when this is cancelled, end them with :func:`cancel_all` first.

    A TaskGroup alone cancels its children once, and a second cancellation of its owner
    (``cancel_all``'s repeat) does not reach them: a child that lost the first one kept
    the owner, and the agent's shutdown, waiting until the watchdog (seen under load:
    discovery's DNS loop, 20 s, exit 1). Here the repeats reach the children; the
    owner's own repeats are absorbed until they are done, then its cancellation goes on.
    """
    async with asyncio.TaskGroup() as tg:
        tasks = [tg.create_task(coro, name=name) for name, coro in coros.items()]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            while not all(t.done() for t in tasks):
                with contextlib.suppress(asyncio.CancelledError):
                    await cancel_all(tasks)
            raise
