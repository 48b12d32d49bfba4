"""The API double serves CRDs as the apiextensions apiserver does (ImexEnsemble's).

Over HTTP on loopback, as a client sees it: installing a CRD makes its kind served,
defaults and pruning are applied, bad objects get 422 naming the field (the message
texts are the ones kube-apiserver v1.37.2 sent for the same bodies; the realk8s
parity test keeps checking that), the status subresource splits writes, server-side
apply merges list-type maps by key, and `kubectl get` gets its Table."""

from __future__ import annotations

import copy
import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml

from tests.sandbox.kube_api.patching import merge_order
from tests.sandbox.kube_api.server import ThreadedKubeApi
from tools.crd_generate import REPO

CRDS = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions"
CRD_NAME = "imexensembles.imex-ensemble.io"
ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/default/imexensembles"
APPLY = {"content-type": "application/apply-patch+yaml"}
MERGE = {"content-type": "application/merge-patch+json"}
TABLE = {"accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}
Body = dict[str, Any]


def ensemble(name: str, **spec: Any) -> Body:
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": name}, "spec": spec}


@pytest.fixture
def api() -> Iterator[httpx.Client]:
    with ThreadedKubeApi() as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        yield client


def causes(resp: httpx.Response) -> set[tuple[str, str]]:
    assert resp.status_code == 422, resp.text
    return {(c["field"], c["message"]) for c in resp.json()["details"]["causes"]}


def test_the_default_crd_is_installed_established_and_discoverable(api: httpx.Client) -> None:
    crd = api.get(f"{CRDS}/{CRD_NAME}").json()
    conds = {c["type"]: c["status"] for c in crd["status"]["conditions"]}
    assert conds == {"NamesAccepted": "True", "Established": "True"}
    assert crd["status"]["storedVersions"] == ["v1alpha1"]
    found = {r["name"]: r for r in api.get("/apis/imex-ensemble.io/v1alpha1").json()["resources"]}
    assert found["imexensembles"]["shortNames"] == ["imexens"]
    assert found["imexensembles"]["namespaced"] is True
    assert "imexensembles/status" in found
    groups = [g["name"] for g in api.get("/apis").json()["groups"]]
    assert "imex-ensemble.io" in groups


def test_a_cluster_without_the_crd_until_it_is_created() -> None:
    with ThreadedKubeApi(crds=()) as srv, httpx.Client(base_url=srv.url) as api:
        assert api.get(ENS).status_code == 404
        doc = yaml.safe_load((REPO / "manifests/crds/crd-imexensembles.yaml").read_text())
        assert api.post(CRDS, json=doc).status_code == 201
        assert api.post(ENS, json=ensemble("a")).status_code == 201
        # deleting the CRD deletes its objects and stops serving the kind
        assert api.delete(f"{CRDS}/{CRD_NAME}").status_code == 200
        assert api.get(ENS).status_code == 404
        assert api.post(CRDS, json=doc).status_code == 201
        assert api.get(ENS).json()["items"] == []


def test_a_crd_named_unlike_its_plural_and_group_is_refused(api: httpx.Client) -> None:
    doc = yaml.safe_load((REPO / "manifests/crds/crd-imexensembles.yaml").read_text())
    doc["metadata"]["name"] = "wrong.imex-ensemble.io"
    (field, _), = causes(api.post(CRDS, json=doc))
    assert field == "metadata.name"


def test_defaults_and_pruning(api: httpx.Client) -> None:
    resp = api.post(ENS, json=ensemble("a", maxMembers=4, foo=1))
    assert resp.status_code == 201
    assert resp.json()["spec"] == {"maxMembers": 4, "port": 50000, "mode": "names",
                                   "authEncryption": False}
    assert resp.headers["warning"] == '299 - "unknown field \\"spec.foo\\""'
    # the creator owns what was defaulted (defaults are applied while decoding)
    (mine,) = resp.json()["metadata"]["managedFields"]
    assert set(mine["fieldsV1"]["f:spec"]) == {".", "f:maxMembers", "f:port", "f:mode",
                                               "f:authEncryption"}
    bare = {k: v for k, v in ensemble("b").items() if k != "spec"}
    assert api.post(ENS, json=bare).json()["spec"]["maxMembers"] == 18  # spec: default {}
    strict = api.post(ENS, json=ensemble("c", foo=1), params={"fieldValidation": "Strict"})
    assert strict.status_code == 400
    assert 'strict decoding error: unknown field "spec.foo"' in strict.json()["message"]


def test_bad_objects_are_refused_naming_the_field(api: httpx.Client) -> None:
    blocked = ("<nil>", "Invalid value: null: some validation rules were not checked because "
               "the object was invalid; correct the existing errors to complete validation")
    assert causes(api.post(ENS, json=ensemble("b", maxMembers=0, tokenSHA256="a" * 63,
                                               mode="x"))) == {
        ("spec.maxMembers", "Invalid value: 0: spec.maxMembers in body should be greater than "
                            "or equal to 1"),
        ("spec.tokenSHA256", f'Invalid value: "{"a" * 63}": spec.tokenSHA256 in body should '
                             "match '^[0-9a-f]{64}$'"),
        ("spec.mode", 'Unsupported value: "x": supported values: "names", "ips"'),
        blocked,
    }
    assert causes(api.post(ENS, json=ensemble("d", maxMembers="four", port=70000))) == {
        ("spec.maxMembers", 'Invalid value: "string": spec.maxMembers in body must be of type '
                            'integer: "string"'),
        ("spec.port", "Invalid value: 70000: spec.port in body should be less than or equal "
                      "to 65535"),
        blocked,
    }
    got = causes(api.post(ENS, json=ensemble(
        "c", authEncryption=True, mode="ips",
        memberSelector={"matchLabels": {"Bad Key": "x"},
                        "matchExpressions": [{"key": "a", "operator": "In"}]})))
    assert {f for f, _ in got} == {"spec.authEncryption",
                                   "spec.memberSelector.matchExpressions[0].values",
                                   "spec.memberSelector.matchLabels"}
    assert ("spec.authEncryption", "Invalid value: authEncryption needs mode names: IMEX checks "
            "peer certificates against host names, which mode ips does not write") in got
    assert api.get(f"{ENS}/c").status_code == 404  # nothing stored


def test_immutable_fields(api: httpx.Client) -> None:
    assert api.post(ENS, json=ensemble("a", maxMembers=4)).status_code == 201
    assert causes(api.patch(f"{ENS}/a", json={"spec": {"maxMembers": 5}}, headers=MERGE)) == {
        ("spec.maxMembers", "Invalid value: 5: maxMembers is immutable: it fixes every guest's "
                            "nodes file; create a new ImexEnsemble to change the size")}
    # removing the field re-defaults it to 18: a change, refused too
    assert causes(api.patch(f"{ENS}/a", json={"spec": {"maxMembers": None}},
                            headers=MERGE)) == {
        ("spec.maxMembers", "Invalid value: 18: maxMembers is immutable: it fixes every "
                            "guest's nodes file; create a new ImexEnsemble to change the size")}
    fields = {f for f, _ in causes(api.patch(f"{ENS}/a", json={"spec": {"authEncryption": True}},
                                             headers=MERGE))}
    assert fields == {"spec.authEncryption"}
    ok = api.patch(f"{ENS}/a", json={"spec": {"port": 50001, "caRotation": "2026-12"}},
                   headers=MERGE)
    assert ok.status_code == 200 and ok.json()["metadata"]["generation"] == 2


STATUS = {"publishedSummary": "1/4", "imexReady": 1, "domainStatus": "UP",
          "domainID": "0123abcd", "membersPublished": 1,
          "members": [{"index": 0, "slot": "imex-0123abcd-0", "ip": "10.0.0.1", "ready": True}],
          "conditions": [{"type": "Ready", "status": "True", "reason": "AllReady",
                          "message": "ok", "lastTransitionTime": "2026-01-01T00:00:00Z"}]}


def status_apply(api: httpx.Client, manager: str, status: Body,
                 force: bool = False) -> httpx.Response:
    body = {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": "a"}, "status": status}
    params = {"fieldManager": manager, **({"force": "true"} if force else {})}
    return api.patch(f"{ENS}/a/status", content=json.dumps(body), headers=APPLY,
                     params=params)


def test_status_subresource_splits_spec_and_status(api: httpx.Client) -> None:
    created = api.post(ENS, json={**ensemble("a", maxMembers=4), "status": STATUS}).json()
    assert "status" not in created  # status in a create is dropped
    done = status_apply(api, "imex-host-agent", STATUS)
    assert done.status_code == 200, done.text
    assert done.json()["status"]["publishedSummary"] == "1/4"
    assert done.json()["metadata"]["generation"] == 1  # a status write is no spec change
    spec_write = api.patch(f"{ENS}/a", headers=MERGE, json={
        "spec": {"port": 50002}, "status": {"publishedSummary": "9/9"}}).json()
    assert spec_write["status"]["publishedSummary"] == "1/4"
    assert spec_write["metadata"]["generation"] == 2
    status_write = api.patch(f"{ENS}/a/status", headers=MERGE, json={
        "spec": {"port": 1}, "status": {"imexReady": 0}}).json()
    assert status_write["spec"]["port"] == 50002 and status_write["status"]["imexReady"] == 0
    assert status_write["metadata"]["generation"] == 2
    bad = api.patch(f"{ENS}/a/status", headers=MERGE,
                    json={"status": {"domainStatus": "SIDEWAYS", "members": [{"ip": "x"}]}})
    assert {f for f, _ in causes(bad)} == {"status.domainStatus", "status.members[0].index",
                                           "<nil>"}
    dup = api.patch(f"{ENS}/a/status", headers=MERGE, json={"status": {"members": [
        {"index": 1}, {"index": 1}]}})
    assert causes(dup) == {("status.members[1]", 'Duplicate value: {"index":1}')}


def test_server_side_apply_merges_list_maps_by_key(api: httpx.Client) -> None:
    api.post(ENS, json=ensemble("a", maxMembers=4))
    assert status_apply(api, "agent-a", STATUS).status_code == 200
    other = copy.deepcopy(STATUS)
    other["members"] = [{"index": 1, "ip": "10.0.0.2"}]
    other["conditions"] = [{"type": "Degraded", "status": "False", "reason": "NoProblem",
                            "message": "", "lastTransitionTime": "2026-01-01T00:00:00Z"}]
    merged = status_apply(api, "agent-b", other).json()
    assert [m["index"] for m in merged["status"]["members"]] == [0, 1]
    assert [c["type"] for c in merged["status"]["conditions"]] == ["Ready", "Degraded"]
    owners = {m["manager"]: m["fieldsV1"] for m in merged["metadata"]["managedFields"]}
    assert 'k:{"index":0}' in owners["agent-a"]["f:status"]["f:members"]
    assert 'k:{"index":1}' in owners["agent-b"]["f:status"]["f:members"]
    # agent-a stops applying member 0: it goes; member 1 (agent-b's) stays
    again = copy.deepcopy(STATUS)
    again["members"] = []
    kept = status_apply(api, "agent-a", again).json()["status"]
    assert [m["index"] for m in kept["members"]] == [1]
    # both own the Ready condition's fields? no: agent-b changing it conflicts
    flip = copy.deepcopy(other)
    flip["conditions"] = [{**STATUS["conditions"][0], "status": "False"}]
    conflict = status_apply(api, "agent-b", flip)
    assert conflict.status_code == 409
    fields = {c["field"] for c in conflict.json()["details"]["causes"]}
    assert '.status.conditions[type="Ready"].status' in fields
    forced = status_apply(api, "agent-b", flip, force=True).json()
    assert [c["status"] for c in forced["status"]["conditions"]
            if c["type"] == "Ready"] == ["False"]


def test_apply_that_changes_nothing_keeps_the_resource_version(api: httpx.Client) -> None:
    api.post(ENS, json=ensemble("a", maxMembers=4))
    first = status_apply(api, "agent", STATUS).json()["metadata"]["resourceVersion"]
    again = status_apply(api, "agent", STATUS).json()["metadata"]["resourceVersion"]
    assert first == again


def test_table_has_the_printer_columns(api: httpx.Client) -> None:
    api.post(ENS, json=ensemble("a", maxMembers=4))
    api.post(ENS, json=ensemble("fresh"))
    status_apply(api, "agent", STATUS)
    table = api.get(ENS, headers=TABLE).json()
    cols = [(c["name"], c["type"], c["priority"]) for c in table["columnDefinitions"]]
    assert cols == [("Name", "string", 0), ("MEMBERS", "string", 0),
                    ("IMEX-READY", "integer", 0), ("READY", "string", 0),
                    ("DOMAIN", "string", 0), ("AGE", "date", 0), ("MODE", "string", 1),
                    ("DOMAIN-ID", "string", 1)]
    rows = {r["cells"][0]: r["cells"] for r in table["rows"]}
    assert rows["a"][:5] == ["a", "1/4", 1, "True", "UP"]
    assert rows["a"][6:] == ["names", "0123abcd"]
    assert rows["fresh"][1:5] == [None, None, None, None]  # no status yet: null cells
    one = api.get(f"{ENS}/a", headers=TABLE).json()
    assert len(one["rows"]) == 1
    assert one["rows"][0]["object"]["kind"] == "PartialObjectMetadata"


def test_a_status_write_validates_the_status_alone(api: httpx.Client) -> None:
    """/status validates status against its own schema: messages name fields relative
    to it, the cause's field is the full path (kube-apiserver v1.37.2)."""
    api.post(ENS, json=ensemble("a", maxMembers=4))
    bad = api.patch(f"{ENS}/a/status", headers=MERGE, json={"status": {"conditions": [
        {**STATUS["conditions"][0], "lastTransitionTime": "yesterday"}]}})
    assert ("status.conditions[0].lastTransitionTime",
            'Invalid value: "yesterday": conditions[0].lastTransitionTime in body must be of '
            'type date-time: "yesterday"') in causes(bad)


@pytest.mark.parametrize(("live", "config", "merged"), [
    (["Ready", "Degraded"], ["Degraded", "Ready"], ["Degraded", "Ready"]),
    (["a", "b", "c"], ["c", "x"], ["a", "b", "c", "x"]),
    (["a", "b", "c"], ["x", "b"], ["a", "x", "b", "c"]),
    (["a", "b"], [], ["a", "b"]),
])
def test_merged_list_maps_take_structured_merge_diffs_order(
        live: list[str], config: list[str], merged: list[str]) -> None:
    assert merge_order(live, config) == merged
