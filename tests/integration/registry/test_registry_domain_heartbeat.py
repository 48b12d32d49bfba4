"""The guest's reporter against a real registry on loopback: a heartbeat without
``imex_domain`` keeps the member's link row (``/domain`` stays UP), a changed link
arrives with the very next report, and failures or a minute make it send the view again.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import ipaddress
from pathlib import Path
from typing import Any

import httpx
import pytest

from guest_agent import http
from guest_agent.config import Settings
from guest_agent.report.report import DOMAIN_REFRESH, Report
from guest_agent.report.report_io import Reporter
from host_agent.registry.config import RegistryConfig
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import TOKEN, serve
from tests.unit.shared.test_imex_domain import domain_doc

ENS = EnsembleId("gpu", "hb")
BASE = "/v1/ensembles/gpu/hb"
# member 0 is the real reporter (it can only call from 127.0.0.1); 1 reports through
# httpx with X-Forwarded-For from a trusted loopback proxy
TRUSTED = RegistryConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
IPS = ["127.0.0.1", "10.213.0.11"]


def state_of() -> State:
    state = State()
    spec = EnsembleSpec(ENS, 2, 50000, token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
    state.set(spec, [Member(i, ip) for i, ip in enumerate(IPS)], [])
    state.mark_synced()
    return state


def view(stamp: int, lost: bool = False) -> dict[str, Any]:
    doc = domain_doc(2)
    doc["timestamp"] = stamp  # IMEX stamps every print: not a change
    if lost:
        doc["nodes"]["0"]["connections"]["1"]["status"] = "DISCONNECTED"
        doc["status"] = "DEGRADED"
    return doc


def body(doc: dict[str, Any] | None, **extra: Any) -> dict[str, Any]:
    return {"imex_state": "READY", "nodes_config_sha256": "c" * 64, "imex_domain": doc,
            **extra}


async def domain(c: httpx.AsyncClient) -> dict[str, Any]:
    r = await c.get(f"{BASE}/domain")
    assert r.status_code == 200, r.text
    doc: dict[str, Any] = r.json()
    return doc


@pytest.fixture
def token_file(tmp_path: Path) -> str:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return str(path)


async def test_heartbeats_keep_the_row_and_changes_arrive_with_the_next_report(
    token_file: str,
) -> None:
    state = state_of()
    now = [5000.0]
    async with serve(state, TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        settings = Settings(ensemble="hb", namespace="gpu", max_members=2,
                            registry_url=reg.url, token_file=token_file)
        reporter = Reporter(settings, clock=lambda: now[0])
        r = await c.put(f"{BASE}/members/1/status", json=body(view(1)), headers={
            "Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": IPS[1]})
        assert r.status_code == 200, r.text

        await reporter.send(Report(0, body(view(1))))  # the first report carries it
        assert (reporter.domain_sent, reporter.domain_left_out) == (1, 0)
        assert (await domain(c))["status"] == "UP"
        snap = state.get(ENS)
        assert snap is not None
        row, first_at = snap.reports[0].links, snap.reports[0].received_at
        assert row is not None and row[1] == "CONNECTED"

        for k in range(4):  # heartbeats, the view unchanged but for its timestamp
            now[0] += 10
            await reporter.send(Report(0, body(view(2 + k))))
        assert (reporter.domain_sent, reporter.domain_left_out) == (1, 4)
        snap = state.get(ENS)
        assert snap is not None
        assert snap.reports[0].links == row  # kept, and the report is fresh
        assert snap.reports[0].received_at > first_at
        up = await domain(c)
        assert up["status"] == "UP" and up["missing_links"] == [] and up["silent"] == []

        now[0] += 10
        await reporter.send(Report(0, body(view(9, lost=True))))  # a link drops
        assert reporter.domain_sent == 2
        degraded = await domain(c)
        assert degraded["status"] == "DEGRADED" and degraded["missing_links"] == [[0, 1]]
        now[0] += 10
        await reporter.send(Report(0, body(view(10, lost=True))))  # heartbeat: still lost
        assert (await domain(c))["missing_links"] == [[0, 1]]
        now[0] += 1
        await reporter.send(Report(0, body(view(11))))  # and back
        assert reporter.domain_sent == 3
        assert (await domain(c))["status"] == "UP"

        now[0] += DOMAIN_REFRESH  # unchanged for a minute: sent in full again
        await reporter.send(Report(0, body(view(12))))
        assert reporter.domain_sent == 4

        with pytest.raises(http.HttpStatusError) as refused:  # a 422 (bad imex_state) ...
            await reporter.send(Report(0, body(view(13), imex_state="")))
        assert refused.value.status == 422
        now[0] += 1
        await reporter.send(Report(0, body(view(14))))  # ... the next report carries it
        assert reporter.domain_sent == 5  # unchanged and a second old, yet sent again

        now[0] += 1
        await reporter.send(Report(0, body(None)))  # no view any more: null drops the row
        snap = state.get(ENS)
        assert snap is not None and snap.reports[0].links is None
        assert (await domain(c))["status"] != "UP"


async def test_a_heartbeat_without_the_view_keeps_no_row_from_the_slots_previous_vm() -> None:
    state = state_of()
    async with serve(state, TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        headers = {"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": IPS[1]}
        for i in (0, 1):
            r = await c.put(f"{BASE}/members/{i}/status", json=body(view(1)), headers={
                **headers, "X-Forwarded-For": IPS[i]})
            assert r.status_code == 200, r.text
        assert (await domain(c))["status"] == "UP"
        snap = state.get(ENS)
        assert snap is not None
        # slot 1 gets another VM (another address): the old VM's row is not its row
        state.set(snap.spec, [Member(0, IPS[0]), Member(1, "10.213.0.99")], [])
        r = await c.put(f"{BASE}/members/1/status", json={"imex_state": "READY"},
                        headers={**headers, "X-Forwarded-For": "10.213.0.99"})
        assert r.status_code == 200, r.text
        assert r.json()["domain_needed"] is True  # and the answer asks for the view
        snap = state.get(ENS)
        assert snap is not None and snap.reports[1].links is None
        assert (await domain(c))["status"] != "UP"
        # the same VM's next heartbeat after a full report keeps its own row
        r = await c.put(f"{BASE}/members/1/status", json=body(view(2)),
                        headers={**headers, "X-Forwarded-For": "10.213.0.99"})
        assert "domain_needed" not in r.json()  # it came with the view
        r = await c.put(f"{BASE}/members/1/status", json={"imex_state": "READY"},
                        headers={**headers, "X-Forwarded-For": "10.213.0.99"})
        assert r.status_code == 200, r.text
        assert "domain_needed" not in r.json()  # a row to keep: nothing asked
        assert (await domain(c))["status"] == "UP"
        # "no view" (null) is an answer, not an omission: nothing is asked for
        r = await c.put(f"{BASE}/members/1/status", json=body(None),
                        headers={**headers, "X-Forwarded-For": "10.213.0.99"})
        assert r.status_code == 200 and "domain_needed" not in r.json(), r.text


class Recording(Reporter):
    """A Reporter that queues the body of each PUT once its answer is taken in."""

    def __init__(self, settings: Settings, **kw: Any) -> None:
        super().__init__(settings, **kw)
        self.sent: asyncio.Queue[dict[str, Any]] = asyncio.Queue()
        self._body: dict[str, Any] = {}

    def wire_body(self, report: Report) -> tuple[dict[str, Any], str | None]:
        self._body, key = super().wire_body(report)
        return self._body, key

    async def send(self, report: Report) -> None:
        await super().send(report)
        self.sent.put_nowait(self._body)


async def test_a_migrated_guest_resends_its_unchanged_view_when_the_answer_asks(
    token_file: str,
) -> None:
    """Soak seed 0xd2975029: after a migration the view was unchanged, so the guest's
    heartbeats left it out, and the registry kept no row from before the move: the
    domain read UNKNOWN until the guest's once-a-minute refresh. Now the answer asks,
    and the reporter sends the same report again at once with the view."""
    state = state_of()
    async with serve(state, TRUSTED) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        r = await c.put(f"{BASE}/members/1/status", json=body(view(1)), headers={
            "Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": IPS[1]})
        assert r.status_code == 200, r.text
        settings = Settings(ensemble="hb", namespace="gpu", max_members=2,
                            registry_url=reg.url, token_file=token_file)
        reporter = Recording(settings, clock=lambda: 100.0)  # the minute never passes
        await reporter.send(Report(0, body(view(1))))
        reporter.sent.get_nowait()
        assert (await domain(c))["status"] == "UP"
        # slot 0 gets a new address and then its own back (the reporter can only call
        # from 127.0.0.1): to the registry, the row now predates the slot's VM
        snap = state.get(ENS)
        assert snap is not None
        state.set(snap.spec, [Member(0, "10.213.0.50"), Member(1, IPS[1])], [])
        state.set(snap.spec, [Member(0, IPS[0]), Member(1, IPS[1])], [])
        assert (await domain(c))["status"] == "UNKNOWN"

        task = asyncio.create_task(reporter.run())
        try:
            reporter.submit(0, body(view(2)), force=True)  # a heartbeat, view unchanged
            async with asyncio.timeout(10):  # the heartbeat, then the resend
                bodies = [await reporter.sent.get() for _ in range(2)]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # left out once, asked for, sent again with it: and not a third time
        assert ["imex_domain" in b for b in bodies] == [False, True]
        assert (reporter.domain_left_out, reporter.domain_asked, reporter.domain_sent) == \
            (1, 1, 2)
        assert (await domain(c))["status"] == "UP"


async def test_an_answer_from_a_closing_replica_makes_the_next_report_carry_the_view(
    token_file: str,
) -> None:
    state = state_of()
    async with serve(state, TRUSTED) as reg:
        settings = Settings(ensemble="hb", namespace="gpu", max_members=2,
                            registry_url=reg.url, token_file=token_file)
        reporter = Reporter(settings, clock=lambda: 100.0)
        await reporter.send(Report(0, body(view(1))))
        assert reporter.domain_accepted is not None
        await reporter.send(Report(0, body(view(2))))
        assert (reporter.domain_sent, reporter.domain_left_out) == (1, 1)
        state.close()  # shutting down: its answers say X-Imex-Registry: closing
        await reporter.send(Report(0, body(view(3))))
        assert reporter.domain_accepted is None  # the next replica is told in full
        assert reporter.wire_body(Report(0, body(view(4))))[1] is not None
