"""guest_agent/files/retry.py: one pending retry at most, a doubling delay, reset on success."""

from __future__ import annotations

import asyncio

from guest_agent.files.retry import Retry


def test_a_failure_retries_on_a_doubling_delay_and_success_resets_it() -> None:
    async def scenario() -> tuple[list[float], float, float]:
        loop = asyncio.get_running_loop()
        calls: list[float] = []
        t0 = loop.time()
        retry = Retry(lambda: calls.append(loop.time() - t0), first=0.05, most=0.2)
        for _ in range(4):
            retry.failed()
            retry.failed()  # a second failure before the retry ran schedules nothing more
            await asyncio.sleep(retry.delay)  # delay already doubled: waits past the timer
        most = retry.delay
        retry.failed()
        retry.ok()  # a pass that succeeded cancels the pending retry
        await asyncio.sleep(0.3)
        return calls, most, retry.delay

    calls, most, reset = asyncio.run(scenario())
    assert len(calls) == 4
    gaps = [b - a for a, b in zip([0.0, *calls], calls, strict=False)]
    assert gaps[0] >= 0.05 and gaps[1] >= 0.1 and gaps[2] >= 0.2 and gaps[3] >= 0.2
    assert most == 0.2 and reset == 0.05


def test_outside_an_event_loop_a_failure_schedules_nothing() -> None:
    retry = Retry(lambda: None)
    retry.failed()
    assert retry.delay == 1.0
