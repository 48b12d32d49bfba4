"""eventloop.race: the first of several things, with every racer in one TaskGroup; and
eventloop.run's child watcher."""

from __future__ import annotations

import asyncio
import contextlib
import sys
import threading

import pytest

from guest_agent import eventloop
from guest_agent.eventloop import race


async def answer(value: str, after: float) -> str:
    await asyncio.sleep(after)
    return value


async def fail(after: float) -> str:
    await asyncio.sleep(after)
    raise ValueError("broken")


def racers() -> set[str]:
    return {t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("racer")}


async def test_the_first_to_end_wins_and_the_others_are_cancelled_and_awaited() -> None:
    cancelled = asyncio.Event()

    async def slow() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    won = await race(answer("yes", 0.01), slow(), names=("racer-main", "racer-slow"))
    assert won.done and won.result() == "yes"
    assert cancelled.is_set() and not racers()
    news = asyncio.Event()
    asyncio.get_running_loop().call_soon(news.set)
    lost = await race(answer("late", 30), news.wait(), names=("racer-main",))
    assert not lost.done and not racers()


async def test_a_timeout_cancels_every_racer() -> None:
    out = await race(answer("late", 30), asyncio.Event().wait(), timeout=0.05,
                     names=("racer-a", "racer-b"))
    assert not out.done and not racers()
    out = await race(answer("now", 0), timeout=0)
    assert out.done and out.result() == "now"


async def test_exceptions_reach_the_caller_unwrapped() -> None:
    out = await race(fail(0), asyncio.Event().wait())
    assert out.done and isinstance(out.error, ValueError)
    with pytest.raises(ValueError, match="broken"):
        out.result()
    with pytest.raises(ValueError, match="broken"):  # not an ExceptionGroup
        await race(asyncio.Event().wait(), fail(0))


async def test_cancelling_the_caller_cancels_the_racers() -> None:
    started = asyncio.Event()

    async def slow() -> None:
        started.set()
        await asyncio.sleep(30)

    caller = asyncio.create_task(race(slow(), asyncio.Event().wait(),
                                      names=("racer-a", "racer-b")))
    await started.wait()
    caller.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await caller
    assert caller.cancelled() and not racers()


def test_run_waits_for_a_child_without_a_thread_for_it() -> None:
    """Python 3.11's default watcher blocks a new thread in waitpid for every child;
    eventloop.run waits through a pidfd (3.12's default), so a running child adds no
    thread to the process, and its exit code still arrives."""

    async def child() -> tuple[int, int]:
        before = threading.active_count()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-c", "import time; time.sleep(0.2); raise SystemExit(3)")
        added = threading.active_count() - before
        return added, await proc.wait()

    assert threading.current_thread() is threading.main_thread()
    assert eventloop.run(child()) == (0, 3)
