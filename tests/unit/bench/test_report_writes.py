"""The report-writes harness (tests/bench/report_writes.py) runs the real ReportPersister,
writer tasks included, in virtual time: a change there that it does not follow (the
persister's writer task of issue 27 once left every persist waiting) fails here, not in
the next full ``make bench``."""

from __future__ import annotations

from host_agent.persist.reports import REFRESH_FRACTION
from tests.bench.report_writes import STALE_AFTER, simulate

ENSEMBLES = 10


def per_1000(rate: float) -> float:
    return rate * 1000 / ENSEMBLES


def test_heartbeats_without_news_ride_along_one_refresh_per_ensemble() -> None:
    refresh = STALE_AFTER * REFRESH_FRACTION  # 40 s
    before = per_1000(simulate(ENSEMBLES, 18, refresh_after=0.0, replicas=1, seconds=90,
                               window_from=60))
    after = per_1000(simulate(ENSEMBLES, 18, refresh_after=refresh, replicas=1,
                              seconds=210, window_from=60))
    # every heartbeat written: 18 members / 10 s, less what the 0.5 s coalescing joins
    assert 1000 <= before <= 1800, before
    # one write per ensemble per refresh cycle, each member's ride along: 1,000 / 30 s
    # (the cycle is the 40 s refresh less a heartbeat interval); ~33 with random phases
    assert 20 <= after <= 50, after
    assert before / after >= 20
