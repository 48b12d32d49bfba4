"""The report writers: each replica's coalesced writes of reports into their ConfigMap.

What is written, why and when is reports.py's to say (its docstring has the whole
story); this module does it. ``persist`` returns once a write holding the report
(or a later one of it) has landed, at once for a heartbeat without news, which is
held and rides along the ensemble's next write. Per ensemble there is one writer
task at a time, and every writer task lives in the TaskGroup of ``run``, which the
agent runs beside its other loops; when ``run`` ends, whoever still waits is
answered with ``ReportsNotPersisted`` (the registry answers 503, the guest retries).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from host_agent.persist.reports import (
    ENSEMBLE_ANNOTATION,
    FIELD_MANAGER,
    REPORTS_LABEL,
    configmap_name,
    encode_report,
    persist_reason,
    riders,
)
from host_agent.state.snapshot import GuestReport
from imex_shared.model import EnsembleId

log = logging.getLogger("imex.host.reports")


class ReportsNotPersisted(Exception):
    """The report is shown by this replica but is not in the API yet."""


@dataclass
class _Batch:
    data: dict[str, str] = field(default_factory=dict)
    done: asyncio.Future[None] | None = None


class ReportPersister:
    """Coalesced, per-ensemble writes of reports into their ConfigMap (module docstring)."""

    def __init__(self, client: Any, namespace: str, *, interval: float = 0.5,
                 clock: Callable[[], float] = time.monotonic,
                 persisted: Callable[[EnsembleId], Mapping[int, GuestReport]] | None = None,
                 refresh_after: float = 0.0,
                 on_decision: Callable[[str], None] | None = None,
                 on_write: Callable[[], None] | None = None) -> None:
        self._client = client
        self.namespace = namespace
        self.interval = interval
        self.refresh_after = refresh_after
        self._clock = clock
        self._persisted = persisted or (lambda _ens: {})
        self._on_decision = on_decision or (lambda _decision: None)
        self._on_write = on_write or (lambda: None)
        self._pending: dict[EnsembleId, _Batch] = {}
        self._held: dict[EnsembleId, dict[int, GuestReport]] = {}
        self._last_write: dict[EnsembleId, float] = {}
        self._writing: set[EnsembleId] = set()
        #: ensembles whose writer task ``run`` is to start
        self._starts: asyncio.Queue[EnsembleId] = asyncio.Queue()
        self.writes = 0
        self.reports = 0
        #: reports answered without a write of their own, and why the others were written
        self.held = 0
        self.reasons: dict[str, int] = {}

    async def persist(self, ens: EnsembleId, index: int, report: GuestReport, *,
                      since: float = float("-inf")) -> None:
        """Returns once a write holding this report (or a later one of it) has landed;
        at once for a heartbeat without news (``persist_reason``), which is held and
        rides along the ensemble's next write."""
        self.reports += 1
        reason = persist_reason(report, self._persisted(ens).get(index), since=since,
                                refresh_after=self.refresh_after)
        if reason is None:
            self._on_decision("held")
            self.held += 1
            self._held.setdefault(ens, {})[index] = report
            return
        await asyncio.shield(self._enqueue(ens, index, report, reason))

    def write_back(self, ens: EnsembleId, index: int, report: GuestReport
                   ) -> asyncio.Future[None]:
        """Write ``report``, which this replica shows and which is later than the copy
        that just landed in the API with other content (``reports.after_api_change``).
        The agent does not wait for it (the future is the write's); if the write fails,
        the member's next report with news (against the older copy, now in the
        informer) is written as usual."""
        log.info("reports: %s member %d: an older report landed over the one this replica "
                 "holds; writing it back", ens.key, index)
        return self._enqueue(ens, index, report, "newer")

    def _enqueue(self, ens: EnsembleId, index: int, report: GuestReport, reason: str
                 ) -> asyncio.Future[None]:
        """Put ``report`` in the ensemble's next write, counted under ``reason``; the
        future is that write's."""
        self._on_decision(reason)
        self.reasons[reason] = self.reasons.get(reason, 0) + 1
        held = self._held.get(ens)
        if held is not None:
            held.pop(index, None)
        loop = asyncio.get_running_loop()
        batch = self._pending.get(ens)
        if batch is None:
            batch = self._pending[ens] = _Batch(done=loop.create_future())
        batch.data[str(index)] = encode_report(report)
        assert batch.done is not None
        if ens not in self._writing:
            self._writing.add(ens)  # one writer task per ensemble at a time
            self._starts.put_nowait(ens)
        return batch.done

    async def run(self) -> None:
        """Own every ensemble's writer task (one TaskGroup): ``persist`` hands an ensemble
        over and its task runs until nothing waits to be written for it."""
        try:
            async with asyncio.TaskGroup() as tg:
                while True:
                    ens = await self._starts.get()
                    tg.create_task(self._drain(ens), name=f"reports {ens.key}")
        finally:  # stopping: whoever still waits is answered (503; the guest retries)
            for batch in self._pending.values():
                if batch.done is not None and not batch.done.done():
                    batch.done.set_exception(ReportsNotPersisted("the agent is stopping"))
                    batch.done.exception()

    async def _drain(self, ens: EnsembleId) -> None:
        try:
            while ens in self._pending:
                wait = self._last_write.get(ens, float("-inf")) + self.interval - self._clock()
                if wait > 0:
                    await asyncio.sleep(wait)  # reports arriving meanwhile join the batch
                batch = self._pending.pop(ens)
                self._last_write[ens] = self._clock()
                assert batch.done is not None
                try:
                    held = self._held.pop(ens, None)
                    if held:
                        for i, report in riders(held, self._persisted(ens)).items():
                            batch.data.setdefault(str(i), encode_report(report))
                    await self._write(ens, batch.data)
                except Exception as exc:  # the waiters answer 503; guests retry
                    if not batch.done.done():
                        batch.done.set_exception(ReportsNotPersisted(str(exc)))
                        batch.done.exception()  # retrieved: no "never retrieved" warning
                else:
                    if not batch.done.done():
                        batch.done.set_result(None)
        finally:
            self._writing.discard(ens)

    def forget(self, ens: EnsembleId) -> None:
        """An ensemble that is gone: drop what is held for it (a write in flight ends)."""
        self._held.pop(ens, None)
        if ens not in self._writing:
            self._last_write.pop(ens, None)

    async def _write(self, ens: EnsembleId, data: dict[str, str]) -> None:
        from host_agent.kube.client import KubeError, api_call

        name = configmap_name(ens)
        path = f"/api/v1/namespaces/{self.namespace}/configmaps"
        params = {"fieldManager": FIELD_MANAGER}
        try:
            await api_call(self._client, "PATCH", f"{path}/{name}", body={"data": data},
                           content_type="application/merge-patch+json", params=params,
                           timeout=5.0)
        except KubeError as exc:
            if exc.status != 404:
                raise
            body = {"apiVersion": "v1", "kind": "ConfigMap",
                    "metadata": {"name": name, "namespace": self.namespace,
                                 "labels": {REPORTS_LABEL: "true",
                                            "app.kubernetes.io/managed-by": "imex-host-agent"},
                                 "annotations": {ENSEMBLE_ANNOTATION: ens.key}},
                    "data": data}
            try:
                await api_call(self._client, "POST", path, body=body, params=params,
                               timeout=5.0)
            except KubeError as again:
                if again.status != 409:
                    raise
                await api_call(self._client, "PATCH", f"{path}/{name}", body={"data": data},
                               content_type="application/merge-patch+json", params=params,
                               timeout=5.0)
        self.writes += 1
        self._on_write()
