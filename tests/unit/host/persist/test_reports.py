"""Which guest reports a replica writes into the API, and when (host_agent/persist/reports.py).

The decision (``persist_reason``, ``riders``) is pure and tested case by case; the
``ReportPersister`` is the real one with its ``_write`` recording the merge patches
into a dict that plays the informer's copy (the API round trip is in
tests/integration/host/test_report_heartbeats.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from host_agent.persist.reports import (
    ADOPT,
    KEEP,
    REFRESH_FRACTION,
    WRITE_BACK,
    after_api_change,
    decode_report,
    encode_report,
    persist_reason,
    report_content,
    riders,
)
from host_agent.persist.reports_io import ReportPersister
from host_agent.state.snapshot import GuestReport, guest_order, sent_after
from imex_shared.model import EnsembleId

ENS = EnsembleId("gpu", "gb200")
FIELDS: dict[str, Any] = {"imex_state": "READY", "generation_applied": 3, "signals": 0,
                          "restarts": 0, "fabric": {"cluster_uuid": "u", "clique_id": 1}}


def rep(at: float, ip: str = "10.0.0.1", links: tuple[str | None, ...] | None = ("UP", None),
        sent: tuple[str, int] | None = None, **changes: Any) -> GuestReport:
    return GuestReport(at, ip, {**FIELDS, **changes}, links, sent)


BOOT = "6f1c2a4e-0000-4000-8000-00000000abcd"


def reason(report: GuestReport, persisted: GuestReport | None, since: float = 0.0,
           refresh_after: float = 40.0) -> str | None:
    return persist_reason(report, persisted, since=since, refresh_after=refresh_after)


def test_a_heartbeat_without_news_is_not_written() -> None:
    assert reason(rep(1010), rep(1000)) is None
    assert reason(rep(1039.9), rep(1000)) is None


def test_a_copy_refresh_after_old_is_refreshed_and_zero_writes_every_report() -> None:
    assert reason(rep(1040), rep(1000)) == "refresh"
    assert reason(rep(1000.5), rep(1000), refresh_after=0) == "refresh"
    # a copy newer than the report (another replica's clock ahead): nothing to refresh
    assert reason(rep(990), rep(1000)) is None


def test_a_first_report_is_written() -> None:
    assert reason(rep(1000), None) == "new"


@pytest.mark.parametrize("changed", [
    rep(1001, imex_state="WAITING_FOR_PEERS"),
    rep(1001, generation_applied=4),
    rep(1001, restarts=1),
    rep(1001, fabric=None),
    rep(1001, cert_not_after="2027-01-01T00:00:00Z"),
    rep(1001, links=("UP", "DOWN")),
    rep(1001, links=None),
    rep(1001, ip="10.0.0.9"),
])
def test_any_change_of_what_others_derive_is_written(changed: GuestReport) -> None:
    assert reason(changed, rep(1000)) == "changed"


def test_a_report_that_counts_where_the_persisted_one_no_longer_does_is_written() -> None:
    # the slot got its address at 1005 (a migration, same IP): the copy from 1000 does
    # not count for it any more, the heartbeat at 1006 does
    assert reason(rep(1006), rep(1000), since=1005) == "counts"
    assert reason(rep(1006), rep(1005), since=1005) is None


def test_content_ignores_received_at_and_survives_the_round_trip() -> None:
    a = rep(1000)
    back = decode_report(encode_report(rep(2000)))
    assert back is not None and back.received_at == 2000
    assert report_content(a) == report_content(back)
    assert report_content(a) != report_content(rep(1000, signals=1))


def test_riders_are_newer_heartbeats_with_the_persisted_content() -> None:
    persisted = {0: rep(1000), 1: rep(1000), 2: rep(1000), 3: rep(1000)}
    held = {0: rep(1010),                      # rides: same content, newer
            1: rep(1010, imex_state="DOWN"),   # someone else persisted other news since
            2: rep(990),                       # older than the copy
            4: rep(1010)}                      # no copy at all: not held for a refresh
    assert riders(held, persisted) == {0: held[0]}


def test_a_copy_from_the_api_is_adopted_unless_this_replica_shows_a_later_report() -> None:
    assert after_api_change(rep(1000), None) == ADOPT
    assert after_api_change(rep(1010), rep(1000)) == ADOPT
    assert after_api_change(rep(1010, imex_state="DOWN"), rep(1010)) == ADOPT  # as recent
    assert after_api_change(rep(1000), rep(1010)) == KEEP  # a held heartbeat of the same
    # older news landed over a later report held here (a lagging informer): written back
    assert after_api_change(rep(1000, imex_state="DOWN"), rep(1010)) == WRITE_BACK
    assert after_api_change(rep(1000), rep(1010, links=("DOWN", None))) == WRITE_BACK


def test_the_order_is_the_guests_own_when_both_reports_carry_its_stamp() -> None:
    """The CI soak's seed 0xecef7e8e: a guest reported a link down to a replica that was
    then stopped; it timed out, reported the link back up to another replica, and the
    stopped one handled the old request when it woke, 13 s later by its clock. By
    ``received_at`` the old report was the newest: every replica showed the link down
    until the guest's minute refresh. By the guest's stamps it is the older one."""
    down = rep(1013, imex_state="DOWN", sent=(BOOT, 5_000))   # handled late
    up = rep(1000, sent=(BOOT, 9_000))                          # sent after it
    assert sent_after(up, down) and not sent_after(down, up)
    # the replica showing the report the guest sent last writes it back over the old one
    assert after_api_change(down, up) == WRITE_BACK
    # and the replica showing the old one adopts the later one when it lands
    assert after_api_change(up, down) == ADOPT
    # a held heartbeat sent before the copy does not ride over it
    assert riders({0: rep(1020, imex_state="DOWN", sent=(BOOT, 4_000))}, {0: down}) == {}
    assert riders({0: rep(990, imex_state="DOWN", sent=(BOOT, 6_000))}, {0: down}) != {}


def test_stamps_of_another_boot_or_none_fall_back_to_the_receiving_clock() -> None:
    """A guest rebooted inside its VMI starts CLOCK_BOOTTIME again, and a guest before
    0.2 sends no stamp: then the receiving replicas' clocks order the reports."""
    old_boot = rep(1000, sent=("another-boot", 9_000_000))
    new_boot = rep(1010, sent=(BOOT, 1_000))
    assert sent_after(new_boot, old_boot) and not sent_after(old_boot, new_boot)
    assert sent_after(rep(1010), rep(1000, sent=(BOOT, 5))) and \
        not sent_after(rep(1000, sent=(BOOT, 5)), rep(1010))
    assert not sent_after(rep(1000, sent=(BOOT, 5)), rep(1000, sent=(BOOT, 5)))
    # what the guest's stamps say alone (a 409 needs them to say "sent before")
    assert guest_order(new_boot, old_boot) is None
    assert guest_order(rep(1010), rep(1000, sent=(BOOT, 5))) is None
    assert guest_order(rep(1000, sent=(BOOT, 5)), rep(1010, sent=(BOOT, 5))) is False
    assert guest_order(rep(900, sent=(BOOT, 6)), rep(1010, sent=(BOOT, 5))) is True


def test_the_stamp_survives_the_round_trip_and_bad_ones_are_dropped() -> None:
    a = rep(1000, sent=(BOOT, 123))
    back = decode_report(encode_report(a))
    assert back == a
    assert report_content(back) == report_content(rep(1000))  # not news by itself
    doc = json.loads(encode_report(a))
    for bad in ([BOOT], [BOOT, -1], [BOOT, 1.5], [BOOT, True], ["", 1], [1, 2], "x",
                ["b" * 65, 1], None):
        doc["sent"] = bad
        got = decode_report(json.dumps(doc))
        assert got is not None and got.sent is None, bad  # the report stays, unordered


async def test_a_write_back_is_written_and_counted() -> None:
    async with running(Recording()) as p:
        await p.persist(ENS, 0, rep(1000))
        p.api[0] = rep(1005, imex_state="DOWN")  # another replica's write, older news
        await asyncio.shield(p.write_back(ENS, 0, rep(1010)))
        assert p.api[0] == rep(1010) and p.writes == 2
        assert p.reasons == {"new": 1, "newer": 1}


class Recording(ReportPersister):
    """The real persister; each write lands in ``api`` (also the informer's view)."""

    def __init__(self, refresh_after: float = 40.0, interval: float = 0.0) -> None:
        self.api: dict[int, GuestReport] = {}
        self.patches: list[dict[str, str]] = []
        super().__init__(None, "imex-system", interval=interval, refresh_after=refresh_after,
                         persisted=lambda ens: self.api if ens == ENS else {})

    async def _write(self, ens: EnsembleId, data: dict[str, str]) -> None:
        await asyncio.sleep(0)
        self.patches.append(dict(data))
        for k, v in data.items():
            report = decode_report(v)
            assert report is not None
            self.api[int(k)] = report
        self.writes += 1


@contextlib.asynccontextmanager
async def running(persister: Recording) -> AsyncIterator[Recording]:
    """The persister with its writer tasks running (``run``, as the agent runs it)."""
    task = asyncio.create_task(persister.run())
    try:
        yield persister
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_heartbeats_cost_the_first_write_and_the_refreshes_only() -> None:
    async with running(Recording(refresh_after=40.0)) as p:
        for t in range(0, 100, 10):  # 10 heartbeats, 10 s apart, no news
            await p.persist(ENS, 0, rep(1000 + t))
        # written: at 1000 (new), at 1040 and 1080 (the copy was 40 s old)
        assert [decode_report(x["0"]).received_at for x in p.patches] == [1000, 1040, 1080]  # type: ignore[union-attr]
        assert (p.writes, p.held, p.reasons) == (3, 7, {"new": 1, "refresh": 2})


async def test_news_is_in_the_api_when_persist_returns() -> None:
    async with running(Recording()) as p:
        await p.persist(ENS, 0, rep(1000))
        await p.persist(ENS, 0, rep(1010))
        assert p.writes == 1
        await p.persist(ENS, 0, rep(1011, imex_state="DOWN"))
        assert p.writes == 2 and p.api[0].fields["imex_state"] == "DOWN"


async def test_held_heartbeats_ride_along_their_ensembles_next_write() -> None:
    async with running(Recording()) as p:
        for i in range(3):
            await p.persist(ENS, i, rep(1000, ip=f"10.0.0.{i}"))
        assert p.writes == 3
        await p.persist(ENS, 1, rep(1010, ip="10.0.0.1"))  # heartbeats: held
        await p.persist(ENS, 2, rep(1012, ip="10.0.0.2"))
        assert p.writes == 3
        await p.persist(ENS, 0, rep(1015, ip="10.0.0.0", imex_state="DOWN"))
        assert p.writes == 4 and sorted(p.patches[-1]) == ["0", "1", "2"]
        assert [p.api[i].received_at for i in range(3)] == [1015, 1010, 1012]
        # ridden once: the next write carries only its own member
        await p.persist(ENS, 0, rep(1016, ip="10.0.0.0", imex_state="READY"))
        assert sorted(p.patches[-1]) == ["0"]


async def test_a_forgotten_ensemble_holds_nothing() -> None:
    async with running(Recording()) as p:
        await p.persist(ENS, 0, rep(1000))
        await p.persist(ENS, 1, rep(1000, ip="10.0.0.2"))
        await p.persist(ENS, 1, rep(1010, ip="10.0.0.2"))
        p.forget(ENS)
        await p.persist(ENS, 0, rep(1011, imex_state="DOWN"))
        assert sorted(p.patches[-1]) == ["0"]


async def test_a_boot_storm_waits_at_most_one_interval_and_is_stored_before_its_answer(
        ) -> None:
    """issue 27: 18 guests reporting within 0.9 s, at the default interval: every report is
    in the API when its persist returns, none waits longer than the interval (plus the
    write), and the ensemble costs at most one write per interval (3 here)."""
    p = Recording()
    p.interval = ReportPersister(None, "imex-system").interval
    assert p.interval <= 0.5
    loop = asyncio.get_running_loop()
    waits: list[float] = []

    async def guest(i: int, at: float) -> None:
        await asyncio.sleep(at)
        t0 = loop.time()
        await p.persist(ENS, i, rep(1000 + at, ip=f"10.0.0.{i}"))
        waits.append(loop.time() - t0)
        assert p.api[i].received_at == 1000 + at  # stored before answered

    async with running(p):
        await asyncio.gather(*(guest(i, 0.05 * i) for i in range(18)))
    assert max(waits) <= p.interval + 0.1
    assert p.writes <= 3 and sorted(int(k) for x in p.patches for k in x) == list(range(18))


def test_the_refresh_stays_well_inside_staleness() -> None:
    # the worst age a follower sees for a live member: the refresh period, one
    # heartbeat interval and one write timeout; with one refresh lost, twice the period
    stale_after, interval, write = 120.0, 10.0, 5.0
    refresh = stale_after * REFRESH_FRACTION
    assert 2 * refresh + interval + write < stale_after
