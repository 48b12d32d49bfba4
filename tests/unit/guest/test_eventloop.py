"""eventloop.race: the first of several things, with every racer in one TaskGroup."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

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
