"""Patch formats and server-side apply of the API double, as pure functions."""

from __future__ import annotations

import pytest

from tests.sandbox.kube_api.patching import (
    ApplyConflict,
    PatchError,
    fields_v1,
    json_patch,
    leaf_paths,
    merge_patch,
    parse_fields_v1,
    parse_managed_fields,
    record_update,
    server_side_apply,
    strategic_merge_patch,
)


def test_merge_patch_rfc7386() -> None:
    target = {"a": "b", "c": {"d": "e", "f": "g"}, "l": [1, 2]}
    patch = {"a": "z", "c": {"f": None}, "l": [3]}
    assert merge_patch(target, patch) == {"a": "z", "c": {"d": "e"}, "l": [3]}
    assert target["c"] == {"d": "e", "f": "g"}  # input untouched


def test_json_patch_rfc6902() -> None:
    doc = {"metadata": {"labels": {"a/b": "1"}}, "list": [1, 2, 3]}
    out = json_patch(doc, [
        {"op": "add", "path": "/list/1", "value": 9},
        {"op": "remove", "path": "/metadata/labels/a~1b"},
        {"op": "replace", "path": "/list/0", "value": 0},
        {"op": "copy", "from": "/list/0", "path": "/first"},
        {"op": "move", "from": "/first", "path": "/moved"},
        {"op": "add", "path": "/list/-", "value": 4},
        {"op": "test", "path": "/moved", "value": 0},
    ])
    assert out == {"metadata": {"labels": {}}, "list": [0, 9, 2, 3, 4], "moved": 0}


@pytest.mark.parametrize("ops", [
    [{"op": "test", "path": "/a", "value": 2}],
    [{"op": "remove", "path": "/missing"}],
    [{"op": "replace", "path": "/missing", "value": 1}],
    [{"op": "frobnicate", "path": "/a"}],
    {"op": "add"},
])
def test_json_patch_failures_are_patch_errors(ops: object) -> None:
    with pytest.raises(PatchError):
        json_patch({"a": 1}, ops)


def test_strategic_merge_merges_lists_by_key() -> None:
    target = {"spec": {"ports": [{"name": "a", "port": 1}, {"name": "b", "port": 2}]},
              "status": {"conditions": [{"type": "Ready", "status": "False"}]},
              "metadata": {"finalizers": ["x"]}}
    patch = {"spec": {"ports": [{"port": 2, "name": "bee"}, {"port": 3, "name": "c"},
                                {"port": 1, "$patch": "delete"}]},
             "status": {"conditions": [{"type": "Ready", "status": "True"}]},
             "metadata": {"finalizers": ["y"]}}
    out = strategic_merge_patch(target, patch)
    assert out["spec"]["ports"] == [{"name": "bee", "port": 2}, {"name": "c", "port": 3}]
    assert out["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert out["metadata"]["finalizers"] == ["x", "y"]


def test_fields_v1_round_trip() -> None:
    obj = {"apiVersion": "v1", "metadata": {"name": "n", "labels": {"a": "1", "b": "2"}},
           "spec": {"ports": [{"port": 1}], "empty": {}}}
    paths = leaf_paths(obj)
    assert paths == {("metadata", "labels", "a"), ("metadata", "labels", "b"),
                     ("spec", "ports"), ("spec", "empty")}
    rendered = fields_v1(paths)
    assert rendered["f:metadata"]["f:labels"] == {"f:a": {}, "f:b": {}}
    assert parse_fields_v1(rendered) == paths
    entries = [{"manager": "m", "operation": "Apply", "fieldsV1": rendered}]
    assert parse_managed_fields(entries) == {("m", "Apply", ""): paths}


def _slice(ip: str, **labels: str) -> dict[str, object]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "s", "labels": {"kubernetes.io/service-name": "svc", **labels}},
            "addressType": "IPv4", "endpoints": [{"addresses": [ip]}]}


def test_apply_creates_then_is_idempotent() -> None:
    obj, owners = server_side_apply(None, _slice("10.0.0.1"), {}, "agent", force=False)
    assert obj["endpoints"] == [{"addresses": ["10.0.0.1"]}]
    again, owners2 = server_side_apply(obj, _slice("10.0.0.1"), owners, "agent", force=False)
    assert again == obj and owners2 == owners


def test_apply_conflicts_with_other_manager_unless_forced() -> None:
    obj, owners = server_side_apply(None, _slice("10.0.0.1"), {}, "agent", force=False)
    with pytest.raises(ApplyConflict) as err:
        server_side_apply(obj, _slice("10.0.0.2"), owners, "intruder", force=False)
    assert err.value.conflicts == [("agent", ("endpoints",))]
    assert 'conflict with "agent": .endpoints' in str(err.value)
    # same value: shared ownership, no conflict
    _, shared = server_side_apply(obj, _slice("10.0.0.1"), owners, "intruder", force=False)
    assert ("endpoints",) in shared[("intruder", "Apply", "")]
    forced, after = server_side_apply(obj, _slice("10.0.0.2"), owners, "intruder", force=True)
    assert forced["endpoints"] == [{"addresses": ["10.0.0.2"]}]
    assert ("endpoints",) not in after[("agent", "Apply", "")]
    # fields both applied with equal values stay shared (upstream keeps both managers)
    assert ("metadata", "labels", "kubernetes.io/service-name") in after[("agent", "Apply", "")]


def test_apply_removes_fields_no_longer_applied_unless_shared() -> None:
    obj, owners = server_side_apply(None, _slice("10.0.0.1", extra="x"), {}, "agent", False)
    obj2, _owners2 = server_side_apply(obj, _slice("10.0.0.1"), owners, "agent", False)
    assert "extra" not in obj2["metadata"]["labels"]
    # a label another manager also applies survives the first manager dropping it
    _, both = server_side_apply(obj, _slice("10.0.0.1", extra="x"), owners, "other", False)
    obj3, _ = server_side_apply(obj, _slice("10.0.0.1"), both, "agent", False)
    assert obj3["metadata"]["labels"]["extra"] == "x"


def test_apply_ignores_server_defaults_in_conflicts() -> None:
    current = {"spec": {"ports": [{"name": "imex", "port": 5, "protocol": "TCP"}]}}
    owners = {("creator", "Update", ""): {("spec", "ports")}}
    applied = {"spec": {"ports": [{"name": "imex", "port": 5}]}}
    out, _ = server_side_apply(current, applied, owners, "agent", force=False)
    assert out["spec"]["ports"] == [{"name": "imex", "port": 5}]  # defaults re-added later


def test_update_takes_ownership_of_changed_fields_only() -> None:
    old = {"metadata": {"labels": {"a": "1", "b": "2"}}}
    owners = {("agent", "Apply", ""): {("metadata", "labels", "a"), ("metadata", "labels", "b")}}
    new = {"metadata": {"labels": {"a": "1", "b": "3"}}}
    after = record_update(old, new, owners, "kubectl-edit")
    assert after[("kubectl-edit", "Update", "")] == {("metadata", "labels", "b")}
    assert after[("agent", "Apply", "")] == {("metadata", "labels", "a")}


def test_update_that_creates_a_map_owns_it_and_keeps_it_after_a_forced_apply() -> None:
    # as kube-apiserver does for a custom resource: status created by a patch is owned
    # with ".", so the patcher stays listed after a forced status apply takes status.phase
    after_patch = record_update({"spec": {}}, {"spec": {}, "status": {"phase": "Running"}},
                                {}, "patcher", "status", custom=True)
    assert after_patch == {("patcher", "Update", "status"): {("status", "."),
                                                             ("status", "phase")}}
    assert fields_v1(after_patch[("patcher", "Update", "status")]) == \
        {"f:status": {".": {}, "f:phase": {}}}
    _, owners = server_side_apply({"status": {"phase": "Running"}},
                                  {"status": {"phase": "Failed"}}, after_patch,
                                  "virt-handler", force=True, subresource="status")
    assert owners[("patcher", "Update", "status")] == {("status", ".")}
    # built-in kinds: only labels/annotations get "."
    built_in = record_update({"metadata": {}}, {"metadata": {"labels": {"a": "1"}},
                                                "spec": {"x": 1}}, {}, "m")
    assert built_in[("m", "Update", "")] == {("metadata", "labels", "."),
                                             ("metadata", "labels", "a"), ("spec", "x")}
