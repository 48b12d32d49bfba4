"""Long-poll over real HTTP: wake-up latency, timeouts, the cap, 1,000 waiters, shutdown.

Waiters are counted by the registry's own gauge, so each test changes the
state only once every request is known to be parked.
"""

from __future__ import annotations

import asyncio
import json
import statistics
import time

import httpx

from host_agent.registry.config import RegistryConfig
from imex_shared.model import Member
from tests.integration.registry.registry_harness import (
    ENS,
    MEMBERS,
    SPEC,
    Running,
    seeded_state,
    serve,
)
from tests.timing import measured

BASE = "/v1/ensembles/gpu/gb200"
WAITERS = "imex_registry_longpoll_waiters"


def generation(reg: Running) -> int:
    snap = reg.state.get(ENS)
    assert snap is not None
    return snap.generation


def move_member_2(reg: Running, ip: str) -> None:
    reg.state.set(SPEC, [MEMBERS[0], Member(2, ip, "gb200-2", "node-b", "Running", True)], [])


async def test_long_poll_answers_within_50ms_of_a_change(registry: Running) -> None:
    latencies = []
    async with httpx.AsyncClient(base_url=registry.url) as client:
        for round_ in range(5):
            g = generation(registry)
            poll = asyncio.create_task(client.get(BASE, params={"wait": g, "timeout": 30}))
            await registry.until(lambda: registry.sample(WAITERS) == 1)
            changed_at = time.perf_counter()
            move_member_2(registry, f"10.213.1.{round_ + 1}")
            response = await poll
            latencies.append(measured("registry.longpoll.wake", time.perf_counter() - changed_at))
            assert response.status_code == 200
            body = response.json()
            assert body["generation"] == g + 1
            assert body["members"][1]["ip"] == f"10.213.1.{round_ + 1}"
    print(f"long-poll wake latency: median {statistics.median(latencies) * 1000:.1f} ms, "
          f"max {max(latencies) * 1000:.1f} ms")  # fmt: skip
    # The median meets the 50 ms contract; the max is bounded for one scheduling hiccup.
    # Measured 2026-12-02, 75 wakes each, at load average 15-19 from other jobs and
    # beside stress-ng: median 2 ms both, max 15 ms and 20 ms. Bounds kept: 50 ms, 0.25 s.
    assert statistics.median(latencies) < 0.05
    assert max(latencies) < 0.25


async def test_a_change_that_keeps_the_map_does_not_wake(registry: Running) -> None:
    g = generation(registry)
    async with httpx.AsyncClient(base_url=registry.url) as client:
        poll = asyncio.create_task(client.get(BASE, params={"wait": g, "timeout": 0.5}))
        await registry.until(lambda: registry.sample(WAITERS) == 1)
        registry.state.set(SPEC, MEMBERS, ["a new problem, same members"])
        started = time.perf_counter()
        response = await poll
    assert time.perf_counter() - started > 0.3  # held until its timeout
    assert response.json()["generation"] == g
    assert response.json()["problems"] == ["a new problem, same members"]


async def test_long_poll_times_out_with_the_current_state(registry: Running) -> None:
    g = generation(registry)
    async with httpx.AsyncClient(base_url=registry.url) as client:
        started = time.perf_counter()
        response = await client.get(BASE, params={"wait": g, "timeout": 0.3})
        took = measured("registry.longpoll.own_timeout", time.perf_counter() - started)
        assert response.status_code == 200 and response.json()["generation"] == g
        # its own timeout, not early, not the 30 s below; measured max 0.41 s, 0.49 s
        # beside stress-ng (15 runs each, 2026-12-02): bound 10 s
        assert 0.3 <= took < 10, took
        stale_wait = await client.get(BASE, params={"wait": g - 5, "timeout": 30})
        assert stale_wait.json()["generation"] == g  # differs already: answered at once
        text = await client.get(f"{BASE}/nodes_config", params={"wait": g - 1, "mode": "ips"})
        assert text.headers["x-imex-generation"] == str(g)


async def test_timeout_is_capped() -> None:
    config = RegistryConfig(longpoll_cap=0.4)
    async with serve(seeded_state(), config) as reg, httpx.AsyncClient(base_url=reg.url) as client:
        started = time.perf_counter()
        response = await client.get(BASE, params={"wait": generation(reg), "timeout": 3600})
        took = measured("registry.longpoll.cap", time.perf_counter() - started)
    assert response.status_code == 200
    # the cap, not the hour asked for; measured max 0.52 s quiet and loaded: bound 60 s
    assert 0.4 <= took < 60, took


async def test_deleted_while_waiting_is_404(registry: Running) -> None:
    async with httpx.AsyncClient(base_url=registry.url) as client:
        poll = asyncio.create_task(
            client.get(BASE, params={"wait": generation(registry), "timeout": 30})
        )
        await registry.until(lambda: registry.sample(WAITERS) == 1)
        registry.state.drop(ENS)
        response = await poll
    assert response.status_code == 404
    assert response.json()["error"] == "ensemble gpu/gb200 was deleted while you waited"


async def _raw_long_poll(port: int, path: str) -> tuple[int, dict[str, object]]:
    """One HTTP/1.1 request on its own connection (lighter than a client library x1000)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: t\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        raw = await reader.read()
    finally:
        writer.close()
    head, _, body = raw.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


async def test_a_thousand_long_polls_all_answered_after_one_change(registry: Running) -> None:
    n = 1000
    g = generation(registry)
    path = f"{BASE}?wait={g}&timeout=30"
    polls = [asyncio.create_task(_raw_long_poll(registry.port, path)) for _ in range(n)]
    try:
        await registry.until(lambda: registry.sample(WAITERS) == n, within=20)
        changed_at = time.perf_counter()
        move_member_2(registry, "10.213.2.2")
        answers = await asyncio.wait_for(asyncio.gather(*polls), 10)
        took = measured("registry.longpoll.thousand", time.perf_counter() - changed_at)
    finally:
        for poll in polls:
            poll.cancel()
    print(f"{n} long-polls answered {took * 1000:.0f} ms after one change")
    assert [status for status, _ in answers] == [200] * n
    assert {body["generation"] for _, body in answers} == {g + 1}
    assert registry.sample(WAITERS) == 0
    # measured median 1.5 s and 1.2 s, max 2.3 s and 3.3 s beside stress-ng (15 runs each,
    # 2026-12-02; the 3 s this had failed 1 in 15 loaded): bound 8 s, inside the
    # answers' 10 s deadline and far below the 30 s each poll asked for
    assert took < 8.0, took


async def test_shutdown_answers_pending_long_polls() -> None:
    async with serve(seeded_state()) as reg:
        g = generation(reg)
        async with httpx.AsyncClient(base_url=reg.url) as client:
            poll = asyncio.create_task(client.get(BASE, params={"wait": g, "timeout": 30}))
            await reg.until(lambda: reg.sample(WAITERS) == 1)
            started = time.perf_counter()
            reg.server.should_exit = True
            response = await poll
            await asyncio.wait_for(reg.task, 5)
            took = measured("registry.longpoll.shutdown", time.perf_counter() - started)
    assert response.status_code == 200 and response.json()["generation"] == g
    # not the 30 s the poll asked for; measured max 0.21 s, 0.25 s beside stress-ng
    # (15 runs each, 2026-12-02): bound 2 s
    assert took < 2.0, took
