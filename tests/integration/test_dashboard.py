"""The Grafana dashboard's JSON (charts/imex-ensemble/dashboards/imex-ensemble.json),
checked without Grafana (not in Debian, and AGPL: never vendored here).

What is checked is what Grafana needs to load it and what makes it readable: the model's
top-level fields, unique panel ids, panels on the 24-column grid without overlaps, every
panel and target on the ``${datasource}`` variable, every variable a panel uses defined,
each target with a refId and an expression, every panel the issue asks for present, and
the component's ConfigMap carrying the same JSON under the sidecar label. That each
expression returns series with the legend's labels from a running agent is
tests/integration/host/test_promql_live.py's; here, pure, that its neutral and widened
forms (tests/promql_check.py) are what that test relies on.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml

from tests import promql_check

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "charts/imex-ensemble/dashboards/imex-ensemble.json"
CONFIGMAP = REPO / "manifests/components/monitoring/dashboard-configmap.yaml"
#: the panels issue 29 asks for, by title
REQUIRED = ("Ensembles by domain status", "Members published and READY", "Link states",
            "Kubernetes API writes and errors", "Leader and handovers", "Long-poll waiters",
            "Guest report age")
#: Grafana's built-in panel types this dashboard may use (no plugin to install)
PANEL_TYPES = {"stat", "table", "timeseries", "bargauge", "gauge", "piechart", "text"}


def dashboard() -> dict[str, Any]:
    doc = json.loads(DASHBOARD.read_text())
    assert isinstance(doc, dict)
    return doc


def test_the_model_has_what_grafana_needs() -> None:
    d = dashboard()
    assert isinstance(d["schemaVersion"], int) and d["schemaVersion"] >= 36
    assert d["uid"] == "imex-ensemble" and d["title"]
    assert "id" not in d or d["id"] is None  # an id would clash in the importing Grafana
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in d["panels"]]
    assert len(ids) == len(set(ids))
    assert {p["title"] for p in d["panels"]} >= set(REQUIRED)
    for p in d["panels"]:
        assert p["type"] in PANEL_TYPES, p["title"]
        assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
        assert p["description"], p["title"]
        refs = [t["refId"] for t in p["targets"]]
        assert refs and len(refs) == len(set(refs)), p["title"]
        for t in p["targets"]:
            assert t["datasource"] == p["datasource"] and t["expr"].strip(), p["title"]
            used = set(re.findall(r"\$(\w+)", t["expr"])) - {"__rate_interval"}
            assert used <= set(variables), f"{p['title']}: undefined {used - set(variables)}"


def test_panels_sit_on_the_grid_without_overlapping() -> None:
    cells: dict[tuple[int, int], str] = {}
    for p in dashboard()["panels"]:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["w"] > 0 and g["x"] + g["w"] <= 24, p["title"]
        assert g["y"] >= 0 and g["h"] > 0, p["title"]
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{p['title']} overlaps {cells[(x, y)]}"
                cells[(x, y)] = p["title"]


def test_the_component_ships_the_same_json_for_the_sidecar() -> None:
    cm = yaml.safe_load(CONFIGMAP.read_text())
    assert cm["kind"] == "ConfigMap" and cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert json.loads(cm["data"]["imex-ensemble.json"]) == dashboard()


def test_neutral_and_widened_forms() -> None:
    assert promql_check.neutral("absent(up{job=\"a\"} == 1)") == 'up{job="a"}'
    assert promql_check.neutral("sum(x) / sum(y) > 0.5") == "sum(x) / sum(y)"
    assert promql_check.neutral("rate(x[$__rate_interval]) * 60 > 1") == \
        "rate(x[1m]) * 60"
    assert promql_check.widened('max(x{result="FAIL",job="j"}) > 0') == \
        'max(x{result=~".+",job="j"})'
    found = promql_check.names(
        'max by (namespace, ensemble) (g) - on (namespace, ensemble) group_right g > 0 '
        'and on (job) sum by (job) (rate(c{code!~"2..",verb="x"}[5m]))')
    assert found.metrics == {"g": set(), "c": {"code", "verb"}}
    assert found.grouping == {"namespace", "ensemble", "job"}
    assert promql_check.label_refs(["{{ $labels.instance }} {{ $value }}", "{{kind}} x"]) == \
        {"instance", "kind"}


def test_docs_monitoring_lists_the_panels_as_they_are() -> None:
    doc = (REPO / "docs" / "monitoring.md").read_text()
    panels = dashboard()["panels"]
    assert f"holds {len(panels)}\npanels" in doc or f"holds {len(panels)} panels" in doc
    rows = re.findall(r"^\| ([A-Z][^|`]+?) \| (`imex_[^|]+) \|$", doc, flags=re.M)
    assert [title for title, _ in rows] == [p["title"] for p in panels]
    for (title, metrics), p in zip(rows, panels, strict=True):
        named = set(re.findall(r"`(imex_\w+)`", metrics))
        used = set().union(*(promql_check.names(t["expr"]).metrics for t in p["targets"]))
        assert named == used, title
