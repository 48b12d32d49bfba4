"""State.wait_for_change: shared wake-ups, timeouts, cancellation, close and drop."""

from __future__ import annotations

import asyncio
import time

from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.timing import measured

A = EnsembleSpec(EnsembleId("gpu", "a"), 4, 50000)
B = EnsembleSpec(EnsembleId("gpu", "b"), 4, 50000)


def seeded() -> tuple[State, int, int]:
    state = State()
    ga = state.set(A, [Member(0, "10.0.0.1")], [])[0].generation
    gb = state.set(B, [Member(0, "10.0.1.1")], [])[0].generation
    return state, ga, gb


async def parked(state: State, n: int) -> None:
    """Let freshly created waiter tasks reach their await."""
    for _ in range(3):
        await asyncio.sleep(0)
    assert state.waiters() >= n


async def test_a_change_wakes_that_ensembles_waiters_only() -> None:
    state, ga, gb = seeded()
    on_a = [asyncio.create_task(state.wait_for_change(A.ens, ga, 30)) for _ in range(3)]
    on_a.append(asyncio.create_task(state.wait_for_change(A.ens, ga, 20)))  # other bucket
    on_b = asyncio.create_task(state.wait_for_change(B.ens, gb, 30))
    await parked(state, 2)
    state.set(A, [Member(0, "10.0.0.2")], [])
    done = await asyncio.gather(*on_a)
    assert {s.generation for s in done if s is not None} == {ga + 1}
    assert len(done) == 4
    assert not on_b.done()
    assert state.waiters() == 1  # only B still has a pending poll
    state.close()
    b_snap = await on_b
    assert b_snap is not None and b_snap.generation == gb


async def test_timeout_answers_the_unchanged_snapshot_not_early() -> None:
    state, ga, _ = seeded()
    started = time.monotonic()
    snap = await state.wait_for_change(A.ens, ga, 0.25)
    took = measured("host.state.wait_own_timeout", time.monotonic() - started)
    assert snap is not None and snap.generation == ga
    # its own timeout, not early (and nowhere near 30 s); measured max 0.35 s quiet and
    # beside stress-ng (15 runs each, 2026-12-02): bound 5 s
    assert 0.25 <= took < 5, took
    assert state.waiters() == 0


async def test_no_wait_when_generation_differs_or_timeout_zero() -> None:
    state, ga, _ = seeded()
    started = time.monotonic()
    assert (await state.wait_for_change(A.ens, ga - 1, 30)).generation == ga  # type: ignore[union-attr]
    assert (await state.wait_for_change(A.ens, ga, 0)).generation == ga  # type: ignore[union-attr]
    assert await state.wait_for_change(EnsembleId("gpu", "none"), 1, 30) is None
    # no wait at all (the alternative is 30 s): measured under 1 ms, also beside stress-ng
    assert measured("host.state.no_wait", time.monotonic() - started) < 0.05


async def test_a_cancelled_waiter_does_not_disturb_its_neighbours() -> None:
    state, ga, _ = seeded()
    victim = asyncio.create_task(state.wait_for_change(A.ens, ga, 30))
    neighbour = asyncio.create_task(state.wait_for_change(A.ens, ga, 30))
    await parked(state, 1)
    victim.cancel()
    await asyncio.gather(victim, return_exceptions=True)
    assert victim.cancelled()
    assert not neighbour.done()
    state.set(A, [Member(0, "10.0.0.3")], [])
    snap = await asyncio.wait_for(neighbour, 10)
    assert snap is not None and snap.generation == ga + 1


async def test_drop_answers_none_and_close_answers_everyone() -> None:
    state, ga, gb = seeded()
    on_a = asyncio.create_task(state.wait_for_change(A.ens, ga, 30))
    on_b = asyncio.create_task(state.wait_for_change(B.ens, gb, 30))
    await parked(state, 2)
    state.drop(A.ens)
    assert await asyncio.wait_for(on_a, 10) is None
    state.close()
    assert (await asyncio.wait_for(on_b, 10)).generation == gb  # type: ignore[union-attr]
    started = time.monotonic()
    assert (await state.wait_for_change(B.ens, gb, 30)).generation == gb  # type: ignore[union-attr]
    # measured under 1 ms, also beside stress-ng (15 runs each, 2026-12-02)
    assert measured("host.state.closed_no_wait", time.monotonic() - started) < 0.05


async def test_ten_thousand_waiters_wake_together() -> None:
    """One change wakes every parked waiter with it and leaves none parked (how fast is
    the registry benchmark's: 5,000 long-polls, the last answer)."""
    state, ga, _ = seeded()
    waiters = [asyncio.create_task(state.wait_for_change(A.ens, ga, 30)) for _ in range(10_000)]
    await parked(state, 1)
    state.set(A, [Member(0, "10.0.0.4")], [])
    answers = await asyncio.wait_for(asyncio.gather(*waiters), 25)  # not their 30 s timeout
    assert all(a is not None and a.generation == ga + 1 for a in answers)
    assert state.waiters() == 0
