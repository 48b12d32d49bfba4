"""Label and field selectors of the API double, against apimachinery's documented rules."""

from __future__ import annotations

import pytest

from tests.sandbox.kube_api.selectors import (
    SelectorError,
    fields_match,
    labels_match,
    parse_field_selector,
    parse_label_selector,
)

LABELS = {"app": "imex", "tier": "gpu", "index": "7", "imex-ensemble.io/ensemble": "gb200"}


@pytest.mark.parametrize(("selector", "expected"), [
    ("", True),
    ("app=imex", True),
    ("app==imex", True),
    ("app=other", False),
    ("app!=other", True),
    ("missing!=x", True),            # != holds when the key is absent
    ("app in (imex, other)", True),
    ("app in (other)", False),
    ("app notin (other)", True),
    ("missing notin (x)", True),     # notin holds when absent
    ("missing in (x)", False),
    ("imex-ensemble.io/ensemble", True),   # exists, prefixed key
    ("!imex-ensemble.io/ensemble", False),
    ("!missing", True),
    ("index>6", True),
    ("index<7", False),
    ("missing>1", False),
    ("app=imex,tier in (gpu),!missing,index>0", True),
    ("app=imex,tier=cpu", False),    # AND of requirements
])
def test_label_selector_matches(selector: str, expected: bool) -> None:
    assert labels_match(parse_label_selector(selector), LABELS) is expected


def test_label_selector_on_unlabelled_object() -> None:
    assert labels_match(parse_label_selector("!a,b!=c"), None)
    assert not labels_match(parse_label_selector("a"), None)


@pytest.mark.parametrize("bad", ["app in (a", "a)=b", "=x", "app=bad value", "x>y", "a,,b",
                                 "-bad=1"])
def test_label_selector_rejects_garbage(bad: str) -> None:
    with pytest.raises(SelectorError):
        parse_label_selector(bad)


def test_field_selector_name_and_namespace() -> None:
    obj = {"metadata": {"name": "gb200-3", "namespace": "rack1"}, "status": {"phase": "Running"}}
    assert fields_match(parse_field_selector("metadata.name=gb200-3", "VirtualMachineInstance"),
                        obj)
    assert fields_match(parse_field_selector("metadata.namespace==rack1,metadata.name!=x",
                                             "Service"), obj)
    assert not fields_match(parse_field_selector("metadata.name=other", "Service"), obj)
    assert fields_match(parse_field_selector("status.phase=Running", "Pod"), obj)


def test_field_selector_refuses_fields_the_kind_does_not_index() -> None:
    # CRDs (KubeVirt kinds) only index metadata.name and metadata.namespace upstream
    with pytest.raises(SelectorError, match=r"field label not supported: status\.phase"):
        parse_field_selector("status.phase=Running", "VirtualMachineInstance")
    with pytest.raises(SelectorError):
        parse_field_selector("metadata.name", "Service")
