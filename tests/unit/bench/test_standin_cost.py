"""``python -m tests.bench standins`` in its quick size: four real stand-ins on loopback."""

from __future__ import annotations

from tests.bench.common import Results
from tests.bench.standin_cost import run


def test_every_round_redials_every_peer_once_and_the_costs_are_measured() -> None:
    results = Results(quick=True)
    run(results, quick=True)
    got = results.figures
    # 4 stand-ins, 2 rounds: each acted SIGUSR1 redials the 3 peers, no more, no fewer
    assert got["standin_reconnects_per_usr1_quick"] == 3.0
    idle, usr1 = got["standin_idle_cpu_ms_per_s_quick"], got["standin_usr1_cpu_ms_quick"]
    assert idle is not None and usr1 is not None
    assert 0 < idle < 1000 and usr1 > 0
    assert "4 IMEX stand-ins on loopback" in results.notes["standins"]
    # a restart is a new interpreter with every module to import: never free
    restart = got["standin_restart_cpu_ms_quick"]
    assert restart is not None and restart > 5
    query = got["standin_ctl_query_cpu_ms_quick"]
    assert query is not None and query >= 0
    assert got["standin_restart_peers_cpu_ms_quick"] is not None
    assert "event loop: uvloop" in results.notes["standins"]
