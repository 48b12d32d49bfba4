"""RBAC and SelfSubjectAccessReview: the API double (tests/sandbox/kube_api/rbac.py) answers
as kube-apiserver does.

The host agent's readiness asks a SelfSubjectAccessReview for every verb its
configuration needs, and tests in make test run it against the double with the
manifests' RBAC; so the double's answers must be the apiserver's. The same script runs
against both, each with a fresh namespace of the same name: ServiceAccounts minted
tokens by the TokenRequest API, ClusterRoles (one aggregated), Roles and bindings
(one to a role that does not exist), then reviews (the ``status`` compared whole:
allowed, reason word for word) and refused requests (code, reason, message and details
compared), a dry-run create in a namespace that does not exist (how the agent checks
that its own namespace exists), a token request for a missing account and a token of
a deleted account. Every disagreement is listed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import wait_namespace_absent
from tests.sandbox.kube_api.server import ThreadedKubeApi

pytestmark = pytest.mark.realk8s

RBAC = "/apis/rbac.authorization.k8s.io/v1"
SSAR = "/apis/authorization.k8s.io/v1/selfsubjectaccessreviews"
NS = "rbac-parity"
#: every name this script creates at the cluster scope starts with this
PREFIX = "rbac-parity-"


def _role(kind: str, name: str, rules: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, **extra.pop("metadata", {})}
    if kind == "Role":
        meta["namespace"] = NS
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta,
            "rules": rules, **extra}


def _binding(kind: str, name: str, role_kind: str, role: str,
             subjects: list[dict[str, Any]]) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if kind == "RoleBinding":
        meta["namespace"] = NS
    return {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": kind, "metadata": meta,
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": role_kind,
                        "name": role}, "subjects": subjects}


AGENT = {"kind": "ServiceAccount", "name": "agent", "namespace": NS}


def setup(admin: Api) -> None:
    wait_namespace_absent(admin, NS)  # a run before this one deleted it (asynchronously)
    admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                        "metadata": {"name": NS}})
    for sa in ("agent", "nobody", "doomed"):
        admin.create(f"/api/v1/namespaces/{NS}/serviceaccounts",
                     {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": sa}})
    objs = [
        ("clusterroles", _role("ClusterRole", PREFIX + "reader", [
            {"apiGroups": [""], "resources": ["services"], "verbs": ["list", "watch"]},
            {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
             "verbs": ["*"]}])),
        ("clusterroles", _role("ClusterRole", PREFIX + "agg-part", [
            {"apiGroups": [""], "resources": ["pods"], "verbs": ["get"]}],
            metadata={"labels": {"rbac-parity/agg": "true"}})),
        ("clusterroles", _role("ClusterRole", PREFIX + "agg", [], aggregationRule={
            "clusterRoleSelectors": [{"matchLabels": {"rbac-parity/agg": "true"}}]})),
        ("clusterrolebindings", _binding("ClusterRoleBinding", PREFIX + "reader",
                                         "ClusterRole", PREFIX + "reader", [AGENT])),
        ("clusterrolebindings", _binding("ClusterRoleBinding", PREFIX + "missing",
                                         "ClusterRole", PREFIX + "no-such-role", [AGENT])),
        (f"namespaces/{NS}/roles", _role("Role", "cm", [
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["get"],
             "resourceNames": ["one"]},
            {"apiGroups": [""], "resources": ["configmaps"], "verbs": ["create"]},
            {"apiGroups": ["imex-ensemble.io"], "resources": ["*/status"],
             "verbs": ["patch"]}])),
        # a subject without a namespace is the binding's namespace's account
        (f"namespaces/{NS}/rolebindings", _binding(
            "RoleBinding", "cm", "Role", "cm", [{"kind": "ServiceAccount", "name": "agent"}])),
        (f"namespaces/{NS}/rolebindings", _binding(
            "RoleBinding", "agg", "ClusterRole", PREFIX + "agg", [AGENT])),
        (f"namespaces/{NS}/rolebindings", _binding(
            "RoleBinding", "missing", "Role", "no-such-role", [AGENT])),
        (f"namespaces/{NS}/rolebindings", _binding(
            "RoleBinding", "doomed", "ClusterRole", PREFIX + "reader",
            [{"kind": "ServiceAccount", "name": "doomed", "namespace": NS}])),
    ]
    for path, body in objs:
        admin.create(f"{RBAC}/{path}", body)


def teardown(admin: Api) -> None:
    for kind in ("clusterrolebindings", "clusterroles"):
        for item in admin.get(f"{RBAC}/{kind}")["items"]:
            if item["metadata"]["name"].startswith(PREFIX):
                admin.delete(f"{RBAC}/{kind}/{item['metadata']['name']}")
    admin.delete(f"/api/v1/namespaces/{NS}")


def token(admin: Api, sa: str) -> str:
    tr = admin.create(f"/api/v1/namespaces/{NS}/serviceaccounts/{sa}/token",
                      {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                       "spec": {"expirationSeconds": 3600}})
    return str(tr["status"]["token"])


def review(api: Api, verb: str, resource: str, group: str = "", namespace: str = "",
           name: str = "", subresource: str = "") -> Any:
    attrs = {k: v for k, v in {"verb": verb, "resource": resource, "group": group,
                               "namespace": namespace, "name": name,
                               "subresource": subresource}.items() if v}
    resp = api.request("POST", SSAR, {"apiVersion": "authorization.k8s.io/v1",
                                      "kind": "SelfSubjectAccessReview",
                                      "spec": {"resourceAttributes": attrs}})
    return resp.status_code, resp.json().get("status")


def refusal(resp: Any) -> Any:
    body = resp.json() if resp.headers.get("content-type", "").startswith(
        "application/json") else resp.text
    if not isinstance(body, dict):
        return resp.status_code, body
    return (resp.status_code, body.get("reason"), body.get("message"), body.get("details"))


Script = list[tuple[str, Callable[[], Any]]]


def script(admin: Api, agent: Api, nobody: Api, doomed: Api) -> Script:
    def ask(who: Api, *args: str, **kw: str) -> Callable[[], Any]:
        return lambda: review(who, *args, **kw)

    def call(who: Api, method: str, path: str, body: Any = None,
             **params: str) -> Callable[[], Any]:
        return lambda: refusal(who.request(method, path, body, params=params or None))

    cm = {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "probe"}}

    def deleted_account() -> Any:
        def code() -> int:
            return doomed.request("GET", f"/api/v1/namespaces/{NS}/services").status_code
        before = code()
        admin.delete(f"/api/v1/namespaces/{NS}/serviceaccounts/doomed")
        # the apiserver's account lookup is an informer's cache: moments, not at once
        wait_until(lambda: code() != before, "the deleted account's token to stop working", 30)
        return before, code()

    return [
        ("list services, all namespaces (ClusterRoleBinding)",
         ask(agent, "list", "services")),
        ("watch services in the namespace", ask(agent, "watch", "services", namespace=NS)),
        ("create services: denied, both missing roles named",
         ask(agent, "create", "services", namespace=NS)),
        ("verb * on endpointslices", ask(agent, "delete", "endpointslices",
                                         "discovery.k8s.io", NS, "x")),
        ("get configmap one (resourceNames)", ask(agent, "get", "configmaps", namespace=NS,
                                                  name="one")),
        ("get configmap two: denied", ask(agent, "get", "configmaps", namespace=NS,
                                          name="two")),
        ("create configmaps (RoleBinding, subject without namespace)",
         ask(agent, "create", "configmaps", namespace=NS)),
        ("patch */status", ask(agent, "patch", "imexensembles", "imex-ensemble.io", NS,
                               subresource="status")),
        ("patch the main resource: denied", ask(agent, "patch", "imexensembles",
                                                "imex-ensemble.io", NS)),
        ("get pods (aggregated ClusterRole)", ask(agent, "get", "pods", namespace=NS)),
        ("create selfsubjectaccessreviews (system:basic-user)",
         ask(agent, "create", "selfsubjectaccessreviews", "authorization.k8s.io")),
        ("create configmaps elsewhere: denied", ask(agent, "create", "configmaps",
                                                    namespace="default")),
        ("no bindings at all: denied, no reason", ask(nobody, "list", "services",
                                                      namespace=NS)),
        ("system:masters", ask(admin, "delete", "nodes")),
        ("refused: get a configmap", call(agent, "GET", f"/api/v1/namespaces/{NS}/configmaps/two")),
        ("refused: list configmaps", call(agent, "GET", f"/api/v1/namespaces/{NS}/configmaps")),
        ("refused: list VMIs by name (fieldSelector names the object)",
         call(agent, "GET", f"/apis/kubevirt.io/v1/namespaces/{NS}/virtualmachineinstances",
              fieldSelector="metadata.name=gb200-0")),
        ("refused: list services cluster-wide, no bindings",
         call(nobody, "GET", "/api/v1/services")),
        ("refused: patch a status", call(nobody, "PATCH",
                                         f"/api/v1/namespaces/{NS}/services/x/status", {})),
        ("allowed: list services", lambda: agent.request(
            "GET", f"/api/v1/namespaces/{NS}/services").status_code),
        ("dry-run create in a namespace that does not exist",
         call(admin, "POST", "/api/v1/namespaces/rbac-parity-absent/configmaps", cm,
              dryRun="All")),
        ("dry-run create where it exists: nothing stored", lambda: (
            refusal(agent.request("POST", f"/api/v1/namespaces/{NS}/configmaps", cm,
                                  params={"dryRun": "All"}))[0],
            admin.request("GET", f"/api/v1/namespaces/{NS}/configmaps/probe").status_code)),
        ("token for a missing account", call(
            admin, "POST", f"/api/v1/namespaces/{NS}/serviceaccounts/ghost/token",
            {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}})),
        ("a deleted account's token", deleted_account),
    ]


def run(admin: Api, make_api: Callable[[str], Api]) -> dict[str, Any]:
    setup(admin)
    apis = {sa: make_api(token(admin, sa)) for sa in ("agent", "nobody", "doomed")}
    try:
        # the aggregation controller fills the aggregated role moments after it is made
        wait_until(lambda: review(apis["agent"], "get", "pods", namespace=NS)[1]["allowed"],
                   "the aggregated ClusterRole's rules", 30)
        return {name: step() for name, step in script(admin, apis["agent"], apis["nobody"],
                                                       apis["doomed"])}
    finally:
        for api in apis.values():
            api.close()
        teardown(admin)


@pytest.fixture
def double() -> Iterator[ThreadedKubeApi]:
    with ThreadedKubeApi() as srv:
        yield srv


def test_double_answers_access_reviews_and_refusals_as_the_real_apiserver(
        control_plane: ControlPlane, double: ThreadedKubeApi) -> None:
    admin = control_plane.admin
    assert admin is not None
    real = run(admin, lambda tok: Api(control_plane.server, control_plane.ca, tok))
    fake_admin = Api(double.url, None, double.token)
    try:
        fake = run(fake_admin, lambda tok: Api(double.url, None, tok))
    finally:
        fake_admin.close()
    # the script is about something: allowed and denied both happen, with reasons
    assert real["list services, all namespaces (ClusterRoleBinding)"][1]["allowed"] is True
    assert real["no bindings at all: denied, no reason"] == (201, {"allowed": False})
    diffs = [f"{name}:\n    real:   {real[name]!r}\n    double: {fake[name]!r}"
             for name in real if real[name] != fake[name]]
    assert not diffs, "the API double disagrees with kube-apiserver:\n" + "\n".join(diffs)
