"""Report ConfigMap writes per second for 1,000 ensembles x 18 quiet members (part of domain).

Figures (``report_writes_per_s_before`` / ``report_writes_per_s``, and ``_ratio``): the
real ``ReportPersister`` of one replica receiving every member's heartbeat (a report
every 10 s with nothing changed, random phase, 0-0.2 s of jitter) for 1,000 ensembles
x 18 members, counting the merge patches it sends; *before* writes every report (the
behaviour until heartbeats were told apart: ``refresh_after=0``), *after* is the
product's setting (``--report-stale-after`` 120 s, refresh at a third). Also
``report_writes_per_s_2_replicas``: the same with each member pinned to one of two
replicas (its keep-alive connection), both writing into one API.

In process, in virtual time: an event loop whose clock jumps to the next timer (the
persister's 1 s coalescing sleeps are real ``asyncio.sleep`` calls), and each write
lands at once in the dict the persister reads as its informer's copy (the watch lag
on a real apiserver is milliseconds against 10 s heartbeats). Steady state only: the
first writes of every member are left out (the window starts after 60 s).
"""

from __future__ import annotations

import asyncio
import random
import selectors
from collections.abc import Coroutine
from typing import Any

from host_agent.persist.reports import REFRESH_FRACTION, decode_report
from host_agent.persist.reports_io import ReportPersister
from host_agent.state.snapshot import GuestReport
from imex_shared.model import EnsembleId
from tests.bench.common import Results

INTERVAL = 10.0
STALE_AFTER = 120.0
EPOCH = 1_795_974_000.0
FIELDS: dict[str, Any] = {
    "imex_state": "READY", "generation_applied": 7, "signals": 0, "restarts": 0,
    "nodes_config_sha256": "a" * 64, "hosts_sha256": "b" * 64, "agent_version": "0.2.0",
    "cert_not_after": None, "imex_channel0": True,
    "fabric": {"cluster_uuid": "5e1f0c2a-7b3d-4c8e-9a61-2d4f8b0e3c17", "clique_id": 1}}


class _JumpSelector(selectors.DefaultSelector):
    """No I/O: a wait for ``timeout`` moves the virtual clock by it at once."""

    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0

    def select(self, timeout: float | None = None) -> list[Any]:
        if timeout is None:
            raise RuntimeError("virtual loop: nothing scheduled and nothing ready")
        self.now += max(0.0, timeout)
        return []


class _VirtualLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        self._jump = _JumpSelector()
        super().__init__(self._jump)

    def time(self) -> float:
        return self._jump.now


class _Api:
    """The reports ConfigMaps as every replica's informer shows them (no lag)."""

    def __init__(self) -> None:
        self.data: dict[EnsembleId, dict[int, GuestReport]] = {}

    def of(self, ens: EnsembleId) -> dict[int, GuestReport]:
        return self.data.get(ens, {})


class _Replica(ReportPersister):
    def __init__(self, api: _Api, loop: asyncio.AbstractEventLoop, refresh_after: float,
                 window_from: float) -> None:
        super().__init__(None, "imex-system", clock=loop.time, persisted=api.of,
                         refresh_after=refresh_after)
        self._api, self._loop, self._from = api, loop, window_from
        self.counted = 0

    async def _write(self, ens: EnsembleId, data: dict[str, str]) -> None:
        into = self._api.data.setdefault(ens, {})
        for k, v in data.items():
            report = decode_report(v)
            assert report is not None
            into[int(k)] = report
        self.writes += 1
        if self._loop.time() >= self._from:
            self.counted += 1


def simulate(ensembles: int, members: int, *, refresh_after: float, replicas: int,
             seconds: float, window_from: float, seed: int = 17) -> float:
    """ConfigMap writes per second (all replicas) between ``window_from`` and ``seconds``."""
    loop = _VirtualLoop()
    api = _Api()
    fleet = [_Replica(api, loop, refresh_after, window_from) for _ in range(replicas)]
    rng = random.Random(seed)
    links = tuple(None if j == 0 else "CONNECTED" for j in range(members))

    async def guest(ens: EnsembleId, index: int, replica: _Replica) -> None:
        ip = f"10.{index}.{hash(ens.name) % 250}.1"
        at = rng.uniform(0, INTERVAL)
        while at < seconds:
            await asyncio.sleep(at - loop.time())
            report = GuestReport(EPOCH + loop.time(), ip, FIELDS, links)
            await replica.persist(ens, index, report)  # the next only after the answer
            at = loop.time() + INTERVAL + rng.uniform(0, 0.2)

    async def main() -> None:
        # each replica's writer tasks, as the agent runs them (persist hands over to run)
        writers = [asyncio.create_task(r.run()) for r in fleet]
        tasks: list[Coroutine[Any, Any, None]] = []
        for e in range(ensembles):
            ens = EnsembleId("bench", f"e{e}")
            for i in range(members):
                tasks.append(guest(ens, i, fleet[rng.randrange(replicas)]))
        try:
            await asyncio.gather(*tasks)
        finally:
            for w in writers:
                w.cancel()
            await asyncio.gather(*writers, return_exceptions=True)

    try:
        loop.run_until_complete(main())
    finally:
        loop.close()
    return sum(r.counted for r in fleet) / (seconds - window_from)


def run(results: Results, quick: bool) -> None:
    ensembles = 50 if quick else 1000
    refresh = STALE_AFTER * REFRESH_FRACTION
    before = simulate(ensembles, 18, refresh_after=0.0, replicas=1, seconds=90,
                      window_from=60) * 1000 / ensembles
    # five refresh cycles (30 s each) after the first writes
    after = simulate(ensembles, 18, refresh_after=refresh, replicas=1, seconds=210,
                     window_from=60) * 1000 / ensembles
    two = simulate(ensembles, 18, refresh_after=refresh, replicas=2, seconds=210,
                   window_from=60) * 1000 / ensembles
    results.set("report_writes_per_s_before", before)
    results.set("report_writes_per_s", after)
    results.set("report_writes_per_s_2_replicas", two)
    results.set("report_writes_ratio", before / after if after else None)
    scaled = " (scaled to 1,000)" if ensembles != 1000 else ""
    results.note("report_writes", f"{ensembles} ensembles x 18 simulated{scaled}, "
                 f"heartbeat {INTERVAL:g}s, refresh {refresh:g}s, virtual time")
