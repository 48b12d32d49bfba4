"""The table ``make bench-peers`` prints, and the keys of ``bench-peers.json``.

One row per scenario and figure; columns ``recipe | ours (registry) | ours (DNS only) |
ratio``. The rows name the JSON keys they show, so the table and the file cannot
disagree. Ratios are computed here from the figures (``measure.speedup`` / ``fewer``);
where ours is near zero the ratio counts ours as at least one event per measuring window
and says so in a note under the table. Pure.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tests.bench.peers.measure import fewer, speedup

COLUMNS = ("recipe", "ours (registry)", "ours (DNS only)", "ratio")

#: the keys issue 18 requires in bench-peers.json (numbers; null only with a reason)
REQUIRED_KEYS = (
    "recipe_replace_p50_ms", "recipe_replace_p99_ms",
    "ours_registry_replace_p50_ms", "ours_registry_replace_p99_ms",
    "ours_dns_replace_p50_ms", "ours_dns_replace_p99_ms",
    "recipe_absent_dns_qps", "ours_absent_dns_qps",
    "recipe_storm_up_s", "ours_storm_up_s",
    "recipe_stale_attempts", "ours_stale_attempts",
    "floor_hosts_p50_ms", "floor_hosts_p99_ms", "ours_registry_hosts_p50_ms",
)

Ratio = Literal["faster", "fewer", "floor", "none"]


@dataclass(frozen=True)
class Row:
    scenario: str
    figure: str
    unit: str
    recipe: str | None
    registry: str | None
    dns: str | None
    ratio: Ratio = "none"
    #: for "faster"/"fewer": the ours key compared with ``recipe`` (default: ``registry``);
    #: for "floor": ``registry`` / this key
    against: str | None = None


ROWS: tuple[Row, ...] = (
    Row("replacement", "p50, to CONNECTED on every peer", "ms", "recipe_replace_p50_ms",
        "ours_registry_replace_p50_ms", "ours_dns_replace_p50_ms", "faster"),
    Row("replacement", "p99, to CONNECTED on every peer", "ms", "recipe_replace_p99_ms",
        "ours_registry_replace_p99_ms", "ours_dns_replace_p99_ms", "faster"),
    Row("replacement", "p50, ours with own_slot = local", "ms", "recipe_replace_p50_ms",
        "ours_local_replace_p50_ms", None, "faster"),
    Row("replacement", "p99, ours with own_slot = local", "ms", "recipe_replace_p99_ms",
        "ours_local_replace_p99_ms", None, "faster"),
    Row("replacement", "p50, to the new IP in every hosts file", "ms", None,
        "ours_registry_hosts_p50_ms", "ours_dns_hosts_p50_ms", "floor", "floor_hosts_p50_ms"),
    Row("replacement", "floor probe: hosts files, p50", "ms", None, "floor_hosts_p50_ms", None),
    Row("replacement", "floor probe: hosts files, p99", "ms", None, "floor_hosts_p99_ms", None),
    Row("absent slots", "DNS queries/s at CoreDNS", "/s", "recipe_absent_dns_qps",
        "ours_absent_dns_qps", "ours_dns_absent_dns_qps", "fewer"),
    Row("boot storm", "last Running -> Domain UP everywhere", "s", "recipe_storm_up_s",
        "ours_storm_up_s", "ours_dns_storm_up_s", "faster"),
    Row("boot storm", "IMEX restarts per member", "", "recipe_storm_restarts_per_member",
        "ours_storm_restarts_per_member", "ours_dns_storm_restarts_per_member"),
    Row("boot storm", "SIGUSR1 per member", "", "recipe_storm_signals_per_member",
        "ours_storm_signals_per_member", "ours_dns_storm_signals_per_member"),
    Row("crash", "attempts to the old IP after deletion", "", "recipe_stale_attempts",
        "ours_stale_attempts", "ours_dns_stale_attempts", "fewer"),
    Row("crash", "last attempt to it, after deletion", "s", "recipe_stale_stop_s",
        "ours_stale_stop_s", "ours_dns_stale_stop_s"),
    Row("live migration", "every peer CONNECTED to the target", "s",
        "recipe_migration_connected_s", None, None),
    Row("live migration", "attempts to the source after switchover", "",
        "recipe_migration_source_attempts", None, None),
    Row("live migration", "name answered with two A records for", "s",
        "recipe_migration_dual_records_s", None, None),
    Row("systemd-resolved guests", "replacement p50", "ms", "recipe_resolved_replace_p50_ms",
        None, None, "faster", "ours_registry_replace_p50_ms"),
    Row("systemd-resolved guests", "replacement p99", "ms", "recipe_resolved_replace_p99_ms",
        None, None, "faster", "ours_registry_replace_p99_ms"),
    Row("systemd-resolved guests", "crash: attempts to the old IP after deletion", "",
        "recipe_resolved_stale_attempts", None, None, "fewer", "ours_stale_attempts"),
    Row("systemd-resolved guests", "crash: last attempt to it, after deletion", "s",
        "recipe_resolved_stale_stop_s", None, None),
    Row("systemd-resolved guests", "absent slots: DNS queries/s", "/s",
        "recipe_resolved_absent_dns_qps", None, None, "fewer", "ours_absent_dns_qps"),
)


def fmt(value: float | None, unit: str = "") -> str:
    if value is None:
        return "n/a"
    if abs(value) >= 100:
        text = f"{value:,.0f}"
    elif abs(value) >= 10:
        text = f"{value:.1f}"
    else:
        text = f"{value:.2f}"
    return f"{text} {unit}".strip() if unit in ("ms", "s", "/s") else text


def ratio_text(row: Row, figures: Mapping[str, float | None], window_s: float) -> str:
    """The ratio cell: ``8.1x faster``, ``160x fewer`` (ours floored at 1/window),
    ``1.9x floor``; empty for rows without a comparison, ``n/a`` when a side is missing."""
    if row.ratio == "none":
        return ""
    if row.ratio == "floor":
        ours = figures.get(row.registry or "")
        floor = figures.get(row.against or "")
        value = speedup(ours, floor)  # ours / floor
        return "n/a" if value is None else f"{_x(value)} floor"
    recipe = figures.get(row.recipe or "")
    ours_key = row.against or row.registry or ""
    ours = figures.get(ours_key)
    if row.ratio == "faster":
        value = speedup(recipe, ours)
        if value is None:
            return "n/a"
        return f"{_x(value)} faster" if value >= 1 else f"{_x(1 / value)} slower"
    # "fewer": rates floor at one query per window; counts (no unit) at one event
    window = window_s if row.unit == "/s" else 1.0
    if recipe is not None and ours is not None and max(recipe, ours) < 1.0 / window:
        return "both ~0"
    value = fewer(recipe, ours, window)
    if value is None:
        return "n/a"
    if value >= 1:
        return f"{_x(value)} fewer"
    # ours sends more: the same floor for the recipe's side
    more = fewer(ours, recipe, window)
    return "n/a" if more is None else f"{_x(more)} more"


def _x(value: float) -> str:
    return f"{value:,.0f}x" if value >= 100 else f"{value:.1f}x"


def render(figures: Mapping[str, float | None], window_s: float,
           rows: tuple[Row, ...] = ROWS) -> str:
    """The whole table, aligned, with the ratio notes under it."""
    header = ("scenario", "figure", *COLUMNS)
    body: list[tuple[str, ...]] = []
    for r in rows:
        cells = tuple("—" if key is None else fmt(figures.get(key))
                      for key in (r.recipe, r.registry, r.dns))
        unit = f" ({r.unit})" if r.unit else ""
        body.append((r.scenario, r.figure + unit, *cells, ratio_text(r, figures, window_s)))
    table = [header, *body]
    widths = [max(len(row[i]) for row in table) for i in range(len(header))]

    def line(row: tuple[str, ...]) -> str:
        left = [c.ljust(w) for c, w in zip(row[:2], widths[:2], strict=True)]
        right = [c.rjust(w) for c, w in zip(row[2:5], widths[2:5], strict=True)]
        return " | ".join([*left, *right, row[5].ljust(widths[5])]).rstrip()

    out = [line(header), "-+-".join("-" * w for w in widths)]
    out += [line(row) for row in body]
    out.append("")
    out.append(f"ratios: recipe / ours (registry) unless the row says otherwise; where ours "
               f"is near zero it counts as at least one query per {window_s:g} s window "
               "(rates) or one attempt (counts); 'floor' is ours / the floor probe.")
    return "\n".join(out)


def missing_required(figures: Mapping[str, float | None],
                     reasons: Mapping[str, str]) -> list[str]:
    """Required keys that are null without a stated reason (a harness bug if non-empty)."""
    return [k for k in REQUIRED_KEYS if figures.get(k) is None and k not in reasons]


def goal_figures(figures: Mapping[str, float | None], window_s: float
                 ) -> dict[str, float | None]:
    """The ratios issue 27's goals judge (tests/bench/common.py ``GOALS``), from the figures:
    replacement p50 recipe / ours (registry), the hosts-file p50 ours / the floor probe,
    absent-slot DNS queries recipe / ours (ours at least one query per window)."""
    hosts, floor = figures.get("ours_registry_hosts_p50_ms"), figures.get("floor_hosts_p50_ms")
    return {
        "peers_replace_speedup_p50": speedup(figures.get("recipe_replace_p50_ms"),
                                             figures.get("ours_registry_replace_p50_ms")),
        "peers_hosts_vs_floor_p50": (hosts / floor if hosts is not None and floor
                                     else None),
        "peers_absent_dns_fewer": fewer(figures.get("recipe_absent_dns_qps"),
                                        figures.get("ours_absent_dns_qps"), window_s),
    }
