"""The API double's CEL subset: CEL's semantics for what the CRDs' rules use."""

from __future__ import annotations

from typing import Any

import pytest

from host_agent.crd import imexensemble as crd
from tests.sandbox.kube_api.cel import CelError, compile_rule, evaluate, uses_old_self


def rule_of(field: Any, index: int = 0) -> str:
    return str(field.all_rules()[index].rule)


def test_the_crds_immutability_rule_is_a_transition_rule() -> None:
    rule = rule_of(crd.SPEC.child("maxMembers"))
    assert uses_old_self(rule)
    assert evaluate(rule, 18, 18, has_old=True) is True
    assert evaluate(rule, 4, 18, has_old=True) is False
    assert evaluate(rule_of(crd.SPEC.child("authEncryption")), True, False, True) is False


@pytest.mark.parametrize(("spec", "ok"), [
    ({"authEncryption": True, "mode": "names"}, True),
    ({"authEncryption": True, "mode": "ips"}, False),
    ({"authEncryption": False, "mode": "ips"}, True),
    ({"mode": "ips"}, True),  # has() guards: an absent field is no error
    ({}, True),
])
def test_auth_encryption_needs_mode_names(spec: dict[str, Any], ok: bool) -> None:
    rule = crd.SPEC.rules[0].rule
    assert not uses_old_self(rule)
    assert evaluate(rule, spec) is ok


@pytest.mark.parametrize(("req", "ok"), [
    ({"key": "a", "operator": "In", "values": ["x"]}, True),
    ({"key": "a", "operator": "In"}, False),
    ({"key": "a", "operator": "NotIn", "values": []}, False),
    ({"key": "a", "operator": "Exists"}, True),
    ({"key": "a", "operator": "Exists", "values": ["x"]}, False),
    ({"key": "a", "operator": "DoesNotExist", "values": []}, True),
])
def test_selector_operator_and_values(req: dict[str, Any], ok: bool) -> None:
    items = crd.SPEC.child("memberSelector").child("matchExpressions").items
    assert items is not None
    assert evaluate(items.rules[0].rule, req) is ok


@pytest.mark.parametrize(("labels", "ok"), [
    ({"app": "x", "example.com/rack": "1", "a.b-c/D_e.f": ""}, True),
    ({}, True),
    ({"Bad Key": "x"}, False),
    ({"-leading": "x"}, False),
    ({"UPPER.example.com/x": "1"}, False),  # the prefix is a lowercase DNS subdomain
    ({"a" * 64: "x"}, False),
])
def test_match_labels_keys(labels: dict[str, str], ok: bool) -> None:
    rule = crd.SPEC.child("memberSelector").child("matchLabels").rules[0].rule
    assert evaluate(rule, labels) is ok


def test_logical_operators_absorb_errors_as_cel_does() -> None:
    assert evaluate("self.missing == 1 || true", {}) is True
    assert evaluate("false && self.missing == 1", {}) is False
    assert evaluate("self.missing == 1 && false", {}) is False
    with pytest.raises(CelError, match="no such key: missing"):
        evaluate("self.missing == 1 || false", {})


def test_values_and_operators() -> None:
    assert evaluate("self.a + 1 == 3 && self.s.startsWith('ab') && 'b' in self.l", {
        "a": 2, "s": "abc", "l": ["a", "b"]}) is True
    assert evaluate("size(self) == 2 && self.size() == 2", [1, 2]) is True
    assert evaluate("self.x ? 'y' : 'n'", {"x": False}) == "n"
    assert evaluate("'k' in self", {"k": 1}) is True
    assert evaluate("self['k']", {"k": 5}) == 5
    assert evaluate("-7 / 2", None) == -3  # truncates toward zero
    assert evaluate("1 == true", None) is False  # no cross-type equality for bools
    assert evaluate(r"'a\\.b' == r'a\.b'", None) is True
    assert evaluate("self.exists(x, x > 2)", [1, 3]) is True
    assert evaluate("self.all(x, x > 2)", [1, 3]) is False


@pytest.mark.parametrize("src", ["{'a': 1}", "self.x ?", "self..x", "self.map(x, x)"])
def test_outside_the_subset_fails_loudly(src: str) -> None:
    with pytest.raises(CelError):
        compile_rule(src)
        evaluate(src, {"x": [1]})
