"""The bench-peers table: columns, cells, ratios, and the keys issue 18 requires."""

from __future__ import annotations

from tests.bench.peers.report import (
    COLUMNS,
    REQUIRED_KEYS,
    ROWS,
    Row,
    fmt,
    missing_required,
    ratio_text,
    render,
)


def test_columns_and_required_keys_are_the_issues() -> None:
    assert COLUMNS == ("recipe", "ours (registry)", "ours (DNS only)", "ratio")
    assert set(REQUIRED_KEYS) == {
        "recipe_replace_p50_ms", "recipe_replace_p99_ms", "ours_registry_replace_p50_ms",
        "ours_registry_replace_p99_ms", "ours_dns_replace_p50_ms", "ours_dns_replace_p99_ms",
        "recipe_absent_dns_qps", "ours_absent_dns_qps", "recipe_storm_up_s", "ours_storm_up_s",
        "recipe_stale_attempts", "ours_stale_attempts", "floor_hosts_p50_ms",
        "floor_hosts_p99_ms", "ours_registry_hosts_p50_ms"}
    shown = {k for r in ROWS for k in (r.recipe, r.registry, r.dns) if k}
    assert set(REQUIRED_KEYS) <= shown


def test_ratio_cells() -> None:
    f = {"recipe_replace_p50_ms": 2000.0, "ours_registry_replace_p50_ms": 250.0,
         "recipe_absent_dns_qps": 192.0, "ours_absent_dns_qps": 0.0,
         "ours_registry_hosts_p50_ms": 120.0, "floor_hosts_p50_ms": 60.0,
         "recipe_stale_attempts": 6.0, "ours_stale_attempts": 0.0}
    by = {(r.scenario, r.figure): r for r in ROWS}
    rep = by[("replacement", "p50, to CONNECTED on every peer")]
    assert ratio_text(rep, f, 60) == "8.0x faster"
    absent = by[("absent slots", "DNS queries/s at CoreDNS")]
    assert ratio_text(absent, f, 60) == "11,520x fewer"  # ours counted as 1/60 per second
    hosts = by[("replacement", "p50, to the new IP in every hosts file")]
    assert ratio_text(hosts, f, 60) == "2.0x floor"
    crash = by[("crash", "attempts to the old IP after deletion")]
    assert ratio_text(crash, f, 60) == "6.0x fewer"  # ours 0 attempts counts as 1
    assert ratio_text(rep, {}, 60) == "n/a"
    assert ratio_text(rep, {**f, "recipe_replace_p50_ms": 125.0}, 60) == "2.0x slower"
    assert ratio_text(crash, {**f, "recipe_stale_attempts": 0.0}, 60) == "both ~0"
    # systemd-resolved's negative cache: the recipe at 0 queries, ours at 0.4/s
    assert ratio_text(absent, {**f, "recipe_absent_dns_qps": 0.0, "ours_absent_dns_qps": 0.4},
                      60) == "24.0x more"
    assert ratio_text(Row("s", "f", "", "a", "b", None), f, 60) == ""


def test_cells_and_alignment() -> None:
    assert fmt(None) == "n/a" and fmt(1234.4) == "1,234" and fmt(12.34) == "12.3"
    assert fmt(0.5) == "0.50"
    rows = (Row("replacement", "p50", "ms", "r", "o", None, "faster"),
            Row("absent slots", "qps", "/s", "rq", "oq", "dq", "fewer"))
    out = render({"r": 2000.0, "o": 200.0, "rq": 100.0, "oq": 1.0, "dq": None}, 10, rows)
    lines = out.splitlines()
    assert [c.strip() for c in lines[0].split(" | ")] == ["scenario", "figure", "recipe",
                                     "ours (registry)", "ours (DNS only)", "ratio"]
    assert " 2,000 |" in lines[2] and "10.0x faster" in lines[2]
    assert lines[2].index("2,000") + len("2,000") == lines[3].index("100") + len("100")
    assert "—" in lines[2] and "n/a" in lines[3] and "100x fewer" in lines[3]
    assert "per 10 s window" in out


def test_nulls_need_a_reason() -> None:
    figures = {k: 1.0 for k in REQUIRED_KEYS}
    assert missing_required(figures, {}) == []
    figures["ours_storm_up_s"] = None
    assert missing_required(figures, {}) == ["ours_storm_up_s"]
    assert missing_required(figures, {"ours_storm_up_s": "phase failed"}) == []
