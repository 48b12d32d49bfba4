"""The Helm chart (charts/imex-ensemble) rendered by the real Helm and judged by the real
apiserver: lint, the schema's refusals, one source with manifests/ (a test fails on
drift), and every object of a default and a non-default render accepted by
``kubectl apply --dry-run=server --validate=strict``, the Prometheus Operator's CRDs
loaded for the monitoring kinds. Installing, upgrading and removing it is
test_chart_lifecycle.py's."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import prometheus_operator
from tests.realk8s.harness import ControlPlane, HarnessError
from tests.realk8s.installs import CHART, Helm
from tools import chart_manifests
from tools.chart_manifests import HELM_LABELS, helm_template, stale

pytestmark = pytest.mark.realk8s

REPO = Path(__file__).resolve().parents[2]
NON_DEFAULT: dict[str, Any] = {
    "image": {"repository": "registry.internal/imex/imex-host-agent", "tag": "9.9.9",
              "pullPolicy": "Always"},
    "imagePullSecrets": [{"name": "regcred"}],
    "replicas": 3,
    "leaderElection": {"enabled": True, "leaseDuration": 20, "renewDeadline": 15,
                       "retryPeriod": 3},
    "resources": {"requests": {"cpu": "100m", "memory": "128Mi"},
                  "limits": {"memory": "1Gi"}},
    "nodeSelector": {"node-role.kubernetes.io/control-plane": ""},
    "tolerations": [{"key": "node-role.kubernetes.io/control-plane", "operator": "Exists",
                     "effect": "NoSchedule"}],
    "affinity": {"nodeAffinity": {"requiredDuringSchedulingIgnoredDuringExecution": {
        "nodeSelectorTerms": [{"matchExpressions": [
            {"key": "kubernetes.io/arch", "operator": "In", "values": ["arm64"]}]}]}}},
    "priorityClassName": "system-cluster-critical",
    "registryTLS": {"mode": "secret", "port": 9443, "secretName": "imex-registry-cert",
                    "sans": [], "plainHTTP": False},
    "logLevel": "debug",
    "logFormat": "text",
    "metrics": {"serviceMonitor": {"enabled": True, "interval": "15s",
                                   "labels": {"release": "prometheus"}}},
    "prometheusRule": {"enabled": True, "labels": {"release": "prometheus"}},
    "runbookBaseURL": "https://runbooks.example.com/imex/",
    "grafanaDashboard": {"enabled": True, "namespace": "rk8s-chart-grafana",
                         "labels": {"grafana_dashboard": "1", "team": "gpu"}},
    "networkPolicy": {"enabled": True, "monitoring": {
        "namespaceSelector": {"matchLabels": {"team": "observability"}},
        "podSelector": {"matchLabels": {"app.kubernetes.io/name": "prometheus"}}}},
    "rbac": {"scope": "namespaced", "namespaces": ["rk8s-chart-vms-a", "rk8s-chart-vms-b"]},
    "admissionPolicy": {"enabled": True},
    "openshift": True,
}


def objects(text: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(text) if d]


def key(obj: dict[str, Any]) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def without_helm_labels(obj: dict[str, Any]) -> dict[str, Any]:
    """The object as kustomize has it: Helm's standard labels removed everywhere."""
    obj = json.loads(json.dumps(obj))
    metas = [obj["metadata"]]
    if obj["kind"] == "Deployment":
        metas.append(obj["spec"]["template"]["metadata"])
    for meta in metas:
        for label in HELM_LABELS:
            meta.get("labels", {}).pop(label, None)
    return obj


def chart_objects(helm: Helm, *args: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    text = helm_template(helm.binary, *args)
    return {key(o): without_helm_labels(o) for o in objects(text)}


def kustomize(cp: ControlPlane, directory: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    out = objects(cp.kubectl("kustomize", str(REPO / "manifests" / directory)).stdout)
    return {key(o): o for o in out
            if o["kind"] not in ("CustomResourceDefinition", "Namespace")}


def test_helm_lints_the_chart_with_default_and_other_values(helm: Helm, tmp_path: Path) -> None:
    assert helm.binary.is_file(), f"no helm beside kubectl in {helm.binary.parent}"
    version = helm.run("version", "--short").stdout
    assert version.startswith("v4.3.2"), version
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump(NON_DEFAULT))
    for extra in ((), ("--values", str(values))):
        out = helm.run("lint", "--strict", str(CHART), *extra)
        assert "1 chart(s) linted, 0 chart(s) failed" in out.stdout, out.stdout


def test_manifests_agent_is_generated_from_the_chart(helm: Helm) -> None:
    assert stale(helm.binary) == [], "run: python -m tools.chart_manifests"


@pytest.mark.parametrize(("directory", "args"), [
    ("agent", ()),
    ("overlays/namespaced", ("--set", "rbac.scope=namespaced",
                             "--set", "rbac.namespaces={gpu-jobs}")),
    ("overlays/openshift", ("--set", "openshift=true")),
])
def test_the_chart_renders_what_kustomize_builds(control_plane: ControlPlane, helm: Helm,
                                                 directory: str, args: tuple[str, ...]) -> None:
    """Release imex-ensemble in imex-system, Helm's standard labels removed: the chart's
    objects are the kustomize directory's agent objects, with its overlay's values."""
    assert chart_objects(helm, *args) == kustomize(control_plane, directory)


@pytest.mark.parametrize(("args", "named"), [
    (("--set", "replicas=two"), "replicas"),
    (("--set", "replica=2"), "replica"),
    (("--set", "networkPolicy.monitoring.namespace=monitoring"), "namespace"),
    (("--set", "logLevel=verbose"), "logLevel"),
    (("--set", "rbac.scope=namespaced"), "namespaces"),
    (("--set", "metrics.serviceMonitor.enabled=yes"), "enabled"),
])
def test_the_schema_refuses_naming_the_key(helm: Helm, args: tuple[str, ...],
                                           named: str) -> None:
    with pytest.raises(chart_manifests.ChartError) as refused:
        helm_template(helm.binary, *args)
    assert "values don't meet the specifications of the schema" in str(refused.value)
    assert named in str(refused.value)


def test_more_replicas_than_one_need_leader_election(helm: Helm) -> None:
    with pytest.raises(chart_manifests.ChartError, match=r"needs leaderElection\.enabled"):
        helm_template(helm.binary, "--set", "leaderElection.enabled=false")
    one = chart_objects(helm, "--set", "leaderElection.enabled=false", "--set", "replicas=1")
    dep = one[("Deployment", "imex-system", "imex-host-agent")]
    assert dep["spec"]["strategy"] == {"type": "Recreate"}
    assert "--leader-elect" not in dep["spec"]["template"]["spec"]["containers"][0]["args"]
    assert ("PodDisruptionBudget", "imex-system", "imex-host-agent") not in one


def test_the_registry_tls_values_reach_the_args_ports_probes_and_policy(helm: Helm) -> None:
    default = chart_objects(helm)
    (c,) = default[("Deployment", "imex-system", "imex-host-agent")]["spec"]["template"][
        "spec"]["containers"]
    assert c["args"][:3] == ["--listen=0.0.0.0:8080", "--tls-listen=0.0.0.0:8443",
                             "--tls-self-issued"]
    assert [p["containerPort"] for p in c["ports"]] == [8080, 8443]
    svc = default[("Service", "imex-system", "imex-host-agent")]
    assert [(p["name"], p["port"]) for p in svc["spec"]["ports"]] == [
        ("registry", 8080), ("registry-tls", 8443)]
    own = chart_objects(helm, "--set", "registryTLS.mode=secret",
                        "--set", "registryTLS.secretName=mine", "--set", "registryTLS.port=9443",
                        "--set", "registryTLS.plainHTTP=false")
    spec = own[("Deployment", "imex-system", "imex-host-agent")]["spec"]["template"]["spec"]
    (c,) = spec["containers"]
    assert c["args"][:4] == ["--listen=", "--tls-listen=0.0.0.0:9443",
                             "--tls-cert-file=/etc/imex-registry-tls/tls.crt",
                             "--tls-private-key-file=/etc/imex-registry-tls/tls.key"]
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "registry-tls",
                                              "scheme": "HTTPS"}
    assert {"name": "registry-tls", "secret": {"secretName": "mine"}} in spec["volumes"]
    policy = own[("NetworkPolicy", "imex-system", "imex-host-agent")]
    assert policy["spec"]["ingress"][0]["ports"] == [{"protocol": "TCP", "port": 9443}]
    off = chart_objects(helm, "--set", "registryTLS.mode=off")
    (c,) = off[("Deployment", "imex-system", "imex-host-agent")]["spec"]["template"]["spec"][
        "containers"]
    assert not [a for a in c["args"] if a.startswith("--tls")]
    with pytest.raises(chart_manifests.ChartError, match=r"needs registryTLS\.secretName"):
        helm_template(helm.binary, "--set", "registryTLS.mode=secret")
    with pytest.raises(chart_manifests.ChartError, match="no listener"):
        helm_template(helm.binary, "--set", "registryTLS.mode=off",
                      "--set", "registryTLS.plainHTTP=false")


def test_the_rules_carry_their_runbooks(helm: Helm) -> None:
    rendered = chart_objects(helm, "--set", "prometheusRule.enabled=true",
                             "--set", "runbookBaseURL=https://runbooks.example.com/imex/")
    rule = rendered[("PrometheusRule", "imex-system", "imex-ensemble")]
    chart_rules = yaml.safe_load((CHART / "files/prometheus-rules.yaml").read_text())
    for group in rule["spec"]["groups"]:
        for r in group["rules"]:
            assert r["annotations"].pop("runbook_url") == \
                f"https://runbooks.example.com/imex/docs/runbooks.md#{r['alert'].lower()}"
    assert rule["spec"]["groups"] == chart_rules["groups"]
    with pytest.raises(chart_manifests.ChartError, match="runbookBaseURL"):
        chart_objects(helm, "--set", "prometheusRule.enabled=true", "--set", "runbookBaseURL=")


def test_the_monitoring_objects_keep_the_ensembles_labels_and_carry_the_dashboard(
        helm: Helm) -> None:
    rendered = chart_objects(helm, "--set", "metrics.serviceMonitor.enabled=true",
                             "--set", "grafanaDashboard.enabled=true",
                             "--set", "grafanaDashboard.namespace=grafana")
    monitor = rendered[("ServiceMonitor", "imex-system", "imex-host-agent")]
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True  # namespace, not exported_
    cm = rendered[("ConfigMap", "grafana", "imex-ensemble-dashboard")]
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = (CHART / "dashboards/imex-ensemble.json").read_text()
    assert json.loads(cm["data"]["imex-ensemble.json"]) == json.loads(dashboard)


@pytest.fixture(scope="module")
def monitoring_crds(control_plane: ControlPlane) -> None:
    """The Prometheus Operator's CRDs, as published, in the session's apiserver."""
    for kind in ("ServiceMonitor", "PrometheusRule"):
        control_plane.apply_crd(prometheus_operator.crd(kind))


@pytest.mark.parametrize("values", ["default", "non-default"])
def test_every_object_is_accepted_by_the_apiserver(control_plane: ControlPlane, helm: Helm,
                                                   monitoring_crds: None, values: str,
                                                   tmp_path: Path) -> None:
    """`kubectl apply --dry-run=server --validate=strict` of every object (the CRDs of
    crds/ too): the apiserver's own schemas, unknown fields refused."""
    admin = control_plane.admin
    assert admin is not None
    ns = "imex-system" if values == "default" else "rk8s-chart-ops"
    args: list[str] = []
    if values == "non-default":
        path = tmp_path / "values.yaml"
        path.write_text(yaml.safe_dump(NON_DEFAULT))
        args = ["--values", str(path)]
    for name in (ns, *NON_DEFAULT["rbac"]["namespaces"],
                 NON_DEFAULT["grafanaDashboard"]["namespace"]):
        admin.apply(f"/api/v1/namespaces/{name}",
                    {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    text = helm_template(helm.binary, "--include-crds", *args, namespace=ns)
    kinds = {o["kind"] for o in objects(text)}
    if values == "non-default":
        assert {"ServiceMonitor", "PrometheusRule", "Role", "ConfigMap"} <= kinds
        assert "ClusterRoleBinding" not in kinds
    assert "CustomResourceDefinition" in kinds
    try:
        out = control_plane.kubectl("apply", "--dry-run=server", "--validate=strict",
                                    "-f", "-", stdin=text)
    except HarnessError as exc:
        pytest.fail(f"the apiserver refused the {values} render: {exc}")
    assert out.stdout.count("(server dry run)") == len(objects(text)), out.stdout
