"""``python -m tests.bench standins`` in its quick size: four real stand-ins on loopback,
the native daemon and the Python one side by side."""

from __future__ import annotations

from tests.bench.common import Results
from tests.bench.standin_cost import run


def test_every_round_redials_every_peer_once_and_the_costs_are_measured() -> None:
    results = Results(quick=True)
    run(results, quick=True)
    got = results.figures
    note = results.notes["standins"]
    for suffix in ("", "_python"):
        # 4 stand-ins, 2 rounds: each acted SIGUSR1 redials the 3 peers, no more, no fewer
        assert got[f"standin_reconnects_per_usr1{suffix}_quick"] == 3.0
        idle = got[f"standin_idle_cpu_ms_per_s{suffix}_quick"]
        usr1 = got[f"standin_usr1_cpu_ms{suffix}_quick"]
        assert idle is not None and usr1 is not None
        assert 0 < idle < 1000 and usr1 > 0
        restart = got[f"standin_restart_cpu_ms{suffix}_quick"]
        assert restart is not None and restart > 0
        query = got[f"standin_ctl_query_cpu_ms{suffix}_quick"]
        assert query is not None and query >= 0
        assert got[f"standin_restart_peers_cpu_ms{suffix}_quick"] is not None
    assert "4 IMEX stand-ins (c) on loopback" in note
    assert "4 IMEX stand-ins (python) on loopback" in note
    # each daemon is the one it says: the state file names its loop
    assert "event loop: c;" in note and "event loop: uvloop" in note
    # a Python restart is a new interpreter with every module to import: never cheap
    python_restart = got["standin_restart_cpu_ms_python_quick"]
    assert python_restart is not None and python_restart > 5
