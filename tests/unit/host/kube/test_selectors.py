"""metav1.LabelSelector semantics, as the apiserver evaluates them (k8s.io/apimachinery)."""

from __future__ import annotations

from typing import Any

import pytest

from host_agent.kube.selectors import (
    LabelSelector,
    Requirement,
    SelectorError,
    allowed_values,
    contradiction,
    parse_label_selector,
)

ENS = "imex-ensemble.io/ensemble"


def sel(obj: Any) -> LabelSelector:
    return parse_label_selector(obj, "spec.memberSelector")


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        (None, {}, True),
        ({}, {"a": "b"}, True),
        ({"matchLabels": {"rack": "a"}}, {"rack": "a", "x": "y"}, True),
        ({"matchLabels": {"rack": "a"}}, {"rack": "b"}, False),
        ({"matchLabels": {"rack": "a"}}, {}, False),
        ({"matchExpressions": [{"key": "rack", "operator": "In", "values": ["a", "b"]}]},
         {"rack": "b"}, True),
        ({"matchExpressions": [{"key": "rack", "operator": "NotIn", "values": ["a"]}]},
         {}, True),  # NotIn matches a set without the key
        ({"matchExpressions": [{"key": "rack", "operator": "NotIn", "values": ["a"]}]},
         {"rack": "a"}, False),
        ({"matchExpressions": [{"key": "rack", "operator": "Exists"}]}, {"rack": ""}, True),
        ({"matchExpressions": [{"key": "rack", "operator": "DoesNotExist"}]},
         {"rack": "a"}, False),
        ({"matchLabels": {"rack": "a"},
          "matchExpressions": [{"key": "tier", "operator": "Exists"}]}, {"rack": "a"}, False),
    ],
)
def test_matches(selector: Any, labels: dict[str, str], expected: bool) -> None:
    assert sel(selector).matches(labels) is expected


@pytest.mark.parametrize(
    ("selector", "message"),
    [
        ("rack=a", "spec.memberSelector: expected an object with matchLabels/matchExpressions"),
        ({"matchLabel": {}}, "spec.memberSelector: unknown field 'matchLabel'"),
        ({"matchLabels": ["a"]},
         "spec.memberSelector.matchLabels: expected a map of label key to value"),
        ({"matchLabels": {"bad key": "a"}},
         "spec.memberSelector.matchLabels: 'bad key' is not a label key"),
        ({"matchLabels": {"rack": "a" * 64}},
         f"spec.memberSelector.matchLabels[rack]: {'a' * 64!r} is not a label value "
         "(at most 63 characters)"),
        ({"matchExpressions": [{"key": "rack", "operator": "in", "values": ["a"]}]},
         "spec.memberSelector.matchExpressions[0].operator: 'in' is not one of In, NotIn, "
         "Exists, DoesNotExist"),
        ({"matchExpressions": [{"key": "rack", "operator": "In", "values": []}]},
         "spec.memberSelector.matchExpressions[0].values: operator In needs at least one value"),
        ({"matchExpressions": [{"key": "rack", "operator": "Exists", "values": ["a"]}]},
         "spec.memberSelector.matchExpressions[0].values: operator Exists takes no values"),
        ({"matchExpressions": [{"operator": "Exists"}]},
         "spec.memberSelector.matchExpressions[0].key: None is not a label key"),
    ],
)
def test_refusals_name_the_field(selector: Any, message: str) -> None:
    with pytest.raises(SelectorError) as err:
        sel(selector)
    assert str(err.value) == message


def test_value_is_frozen_sorted_and_comparable() -> None:
    a = sel({"matchLabels": {"b": "2", "a": "1"},
             "matchExpressions": [{"key": "t", "operator": "In", "values": ["y", "x", "x"]}]})
    b = sel({"matchLabels": {"a": "1", "b": "2"},
             "matchExpressions": [{"key": "t", "operator": "In", "values": ["x", "y"]}]})
    assert a == b and hash(a) == hash(b)
    assert a.match_expressions == (Requirement("t", "In", ("x", "y")),)
    assert a.describe() == "a=1,b=2,t in (x,y)"


@pytest.mark.parametrize(
    ("selector", "reason"),
    [
        ({"matchLabels": {"rack": "a"},
          "matchExpressions": [{"key": "rack", "operator": "In", "values": ["b"]}]},
         "no value of label rack satisfies it (asks for a, b at once)"),
        ({"matchLabels": {"rack": "a"},
          "matchExpressions": [{"key": "rack", "operator": "NotIn", "values": ["a"]}]},
         "no value of label rack satisfies it (asks for a at once)"),
        ({"matchExpressions": [{"key": "rack", "operator": "Exists"},
                               {"key": "rack", "operator": "DoesNotExist"}]},
         "label rack must both exist and not exist"),
        ({"matchLabels": {"rack": "a"}}, None),
        ({"matchExpressions": [{"key": "rack", "operator": "DoesNotExist"}]}, None),
        ({"matchExpressions": [{"key": "rack", "operator": "NotIn", "values": ["a"]},
                               {"key": "rack", "operator": "Exists"}]}, None),
    ],
)
def test_contradiction(selector: Any, reason: str | None) -> None:
    assert contradiction(sel(selector)) == reason


def test_allowed_values_of_the_ensemble_label() -> None:
    assert allowed_values(sel({}), ENS) is None
    assert allowed_values(sel({"matchLabels": {ENS: "other"}}), ENS) == {"other"}
    assert allowed_values(sel({"matchExpressions": [
        {"key": ENS, "operator": "In", "values": ["a", "b"]},
        {"key": ENS, "operator": "NotIn", "values": ["b"]}]}), ENS) == {"a"}
    assert allowed_values(sel({"matchExpressions": [
        {"key": ENS, "operator": "DoesNotExist"}]}), ENS) == frozenset()
