"""manifests/examples' PrometheusRule: valid for the Prometheus Operator, and its alerts fire.

The schema is prometheus-operator's own published CRD, fetched through the Go module proxy
as data (tests/prometheus_operator.py; it lives in Go's module cache, never in this
repository).
Structural CRD schemas prune unknown fields instead of refusing them, so the test also
fails on any field the schema does not know (a misspelt ``expr`` would silently vanish).
``promtool`` (Debian's ``prometheus`` package) checks the expressions and runs unit
tests that feed series and expect each alert to fire at the right time, not before.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests import prometheus_operator

REPO = Path(__file__).resolve().parents[2]
RULE = REPO / "manifests" / "examples" / "prometheusrule-imex-domain.yaml"


@pytest.fixture(scope="module")
def schema() -> dict[str, Any]:
    try:
        doc = prometheus_operator.crd("PrometheusRule")
    except prometheus_operator.NoGo as exc:
        pytest.skip(str(exc))
    (version,) = [v for v in doc["spec"]["versions"] if v["name"] == "v1"]
    return dict(version["schema"]["openAPIV3Schema"])


def unknown_fields(doc: Any, node: dict[str, Any], where: str = "") -> list[str]:
    """Paths in ``doc`` the structural schema would prune (it knows no such field)."""
    out: list[str] = []
    if isinstance(doc, dict) and "properties" in node:
        for key, value in doc.items():
            if key not in node["properties"]:
                if not node.get("x-kubernetes-preserve-unknown-fields"):
                    out.append(f"{where}.{key}")
                continue
            out += unknown_fields(value, node["properties"][key], f"{where}.{key}")
    elif isinstance(doc, list) and "items" in node:
        for i, item in enumerate(doc):
            out += unknown_fields(item, node["items"], f"{where}[{i}]")
    return out


def rule() -> dict[str, Any]:
    doc = yaml.safe_load(RULE.read_text())
    assert isinstance(doc, dict)
    return doc


def test_the_rule_validates_against_the_operators_crd(schema: dict[str, Any]) -> None:
    doc = rule()
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    validator = jsonschema.Draft7Validator(schema)  # the CRD's Go regexes (?i) are not
    validator.validate(doc)  # Python's: the schema is the operator's, used as published
    assert unknown_fields(doc, schema) == []
    alerts = {r["alert"] for g in doc["spec"]["groups"] for r in g["rules"]}
    assert {"ImexDomainDegraded", "ImexEnsembleSplitClique", "ImexGuestSilent"} <= alerts
    # the check bites: a wrong type and a misspelt field are both caught
    bad = rule()
    bad["spec"]["groups"][0]["rules"][0]["for"] = 120
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)
    typo = rule()
    typo["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    assert unknown_fields(typo, schema) == [".spec.groups[0].rules[0].expresion"]


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def test_promtool_checks_the_expressions(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule()["spec"]))
    out = subprocess.run([promtool(), "check", "rules", str(rules)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 4 rules found" in out.stdout


def rendered(alert: str, value: str) -> dict[str, str]:
    """The annotations Prometheus renders for ``alert`` on gpu/gb200 with ``value``."""
    (r,) = [r for g in rule()["spec"]["groups"] for r in g["rules"] if r["alert"] == alert]
    subst = {"{{ $labels.namespace }}": "gpu", "{{ $labels.ensemble }}": "gb200",
             "{{ $value }}": value}
    out = {}
    for key, text in r["annotations"].items():
        for a, b in subst.items():
            text = text.replace(a, b)
        out[key] = text
    return out


def test_the_alerts_fire_when_they_should_and_not_before(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule()["spec"]))
    lab = 'namespace="gpu",ensemble="gb200"'
    labels = {"namespace": "gpu", "ensemble": "gb200", "severity": "warning"}

    def firing(alert: str, value: str) -> list[dict[str, Any]]:
        return [{"exp_labels": labels, "exp_annotations": rendered(alert, value)}]

    tests = {"rule_files": [str(rules)], "evaluation_interval": "30s", "tests": [{
        "interval": "1m",
        "input_series": [
            {"series": f'imex_ensemble_domain_status{{{lab},status="DEGRADED"}}',
             "values": "0 1 1 1 1 1 1 1 1 1"},
            {"series": f'imex_ensemble_domain_status{{{lab},status="UP"}}',
             "values": "1 0 0 0 0 0 0 0 0 0"},
            {"series": f"imex_ensemble_cliques{{{lab}}}", "values": "1 1 2 2 2 2 2 2 2 2"},
            {"series": f"imex_ensemble_silent_members{{{lab}}}",
             "values": "0 0 0 1 1 1 1 1 1 1"},
        ],
        "alert_rule_test": [
            {"eval_time": "2m", "alertname": "ImexDomainDegraded", "exp_alerts": []},
            {"eval_time": "4m", "alertname": "ImexDomainDegraded",
             "exp_alerts": firing("ImexDomainDegraded", "1")},
            {"eval_time": "2m", "alertname": "ImexEnsembleSplitClique", "exp_alerts": []},
            {"eval_time": "4m", "alertname": "ImexEnsembleSplitClique",
             "exp_alerts": firing("ImexEnsembleSplitClique", "2")},
            {"eval_time": "7m", "alertname": "ImexGuestSilent", "exp_alerts": []},
            {"eval_time": "9m", "alertname": "ImexGuestSilent",
             "exp_alerts": firing("ImexGuestSilent", "1")},
            {"eval_time": "9m", "alertname": "ImexDomainDown", "exp_alerts": []},
        ],
    }]}
    test_file = tmp_path / "alerts.test.yaml"
    test_file.write_text(yaml.safe_dump(tests))
    out = subprocess.run([promtool(), "test", "rules", str(test_file)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout
