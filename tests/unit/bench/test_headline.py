"""The generated headline table: every goal, its verdict from GOALS, the runs' provenance."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest

from tests.bench.common import GOALS
from tests.bench.headline import BEGIN, END, main, render, splice

RESULTS = {"host_sync_10k_s": 4.2, "host_update_cpu_ms": 0.7, "host_restart_writes": 0,
           "_meta": {"commit": "abc123def456", "date": "2026-12-03T01:00:00+00:00",
                     "quick": False, "loadavg_1min": {"host": [0.4, 1.2]},
                     "machine_speed_s": 0.153,
                     "machine": {"cpus": 2, "cpu_model": "Xeon", "mem_gb": 23.5,
                                 "kernel": "6.18", "python": "3.11.7"}}}
PEERS = {"peers_replace_speedup_p50": 12.5, "peers_hosts_vs_floor_p50": 3.4,
         "_meta": {"commit": "abc123def456", "date": "2026-12-03T02:00:00+00:00",
                   "quick": False, "loadavg_1min_start": 0.3, "machine": {"cpus": 2}}}


def test_every_goal_is_a_row_and_every_verdict_comes_from_its_goal() -> None:
    text = render(RESULTS, PEERS)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    assert [r.split("`")[1] for r in rows] == [g.key for g in GOALS]
    row = {r.split("`")[1]: r for r in rows}
    assert row["host_sync_10k_s"].endswith("| PASS |")
    assert row["host_update_cpu_ms"].endswith("| MISS |")
    assert row["host_restart_writes"].endswith("| PASS |")
    assert row["peers_replace_speedup_p50"].endswith("| PASS |")
    assert row["peers_hosts_vs_floor_p50"].endswith("| MISS |")
    assert row["host_rss_mb"].endswith("| n/a |")  # not measured
    assert "commit `abc123def456`" in text and "host 0.4 -> 1.2" in text
    assert "0.3 at the start" in text
    # the machine's speed beside the results that recorded it, and only there
    assert text.count("machine speed") == 1 and "machine speed 0.15 s" in text
    assert "parts that failed" not in text  # neither run recorded an error


def test_a_part_that_failed_is_named_beside_its_run() -> None:
    meta = dict(cast(dict[str, object], RESULTS["_meta"]))
    meta["errors"] = {"standins": "ImexStandinError: never wrote its pid"}
    text = render({**RESULTS, "_meta": meta}, PEERS)
    source = next(line for line in text.splitlines() if line.startswith("- `bench-results"))
    assert "parts that failed" in source and "`standins`: ImexStandinError" in source


def test_quick_figures_never_pose_as_the_real_ones() -> None:
    quick = {"host_sync_10k_s_quick": 1.0, "_meta": {"quick": True}}
    text = render(quick, None)
    assert "quick run" in text and "`bench-peers.json`: not found" in text
    assert all(line.endswith("| n/a |") for line in text.splitlines() if line.startswith("| `"))
    # bench-peers --quick writes its usual keys (3 members): not judged either
    text = render(None, {**PEERS, "_meta": {**PEERS["_meta"], "quick": True}})
    assert all(line.endswith("| n/a |") for line in text.splitlines() if line.startswith("| `"))


def test_write_replaces_only_the_block(tmp_path: Path) -> None:
    doc = tmp_path / "benchmarks.md"
    doc.write_text(f"# B\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n")
    results = tmp_path / "r.json"
    results.write_text(json.dumps(RESULTS))
    assert main(["--results", str(results), "--peers", str(tmp_path / "none.json"),
                 "--write", str(doc)]) == 0
    text = doc.read_text()
    assert text.startswith("# B\n\nbefore\n") and text.endswith(f"{END}\nafter\n")
    assert "old table" not in text and "| `host_sync_10k_s` | 4.20 s |" in text
    with pytest.raises(ValueError, match="markers"):
        splice("no markers here", "x")
