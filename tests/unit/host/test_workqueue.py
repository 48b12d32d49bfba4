"""The one work queue: a key at most once, dirty while held, one timer per key."""

from __future__ import annotations

import asyncio

from host_agent.workqueue import WorkQueue


async def test_a_key_is_queued_once_and_a_request_while_held_marks_it_dirty() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add("a")
    q.add("a")
    q.add("b")
    assert q.pending() == 2
    assert await q.get() == "a"
    assert q.is_active("a") and not q.is_queued("a")
    q.add("a")  # while held: dirty, not queued a second time
    assert not q.is_queued("a")
    assert q.done("a") is True  # the caller queues it again
    assert q.done("a") is False  # the mark is consumed
    assert await q.get() == "b"
    assert q.done("b") is False
    assert q.pending() == 0 and not q.busy()


async def test_the_first_timer_stays_unless_the_caller_asks_for_the_earliest() -> None:
    q: WorkQueue[str] = WorkQueue()
    now = asyncio.get_running_loop().time()
    q.add_at("a", now + 10)
    q.add_at("a", now + 0.01)  # the reconciler's rule: a backing-off key keeps its place
    assert q.next_timer() == now + 10
    q.add_at("a", now + 0.01, earliest=True)  # the status writer's rule
    assert q.next_timer() == now + 0.01
    q.add_at("a", now + 5, earliest=True)  # a later one never replaces a sooner one
    assert q.next_timer() == now + 0.01
    async with asyncio.timeout(2):
        assert await q.get() == "a"
    assert not q.has_timer("a")


async def test_close_cancels_every_timer() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0.01)
    q.add_after("b", 0.01)
    q.close()
    assert q.pending() == 0
    await asyncio.sleep(0.05)
    assert not q.is_queued("a") and not q.is_queued("b")


async def test_a_cancelled_timer_never_fires() -> None:
    q: WorkQueue[str] = WorkQueue()
    q.add_after("a", 0.01)
    q.cancel_timer("a")
    await asyncio.sleep(0.05)
    assert q.pending() == 0
