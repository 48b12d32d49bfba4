"""The alerts (manifests/components/monitoring, generated from the chart's
files/prometheus-rules.yaml): valid for the Prometheus Operator, each with its runbook,
and each fires when it should, not before, and stays silent on a healthy agent.

The schema is prometheus-operator's own published CRD, fetched through the Go module proxy
as data (tests/prometheus_operator.py; it lives in Go's module cache, never in this
repository).
Structural CRD schemas prune unknown fields instead of refusing them, so the test also
fails on any field the schema does not know (a misspelt ``expr`` would silently vanish).
``promtool`` (Debian's ``prometheus`` package) checks the expressions (``check rules``)
and runs unit tests (``test rules``) that feed synthetic series: one healthy set on
which no alert fires, and per alert a set that fires it after its ``for``, not before.
Whether the agent exports what the expressions read is tests/integration/test_promql_live.py's.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml

from tests import prometheus_operator

REPO = Path(__file__).resolve().parents[2]
COMPONENT = REPO / "manifests" / "components" / "monitoring"
RULE = COMPONENT / "prometheusrule.yaml"
CHART_RULES = REPO / "charts" / "imex-ensemble" / "files" / "prometheus-rules.yaml"
VALUES = REPO / "charts" / "imex-ensemble" / "values.yaml"
RUNBOOKS = REPO / "docs" / "runbooks.md"


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


def alerts() -> dict[str, dict[str, Any]]:
    return {r["alert"]: r for g in rule()["spec"]["groups"] for r in g["rules"]}


def test_the_rule_validates_against_the_operators_crd(schema: dict[str, Any]) -> None:
    doc = rule()
    assert (doc["apiVersion"], doc["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    validator = jsonschema.Draft7Validator(schema)  # the CRD's Go regexes (?i) are not
    validator.validate(doc)  # Python's: the schema is the operator's, used as published
    assert unknown_fields(doc, schema) == []
    # the check bites: a wrong type and a misspelt field are both caught
    bad = rule()
    bad["spec"]["groups"][0]["rules"][0]["for"] = 120
    with pytest.raises(jsonschema.ValidationError):
        validator.validate(bad)
    typo = rule()
    typo["spec"]["groups"][0]["rules"][0]["expresion"] = "up"
    assert unknown_fields(typo, schema) == [".spec.groups[0].rules[0].expresion"]


def test_the_component_holds_the_charts_alerts_with_runbooks_under_the_default_base() -> None:
    """The component is the chart's render (tools/chart_manifests; the realk8s tier fails
    on drift); here without Helm: the chart's groups plus runbook_url."""
    base = yaml.safe_load(VALUES.read_text())["runbookBaseURL"].rstrip("/")
    assert base.startswith("https://")
    groups = rule()["spec"]["groups"]
    for group in groups:
        for r in group["rules"]:
            assert r["annotations"].pop("runbook_url") == \
                f"{base}/docs/runbooks.md#{r['alert'].lower()}"
    assert groups == yaml.safe_load(CHART_RULES.read_text())["groups"]


def runbook_sections() -> dict[str, str]:
    """docs/runbooks.md's ``### <Alert>`` sections: GitHub anchor -> text."""
    text = RUNBOOKS.read_text()
    parts = re.split(r"^### (\S+)\n", text, flags=re.M)
    return {parts[i].lower(): parts[i + 1] for i in range(1, len(parts), 2)}


def test_every_alert_has_a_runbook_section_and_every_section_an_alert() -> None:
    sections = runbook_sections()
    names = alerts()
    assert set(sections) == {a.lower() for a in names}
    for anchor, text in sections.items():
        for part in ("**Means**", "**Confirm**", "**Do**"):
            assert part in text, f"runbook {anchor} lacks {part}"
        blocks = re.findall(r"```sh\n(.*?)```", text, flags=re.S)
        assert any(re.search(r"\b(kubectl|curl|journalctl)\b", b) for b in blocks) or \
            "as for [" in text.lower(), f"runbook {anchor} shows no command to confirm it"
    for link in re.findall(r"\]\(#([a-z0-9-]+)\)", RUNBOOKS.read_text()):
        assert link in sections, f"runbooks.md links to a missing section #{link}"


def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus)")
    return path


def rules_file(tmp_path: Path) -> Path:
    path = tmp_path / "rules.yaml"
    path.write_text(yaml.safe_dump(rule()["spec"]))
    return path


def test_promtool_checks_the_expressions(tmp_path: Path) -> None:
    out = subprocess.run([promtool(), "check", "rules", str(rules_file(tmp_path))],
                         capture_output=True, text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in out.stdout


def rendered(alert: str, labels: dict[str, str], value: str) -> dict[str, str]:
    """The annotations Prometheus renders for ``alert`` with ``labels`` and ``value``
    (the few template forms the rules use; anything else is left and would mismatch)."""
    out = {}
    for key, text in alerts()[alert]["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels.get(m.group(1), ""), text)
        text = text.replace('{{ $value | printf "%.1f" }}', f"{float(value):.1f}")
        out[key] = text.replace("{{ $value }}", value)
    return out


AGENT = {"job": "imex-host-agent", "namespace": "imex-system"}
A = {**AGENT, "instance": "10.0.0.1:8080"}
B = {**AGENT, "instance": "10.0.0.2:8080"}
ENS = {"namespace": "gpu", "ensemble": "gb200"}


def series(name: str, labels: dict[str, str], values: str) -> dict[str, str]:
    text = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return {"series": f"{name}{{{text}}}", "values": values}


def healthy() -> list[dict[str, str]]:
    """Two replicas, A leading, an ensemble UP: what no alert may fire on (30 minutes)."""
    n = "x30"
    writes = {"verb": "update", "resource": "leases"}
    return [
        series("up", A, "1" + f"+0{n}"), series("up", B, "1" + f"+0{n}"),
        series("imex_host_agent_leader", A, f"1+0{n}"),
        series("imex_host_agent_leader", B, f"0+0{n}"),
        series("imex_host_agent_leader_elect", A, f"1+0{n}"),
        series("imex_host_agent_leader_elect", B, f"1+0{n}"),
        series("imex_host_agent_api_requests_total", {**A, **writes, "code": "200"},
               f"0+30{n}"),
        series("imex_host_agent_api_requests_total", {**A, **writes, "code": "409"},
               f"0+1{n}"),
        # watches end normally about every 5 minutes; a 410 once in a while
        series("imex_host_agent_watch_restarts_total",
               {**A, "kind": "VirtualMachineInstance", "reason": "closed"}, f"0+0.2{n}"),
        series("imex_host_agent_watch_restarts_total",
               {**A, "kind": "VirtualMachineInstance", "reason": "gone"}, f"0+0.1{n}"),
        series("imex_registry_generation", {**A, **ENS}, f"7+0{n}"),
        series("imex_registry_generation", {**B, **ENS}, f"7+0{n}"),
        series("imex_registry_requests_total", {**A, "code": "200", "route": "r"}, f"0+100{n}"),
        series("imex_registry_requests_total", {**A, "code": "500", "route": "r"}, f"0+1{n}"),
        series("imex_registry_auth_failures_total", {**A, "reason": "wrong_token"},
               f"0+0.5{n}"),
        series("imex_ensemble_domain_status", {**A, **ENS, "status": "UP"}, f"1+0{n}"),
        series("imex_ensemble_domain_status", {**A, **ENS, "status": "DEGRADED"}, f"0+0{n}"),
        series("imex_ensemble_cliques", {**A, **ENS}, f"1+0{n}"),
        series("imex_ensemble_silent_members", {**A, **ENS}, f"0+0{n}"),
        series("imex_ensemble_guest_checks", {**A, **ENS, "check": "dns", "result": "PASS"},
               f"4+0{n}"),
        series("imex_ensemble_cliques_shared", {**A, **ENS}, f"0+0{n}"),
    ]


#: alert -> (input series that fire it, eval time before it may fire, eval time when it
#: fires, the alert's labels, its $value as Prometheus prints it)
FIRING: dict[str, tuple[list[dict[str, str]], str, str, dict[str, str], str]] = {
    "ImexHostAgentAbsent": ([series("up", A, "0x20")], "4m", "6m", {}, "1"),
    "ImexHostAgentNoLeader": (
        [series("imex_host_agent_leader", A, "1 0x20"), series("imex_host_agent_leader", B, "0x20"),
         series("imex_host_agent_leader_elect", A, "1x20"),
         series("imex_host_agent_leader_elect", B, "1x20")],
        "1m", "3m", AGENT, "0"),
    "ImexHostAgentApiWritesFailing": (
        [series("imex_host_agent_api_requests_total",
                {**A, "verb": "apply", "resource": "endpointslices", "code": "403"}, "0+9x20"),
         series("imex_host_agent_api_requests_total",
                {**A, "verb": "update", "resource": "leases", "code": "200"}, "0+1x20")],
        "5m", "8m", A, "0.9"),
    "ImexHostAgentWatchRestarting": (
        [series("imex_host_agent_watch_restarts_total",
                {**A, "kind": "Service", "reason": "error"}, "0+1x20")],
        "2m", "12m", {**A, "kind": "Service"}, "10"),
    "ImexRegistryGenerationBehind": (
        [series("imex_registry_generation", {**A, **ENS}, "7 8x20"),
         series("imex_registry_generation", {**B, **ENS}, "7x20")],
        "2m", "4m", {**B, **ENS}, "1"),
    "ImexRegistryErrors": (
        [series("imex_registry_requests_total", {**A, "route": "r", "code": "503"}, "0+10x20"),
         series("imex_registry_requests_total", {**A, "route": "r", "code": "200"}, "0+10x20")],
        "5m", "8m", A, "0.5"),
    "ImexGuestReportsRefused": (
        [series("imex_registry_auth_failures_total", {**A, "reason": "wrong_token"},
                "0+6x20")],
        "10m", "13m", {**A, "reason": "wrong_token"}, "6"),
    "ImexDomainDegraded": (
        [series("imex_ensemble_domain_status", {**A, **ENS, "status": "DEGRADED"},
                "0 1x20")],
        "2m", "4m", ENS, "1"),
    "ImexDomainDown": (
        [series("imex_ensemble_domain_status", {**A, **ENS, "status": "DOWN"}, "0 1x20")],
        "2m", "4m", ENS, "1"),
    "ImexEnsembleSplitClique": (
        [series("imex_ensemble_cliques", {**A, **ENS}, "1 1 2x20")], "2m", "4m", ENS, "2"),
    "ImexGuestSilent": (
        [series("imex_ensemble_silent_members", {**A, **ENS}, "0 0 0 1x20")],
        "7m", "9m", ENS, "1"),
    "ImexGuestChecksFailing": (
        [series("imex_ensemble_guest_checks", {**A, **ENS, "check": "dns", "result": "FAIL"},
                "2x20")],
        "14m", "16m", {**ENS, "check": "dns"}, "2"),
    "ImexCliqueShared": (
        [series("imex_ensemble_cliques_shared", {**A, **ENS}, "1x20")],
        "9m", "11m", ENS, "1"),
}


def test_every_alert_has_a_firing_case() -> None:
    assert set(FIRING) == set(alerts())


def test_the_alerts_fire_when_they_should_not_before_and_never_on_a_healthy_agent(
        tmp_path: Path) -> None:
    groups: list[dict[str, Any]] = [{
        "name": "healthy", "interval": "1m", "input_series": healthy(),
        "alert_rule_test": [{"eval_time": t, "alertname": a, "exp_alerts": []}
                            for a in alerts() for t in ("11m", "29m")],
    }]
    for alert, (inputs, before, at, labels, value) in FIRING.items():
        severity = alerts()[alert]["labels"]["severity"]
        exp = {**labels, "severity": severity}
        groups.append({"name": alert, "interval": "1m", "input_series": inputs,
                       "alert_rule_test": [
                           {"eval_time": before, "alertname": alert, "exp_alerts": []},
                           {"eval_time": at, "alertname": alert, "exp_alerts": [
                               {"exp_labels": exp,
                                "exp_annotations": rendered(alert, exp, value)}]}]})
    test_file = tmp_path / "alerts.test.yaml"
    test_file.write_text(yaml.safe_dump({"rule_files": [str(rules_file(tmp_path))],
                                         "evaluation_interval": "1m", "tests": groups}))
    out = subprocess.run([promtool(), "test", "rules", str(test_file)], capture_output=True,
                         text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_the_component_builds_beside_base(machine_kubectl: str, tmp_path: Path) -> None:
    """A kustomization with base and the component, as docs/monitoring.md shows it, built by
    the real kubectl: base's objects plus the three monitoring ones."""
    (tmp_path / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
        "resources": [os.path.relpath(REPO / "manifests/base", tmp_path)],
        "components": [os.path.relpath(COMPONENT, tmp_path)]}))
    out = subprocess.run([machine_kubectl, "kustomize", str(tmp_path)], capture_output=True,
                         text=True, timeout=60, check=False)
    assert out.returncode == 0, out.stderr
    kinds = [(d["kind"], d["metadata"]["name"]) for d in yaml.safe_load_all(out.stdout) if d]
    assert {("PrometheusRule", "imex-ensemble"), ("ServiceMonitor", "imex-host-agent"),
            ("ConfigMap", "imex-ensemble-dashboard"), ("Deployment", "imex-host-agent")} \
        <= set(kinds)


def test_docs_monitoring_lists_the_alerts_as_they_are() -> None:
    """docs/monitoring.md's alert table (name, for, severity) and its count are the rules'."""
    doc = (REPO / "docs" / "monitoring.md").read_text()
    rows = re.findall(r"^\| `(Imex\w+)` \| [^|]+ \| ([^|]+) \| (\w+) \|$", doc, flags=re.M)
    want = [(a, r["for"], r["labels"]["severity"]) for a, r in alerts().items()]
    assert [(a, "0m" if f.strip() == "at once" else f.strip(), s) for a, f, s in rows] == want
    assert f"a PrometheusRule with {len(want)} alerts" in doc
