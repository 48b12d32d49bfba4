"""The ImexEnsemble API against the real kube-apiserver (issue 15, API half).

The committed CRD (manifests/crds/crd-imexensembles.yaml) is installed as is; the
apiserver itself enforces its schema and CEL rules, and refuses bad objects naming
the field. `kubectl` is the one build.sh built at the apiserver's version (the
machine's is out of skew): it shows the printer columns. The base RBAC and the
Service admission policy are applied verbatim: the policy is enforced for the host
agent's account and nobody else's, the ClusterRole grants the agent exactly its
list, and the aggregated roles give namespace users ensembles but not their status.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from tests.realk8s.agentproc import (
    AGENT_SA,
    AGENT_SA_NAMESPACE,
    AGENT_USER,
    MANIFESTS,
    apply_base_rbac,
    foreign_service,
    granted_rights,
    may,
)
from tests.realk8s.fixtures import ensemble_service
from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import SERVICES

pytestmark = pytest.mark.realk8s

ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"
MERGE = "application/merge-patch+json"


def ensemble(ns: str, name: str, **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def refused(resp: Any) -> dict[str, str]:
    """The apiserver's 422: field -> message, for each cause."""
    assert resp.status_code == 422, resp.text
    return {c["field"]: c["message"] for c in resp.json()["details"]["causes"]}


@pytest.fixture
def ens_ns(imex_crd: dict[str, Any], namespace: str) -> str:
    return namespace


def test_the_committed_crd_is_accepted_as_written(imex_crd: dict[str, Any],
                                                  admin: Api) -> None:
    stored = admin.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                       f"{imex_crd['metadata']['name']}")
    conds = {c["type"]: c["status"] for c in stored["status"]["conditions"]}
    assert conds["Established"] == "True" and conds["NamesAccepted"] == "True"
    # nothing pruned or rewritten: the schema, CEL rules and columns are as committed
    want = imex_crd["spec"]["versions"][0]  # type: ignore[index]
    (have,) = stored["spec"]["versions"]
    assert have["schema"] == want["schema"]
    assert have["additionalPrinterColumns"] == want["additionalPrinterColumns"]
    assert stored["spec"]["names"]["shortNames"] == ["imexens"]


@pytest.mark.parametrize(("spec", "field", "says"), [
    ({"maxMembers": 0}, "spec.maxMembers", "greater than or equal to 1"),
    ({"maxMembers": 1001}, "spec.maxMembers", "less than or equal to 1000"),
    ({"tokenSHA256": "a" * 63}, "spec.tokenSHA256", "should match '^[0-9a-f]{64}$'"),
    ({"tokenSHA256": "A" * 64}, "spec.tokenSHA256", "should match"),
    ({"mode": "hostnames"}, "spec.mode", 'supported values: "names", "ips"'),
    ({"authEncryption": True, "mode": "ips"}, "spec.authEncryption", "needs mode names"),
    ({"port": 0}, "spec.port", "greater than or equal to 1"),
    ({"memberSelector": {"matchExpressions": [{"key": "rack", "operator": "In"}]}},
     "spec.memberSelector.matchExpressions[0].values", "must be non-empty"),
    ({"memberSelector": {"matchLabels": {"not a key": "x"}}},
     "spec.memberSelector.matchLabels", "valid label key"),
])
def test_bad_ensembles_are_refused_naming_the_field(
        admin: Api, ens_ns: str, spec: dict[str, Any], field: str, says: str) -> None:
    causes = refused(admin.request("POST", ENS.format(ns=ens_ns),
                                   ensemble(ens_ns, "bad", **spec)))
    assert field in causes, causes
    assert says in causes[field]
    assert admin.request("GET", f"{ENS.format(ns=ens_ns)}/bad").status_code == 404


def test_defaults_are_applied_by_the_apiserver(admin: Api, ens_ns: str) -> None:
    made = admin.create(ENS.format(ns=ens_ns), ensemble(ens_ns, "plain"))
    assert made["spec"] == {"maxMembers": 18, "port": 50000, "mode": "names",
                            "authEncryption": False}


def test_immutable_fields_cannot_change_after_creation(admin: Api, ens_ns: str) -> None:
    path = ENS.format(ns=ens_ns)
    admin.create(path, ensemble(ens_ns, "rack", maxMembers=4))
    causes = refused(admin.request("PATCH", f"{path}/rack", {"spec": {"maxMembers": 8}},
                                   content_type=MERGE))
    assert causes["spec.maxMembers"].startswith("Invalid value: 8: maxMembers is immutable")
    causes = refused(admin.request("PATCH", f"{path}/rack", {"spec": {"authEncryption": True}},
                                   content_type=MERGE))
    assert "authEncryption is immutable" in causes["spec.authEncryption"]
    # other fields do change, and a status write is no change to the immutable ones
    ok = admin.ok("PATCH", f"{path}/rack", {"spec": {"port": 50001}}, content_type=MERGE)
    assert ok["metadata"]["generation"] == 2
    status = admin.ok("PATCH", f"{path}/rack/status", {"status": {"publishedSummary": "0/4"}},
                      content_type=MERGE)
    assert status["metadata"]["generation"] == 2


def test_kubectl_names_the_field_of_a_refused_apply(control_plane: ControlPlane,
                                                    ens_ns: str) -> None:
    doc = json.dumps(ensemble(ens_ns, "rack2", maxMembers=4))
    control_plane.kubectl("apply", "-f", "-", stdin=doc)
    changed = json.dumps(ensemble(ens_ns, "rack2", maxMembers=6))
    proc = control_plane.kubectl("apply", "-f", "-", stdin=changed, check=False)
    assert proc.returncode != 0
    assert "spec.maxMembers" in proc.stderr and "immutable" in proc.stderr


def _status(summary: str, ready: str, domain: str, domain_id: str) -> dict[str, Any]:
    return {"status": {"publishedSummary": summary, "imexReady": int(summary.split("/")[0]),
                       "domainStatus": domain, "domainID": domain_id,
                       "conditions": [{"type": "Ready", "status": ready, "reason": "Observed",
                                       "message": "", "lastTransitionTime":
                                           "2026-12-01T00:00:00Z"}]}}


def test_printer_columns_through_kubectl(control_plane: ControlPlane, admin: Api,
                                        ens_ns: str) -> None:
    version = json.loads(control_plane.kubectl("version", "--client", "-o", "json").stdout)
    assert version["clientVersion"]["gitVersion"] == "v1.37.2"  # never the machine's kubectl
    path = ENS.format(ns=ens_ns)
    admin.create(path, ensemble(ens_ns, "gb200", maxMembers=18))
    admin.create(path, ensemble(ens_ns, "small", maxMembers=2, mode="ips"))
    admin.ok("PATCH", f"{path}/gb200/status", _status("3/18", "True", "UP", "0a1b2c3d"),
             content_type=MERGE)
    out = control_plane.kubectl("get", "imexensembles", "-A").stdout.splitlines()
    assert out[0].split() == ["NAMESPACE", "NAME", "MEMBERS", "IMEX-READY", "READY", "DOMAIN",
                              "AGE"]
    rows = {line.split()[1]: line.split() for line in out[1:] if line.split()[0] == ens_ns}
    assert rows["gb200"][2:6] == ["3/18", "3", "True", "UP"]
    # no status yet: the apiserver sends null cells, which kubectl leaves blank
    assert len(rows["small"]) == 3 and re.fullmatch(r"\d+s", rows["small"][2])
    wide = control_plane.kubectl("get", "imexens", "-n", ens_ns, "-o", "wide").stdout
    head, *lines = wide.splitlines()
    assert head.split() == ["NAME", "MEMBERS", "IMEX-READY", "READY", "DOMAIN", "AGE", "MODE",
                            "DOMAIN-ID"]
    by_name = {line.split()[0]: line.split() for line in lines}
    assert by_name["gb200"][-2:] == ["names", "0a1b2c3d"]
    assert "ips" in by_name["small"]


def test_kubectl_describe_shows_spec_and_status(control_plane: ControlPlane, admin: Api,
                                                ens_ns: str) -> None:
    path = ENS.format(ns=ens_ns)
    admin.create(path, ensemble(ens_ns, "gb200", maxMembers=18))
    admin.ok("PATCH", f"{path}/gb200/status", _status("3/18", "False", "DEGRADED", "0a1b2c3d"),
             content_type=MERGE)
    text = control_plane.kubectl("describe", "imexensemble", "gb200", "-n", ens_ns).stdout
    for line in (r"Max Members:\s+18", r"Published Summary:\s+3/18",
                 r"Domain Status:\s+DEGRADED", r"Type:\s+Ready"):
        assert re.search(line, text), text


# ---- the agent's rights and the Service admission policy ----------------------

@pytest.fixture(scope="module")
def agent_api(control_plane: ControlPlane) -> Iterator[Api]:
    """The host agent's identity (base ServiceAccount, ClusterRole, policy applied)."""
    apply_base_rbac(control_plane)
    token = control_plane.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
    api = Api(control_plane.server, control_plane.ca, token)
    try:
        yield api
    finally:
        api.close()


def test_the_clusterrole_grants_the_agent_exactly_its_list(
        control_plane: ControlPlane, agent_api: Api) -> None:
    admin = control_plane.admin
    assert admin is not None
    for right in sorted(granted_rights()):
        assert may(admin, AGENT_USER, *right), right
    for right in [("imex-ensemble.io", "imexensembles", "create"),
                  ("imex-ensemble.io", "imexensembles", "patch"),
                  ("imex-ensemble.io", "imexensembles", "delete"),
                  ("imex-ensemble.io", "imexensembles/status", "get"),
                  ("", "services", "update"), ("", "services", "get"),
                  ("", "events", "create"), ("", "secrets", "get"), ("", "pods", "list"),
                  ("events.k8s.io", "events", "delete")]:
        assert not may(admin, AGENT_USER, *right), right


def _as_agent(api: Api, method: str, path: str, body: Any = None) -> Any:
    return api.request(method, path, body,
                       content_type=MERGE if method == "PATCH" else "application/json")


def test_the_policy_lets_the_agent_write_only_ensemble_services(
        control_plane: ControlPlane, agent_api: Api, namespace: str) -> None:
    admin = control_plane.admin
    assert admin is not None
    svcs = SERVICES.format(ns=namespace)
    ok = _as_agent(agent_api, "POST", svcs, ensemble_service(namespace, "rack"))
    assert ok.status_code == 201, ok.text
    denied = {
        "a LoadBalancer": foreign_service(namespace, "lb"),
        "a selector": {**ensemble_service(namespace, "sel"),
                       "spec": {"clusterIP": "None", "selector": {"app": "x"},
                                "ports": [{"name": "imex", "port": 50000}]}},
        "a cluster IP": {**ensemble_service(namespace, "cip"),
                         "spec": {"ports": [{"name": "imex", "port": 50000}]}},
        "no ensemble label": {**ensemble_service(namespace, "nolabel"),
                              "metadata": {"name": "nolabel", "namespace": namespace}},
        "another ensemble's label": {**ensemble_service(namespace, "other"),
                                     "metadata": {"name": "other", "namespace": namespace,
                                                  "labels": {"imex-ensemble.io/ensemble":
                                                             "rack"}}},
    }
    for what, body in denied.items():
        resp = _as_agent(agent_api, "POST", svcs, body)
        assert resp.status_code == 403, (what, resp.text)
        assert "ValidatingAdmissionPolicy 'imex-host-agent-services'" in resp.json()["message"]
    # a Service someone else made is not the agent's to change or delete...
    admin.create(svcs, foreign_service(namespace, "theirs"))
    for method, body in (("PATCH", {"metadata": {"labels": {
            "imex-ensemble.io/ensemble": "theirs"}}}), ("DELETE", None)):
        resp = _as_agent(agent_api, method, f"{svcs}/theirs", body)
        assert resp.status_code == 403, (method, resp.text)
    # ...its own ones are: adopting labels it already carries, then deleting it
    own = _as_agent(agent_api, "PATCH", f"{svcs}/rack", {"metadata": {"annotations": {
        "imex-ensemble.io/port": "50000"}}})
    assert own.status_code == 200, own.text
    assert _as_agent(agent_api, "DELETE", f"{svcs}/rack").status_code == 200
    # and nobody else is bound by the policy
    assert admin.request("POST", svcs, foreign_service(namespace, "lb2")).status_code == 201


def test_kubectl_applies_the_whole_base(control_plane: ControlPlane,
                                        imex_crd: dict[str, Any]) -> None:
    """What an operator runs: every object of manifests/base is accepted as rendered
    (kustomize stamps its namespace on the cluster-scoped policies; kubectl drops it)."""
    proc = control_plane.kubectl("apply", "-k", str(MANIFESTS))
    for kind in ("customresourcedefinition.apiextensions.k8s.io/imexensembles.imex-ensemble.io",
                 "validatingadmissionpolicy.admissionregistration.k8s.io/imex-host-agent-services",
                 "clusterrole.rbac.authorization.k8s.io/imex-ensemble-view",
                 "deployment.apps/imex-host-agent"):
        assert kind in proc.stdout, proc.stdout
    again = control_plane.kubectl("apply", "-k", str(MANIFESTS), "--dry-run=server")
    # A PodDisruptionBudget's spec.selector has patchStrategy=replace, so kubectl sends
    # it on every apply (and says "configured") whatever the manifest says.
    rewritten = [line for line in again.stdout.splitlines() if " configured" in line
                 and not line.startswith("poddisruptionbudget.policy/")]
    assert not rewritten, again.stdout


def test_namespace_users_get_ensembles_through_aggregation(
        control_plane: ControlPlane, namespace: str) -> None:
    admin = control_plane.admin
    assert admin is not None
    users = {}
    for role in ("edit", "view"):
        name = f"{role}-user-{uuid.uuid4().hex[:4]}"
        control_plane.service_account_token(namespace, name)
        admin.create(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{namespace}/rolebindings",
                     {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
                      "metadata": {"name": name, "namespace": namespace},
                      "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                  "kind": "ClusterRole", "name": role},
                      "subjects": [{"kind": "ServiceAccount", "name": name,
                                    "namespace": namespace}]})
        users[role] = f"system:serviceaccount:{namespace}:{name}"
    apply_base_rbac(control_plane)  # the aggregate-to-* roles come with the base
    group = "imex-ensemble.io"
    wait_until(lambda: may(admin, users["edit"], group, "imexensembles", "create", namespace),
               "the edit role to aggregate imexensembles", 60)
    assert may(admin, users["edit"], group, "imexensembles", "delete", namespace)
    assert not may(admin, users["edit"], group, "imexensembles/status", "patch", namespace)
    wait_until(lambda: may(admin, users["view"], group, "imexensembles", "list", namespace),
               "the view role to aggregate imexensembles", 60)
    assert may(admin, users["view"], group, "imexensembles/status", "get", namespace)
    assert not may(admin, users["view"], group, "imexensembles", "create", namespace)
    assert not may(admin, users["edit"], group, "imexensembles", "create", "other-namespace")
