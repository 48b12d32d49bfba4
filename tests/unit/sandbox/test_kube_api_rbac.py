"""The API double's identities and RBAC (tests/sandbox/kube_api/rbac.py).

What the apiserver says word for word is tests/realk8s/test_rbac_parity.py's job; here,
that the double applies it: how a request reads as attributes, which rules match, and
that a minted ServiceAccount token is held to RBAC over HTTP while the server's own
token stays the superuser.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.sandbox.kube_api import rbac
from tests.sandbox.kube_api.server import ThreadedKubeApi

A = rbac.Attributes


@pytest.mark.parametrize(("method", "path", "query", "want"), [
    ("GET", "/api/v1/namespaces/ns/services", {}, A("list", "", "services", "", "ns")),
    ("GET", "/api/v1/services", {"watch": "true"}, A("watch", "", "services")),
    ("GET", "/api/v1/namespaces/ns/services/s", {}, A("get", "", "services", "", "ns", "s")),
    ("PATCH", "/api/v1/namespaces/ns/services/s/status", {},
     A("patch", "", "services", "status", "ns", "s")),
    ("POST", "/apis/discovery.k8s.io/v1/namespaces/ns/endpointslices", {},
     A("create", "discovery.k8s.io", "endpointslices", "", "ns")),
    ("DELETE", "/api/v1/namespaces/ns/configmaps", {},
     A("deletecollection", "", "configmaps", "", "ns")),
    ("GET", "/apis/kubevirt.io/v1/namespaces/ns/virtualmachineinstances",
     {"fieldSelector": "metadata.name=gb200-0"},
     A("list", "kubevirt.io", "virtualmachineinstances", "", "ns", "gb200-0")),
    # a Namespace is in its own namespace; its status is a subresource, not a kind
    ("GET", "/api/v1/namespaces/ns", {}, A("get", "", "namespaces", "", "ns", "ns")),
    ("PUT", "/api/v1/namespaces/ns/status", {},
     A("update", "", "namespaces", "status", "ns", "ns")),
    ("POST", "/api/v1/namespaces/ns/serviceaccounts/sa/token", {},
     A("create", "", "serviceaccounts", "token", "ns", "sa")),
    ("GET", "/apis", {}, None),
    ("GET", "/version", {}, None),
    ("GET", "/apis/discovery.k8s.io/v1", {}, None),
])
def test_request_attributes(method: str, path: str, query: dict[str, str],
                            want: rbac.Attributes | None) -> None:
    assert rbac.request_attributes(method, path, query) == want


@pytest.mark.parametrize(("rule", "attrs", "allowed"), [
    ({"apiGroups": [""], "resources": ["services"], "verbs": ["list"]},
     A("list", "", "services"), True),
    ({"apiGroups": [""], "resources": ["services"], "verbs": ["list"]},
     A("watch", "", "services"), False),
    ({"apiGroups": ["*"], "resources": ["*"], "verbs": ["*"]},
     A("patch", "x.io", "things", "status"), True),
    ({"apiGroups": [""], "resources": ["services"], "verbs": ["patch"]},
     A("patch", "", "services", "status"), False),
    ({"apiGroups": [""], "resources": ["*/status"], "verbs": ["patch"]},
     A("patch", "", "services", "status"), True),
    ({"apiGroups": [""], "resources": ["services/status"], "verbs": ["patch"]},
     A("patch", "", "services"), False),
    ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["a"]},
     A("get", "", "secrets", "", "ns", "a"), True),
    ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["get"], "resourceNames": ["a"]},
     A("get", "", "secrets", "", "ns", "b"), False),
    ({"apiGroups": [""], "resources": ["secrets"], "verbs": ["list"], "resourceNames": ["a"]},
     A("list", "", "secrets", "", "ns"), False),
    ({"apiGroups": ["apps"], "resources": ["services"], "verbs": ["list"]},
     A("list", "", "services"), False),
])
def test_rule_allows(rule: dict[str, Any], attrs: rbac.Attributes, allowed: bool) -> None:
    assert rbac.rule_allows(attrs, rule) is allowed


@pytest.fixture
def api() -> Iterator[tuple[ThreadedKubeApi, httpx.Client]]:
    with ThreadedKubeApi() as srv, httpx.Client(base_url=srv.url, timeout=10) as admin:
        admin.headers["Authorization"] = f"Bearer {srv.token}"
        yield srv, admin


def _ok(resp: httpx.Response) -> Any:
    assert resp.status_code < 300, resp.text
    return resp.json()


def _account(admin: httpx.Client, ns: str, name: str) -> httpx.Client:
    if admin.get(f"/api/v1/namespaces/{ns}").status_code == 404:
        _ok(admin.post("/api/v1/namespaces", json={"apiVersion": "v1", "kind": "Namespace",
                                                    "metadata": {"name": ns}}))
    _ok(admin.post(f"/api/v1/namespaces/{ns}/serviceaccounts",
                   json={"apiVersion": "v1", "kind": "ServiceAccount",
                         "metadata": {"name": name}}))
    tr = _ok(admin.post(f"/api/v1/namespaces/{ns}/serviceaccounts/{name}/token",
                        json={"apiVersion": "authentication.k8s.io/v1",
                              "kind": "TokenRequest", "spec": {}}))
    return httpx.Client(base_url=str(admin.base_url), timeout=10,
                        headers={"Authorization": f"Bearer {tr['status']['token']}"})


def _review(client: httpx.Client, **attrs: str) -> Any:
    return _ok(client.post("/apis/authorization.k8s.io/v1/selfsubjectaccessreviews", json={
        "apiVersion": "authorization.k8s.io/v1", "kind": "SelfSubjectAccessReview",
        "spec": {"resourceAttributes": attrs}}))["status"]


def test_a_minted_token_is_held_to_rbac(api: tuple[ThreadedKubeApi, httpx.Client]) -> None:
    _, admin = api
    sa = _account(admin, "team", "agent")
    with sa:
        refused = sa.get("/api/v1/namespaces/team/configmaps")
        assert refused.status_code == 403
        assert refused.json()["message"] == (
            'configmaps is forbidden: User "system:serviceaccount:team:agent" cannot list '
            'resource "configmaps" in API group "" in the namespace "team"')
        assert _review(sa, verb="list", resource="configmaps", namespace="team") == {
            "allowed": False}
        _ok(admin.post("/apis/rbac.authorization.k8s.io/v1/namespaces/team/roles", json={
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role",
            "metadata": {"name": "cm"},
            "rules": [{"apiGroups": [""], "resources": ["configmaps"],
                       "verbs": ["list", "create"]}]}))
        _ok(admin.post("/apis/rbac.authorization.k8s.io/v1/namespaces/team/rolebindings", json={
            "apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
            "metadata": {"name": "cm"},
            "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": "cm"},
            "subjects": [{"kind": "ServiceAccount", "name": "agent"}]}))
        assert sa.get("/api/v1/namespaces/team/configmaps").status_code == 200
        assert _review(sa, verb="create", resource="configmaps", namespace="team") == {
            "allowed": True,
            "reason": 'RBAC: allowed by RoleBinding "cm/team" of Role "cm" to '
                      'ServiceAccount "agent/team"'}
        # the grant is in its namespace only; discovery is open to everyone
        assert sa.get("/api/v1/namespaces/default/configmaps").status_code == 403
        assert sa.get("/api/v1").status_code == 200
        # a dry run is authorized as the write it would be, then checks the namespace
        assert sa.post("/api/v1/namespaces/team/configmaps", params={"dryRun": "All"},
                       json={"apiVersion": "v1", "kind": "ConfigMap",
                             "metadata": {"name": "probe"}}).status_code == 201
        assert admin.get("/api/v1/namespaces/team/configmaps/probe").status_code == 404
        # the account goes, its token stops working
        _ok(admin.delete("/api/v1/namespaces/team/serviceaccounts/agent"))
        assert sa.get("/api/v1/namespaces/team/configmaps").status_code == 401


def test_the_servers_own_token_and_no_token_are_the_superuser(
        api: tuple[ThreadedKubeApi, httpx.Client]) -> None:
    srv, admin = api
    assert _review(admin, verb="delete", resource="nodes") == {"allowed": True}
    with httpx.Client(base_url=srv.url, timeout=10) as anonymous:
        assert anonymous.get("/api/v1/namespaces/default/secrets").status_code == 200
        bad = anonymous.get("/api/v1/services", headers={"Authorization": "Bearer nope"})
        assert bad.status_code == 401
