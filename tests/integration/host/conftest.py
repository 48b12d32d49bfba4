"""The host agent against the Kubernetes API double, in the test's event loop.

``kube_api`` (tests/sandbox) runs the API double on its own thread; the agent
uses the real lightkube client through a kubeconfig the double wrote. Writes
are counted by the double, so "no spurious write" is measured where it
matters: at the API.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any

import pytest

from host_agent.main import HostAgent
from host_agent.settings import HostSettings
from tests.sandbox.kube_api.fixtures import KubeApiHandle, kube_api_fixture  # noqa: F401

NS = "rack1"


async def eventually(
    check: Callable[[], Any], timeout: float = 10.0, what: str = "condition"
) -> Any:
    """Poll ``check`` until it returns a truthy value (bounded by ``timeout``)."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        await asyncio.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}; last: {last!r}")


@dataclass
class RunningAgent:
    agent: HostAgent
    stop_event: asyncio.Event
    task: asyncio.Task[None]

    async def stop(self) -> None:
        self.stop_event.set()
        async with asyncio.timeout(10):
            await self.task

    async def settled(self, timeout: float = 10.0) -> None:
        """Synced, nothing queued, and the caches caught up with the API."""
        await eventually(lambda: self.agent.state.synced, timeout, "initial sync")
        rec = self.agent.reconciler
        assert rec is not None
        await eventually(lambda: rec.pending() == 0, timeout, "reconciler idle")


AgentFactory = Callable[..., Awaitable[RunningAgent]]


def test_settings(kube_api: KubeApiHandle, **overrides: Any) -> HostSettings:
    base = HostSettings(
        listen_host="127.0.0.1",
        listen_port=0,
        kubeconfig=str(kube_api.kubeconfig_path),
        backoff_initial=0.02,
        backoff_max=0.2,
        settle_seconds=0.02,
        watch_timeout_seconds=30,
        shutdown_grace=1.0,
    )
    return replace(base, **overrides)


test_settings.__test__ = False  # type: ignore[attr-defined]


@pytest.fixture
async def start_agent(kube_api: KubeApiHandle) -> AsyncIterator[AgentFactory]:
    running: list[RunningAgent] = []

    async def start(**overrides: Any) -> RunningAgent:
        agent = HostAgent(test_settings(kube_api, **overrides))
        stop = asyncio.Event()
        task = asyncio.create_task(agent.run(stop))
        r = RunningAgent(agent, stop, task)
        running.append(r)
        await eventually(lambda: agent.serving.is_set() or task.done(), 5, "agent start")
        return r

    try:
        yield start
    finally:
        for r in running:
            if not r.task.done():
                await r.stop()


@pytest.fixture
def api(kube_api: KubeApiHandle) -> KubeApiHandle:
    kube_api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    return kube_api
