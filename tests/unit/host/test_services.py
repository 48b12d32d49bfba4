"""Service JSON -> EnsembleSpec: defaults, fallbacks with problems, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from guest_agent.model import EnsembleId
from host_agent.services import parse_ensemble_service
from tests.host_support.kubevirt import service

TOKEN = "ab" * 32


def test_defaults() -> None:
    spec, problems = parse_ensemble_service(service())
    assert problems == []
    assert spec is not None
    assert spec.ens == EnsembleId("rack1", "gb200")
    assert (spec.max_members, spec.port, spec.network, spec.token_sha256) == (18, 50000, None, None)
    assert spec.uid == "6f0f1d5e-0000-4000-8000-000000000001"


def test_all_annotations() -> None:
    spec, problems = parse_ensemble_service(
        service(
            annotations={
                "imex-ensemble.io/max-members": "8",
                "imex-ensemble.io/port": "50001",
                "imex-ensemble.io/network": "imex-net",
                "imex-ensemble.io/token-sha256": TOKEN.upper(),
            }
        )
    )
    assert problems == []
    assert spec is not None
    assert (spec.max_members, spec.port, spec.network, spec.token_sha256) == (
        8,
        50001,
        "imex-net",
        TOKEN,
    )


@pytest.mark.parametrize("value", ["", "twelve", "-1", "0", "1e3", "1001", " ", "١٢"])
def test_bad_max_members_is_a_refusal(value: str) -> None:
    spec, problems = parse_ensemble_service(
        service(annotations={"imex-ensemble.io/max-members": value})
    )
    assert spec is None
    assert problems == [
        f"Service rack1/gb200: annotation imex-ensemble.io/max-members={value!r} is not an "
        "integer in 1..1000; refusing to guess the ensemble size (it fixes every guest's "
        "nodes file)"
    ]


@pytest.mark.parametrize(
    ("key", "value", "field", "fallback", "fragment"),
    [
        ("port", "http", "port", 50000, "is not a port number (1..65535); publishing port 50000"),
        ("port", "70000", "port", 50000, "is not a port number"),
        ("port", "0", "port", 50000, "is not a port number"),
        ("network", "", "network", None, "is not a network name"),
        ("network", "bad net", "network", None, "is not a network name"),
        ("token-sha256", "abc", "token_sha256", None, "guest status reports are refused"),
        ("token-sha256", "g" * 64, "token_sha256", None, "is not 64 hex digits"),
    ],
)
def test_bad_optional_annotations_fall_back_with_a_problem(
    key: str, value: str, field: str, fallback: Any, fragment: str
) -> None:
    spec, problems = parse_ensemble_service(service(annotations={f"imex-ensemble.io/{key}": value}))
    assert spec is not None
    assert getattr(spec, field) == fallback
    assert len(problems) == 1 and fragment in problems[0]
    assert problems[0].startswith(f"Service rack1/gb200: annotation imex-ensemble.io/{key}")


def test_token_value_never_appears_in_problems() -> None:
    secretish = "s3cr3t-token-value"
    _, problems = parse_ensemble_service(
        service(annotations={"imex-ensemble.io/token-sha256": secretish})
    )
    assert problems and secretish not in problems[0]


def test_label_must_name_the_service_itself() -> None:
    spec, problems = parse_ensemble_service(service(label="other"))
    assert spec is None
    assert "labelled imex-ensemble.io/ensemble='other'" in problems[0]


def test_selector_and_cluster_ip_are_problems_but_still_publish() -> None:
    spec, problems = parse_ensemble_service(service(selector={"app": "x"}, cluster_ip="10.96.0.10"))
    assert spec is not None
    assert len(problems) == 2
    assert "has a selector" in problems[0]
    assert "is not headless (clusterIP '10.96.0.10')" in problems[1]


@pytest.mark.parametrize(
    "obj",
    [
        {},
        {"metadata": None},
        {"metadata": {"name": "Bad_Name", "namespace": "rack1"}},
        {"metadata": {"name": "x", "namespace": "rack1", "labels": "nope"}},
        {
            "metadata": {
                "name": "x",
                "namespace": "rack1",
                "labels": {"imex-ensemble.io/ensemble": "x"},
                "annotations": [],
            },
            "spec": "weird",
        },
    ],
)
def test_garbage_never_raises(obj: dict[str, Any]) -> None:
    spec, problems = parse_ensemble_service(obj)
    if spec is None:
        assert problems
    else:
        assert spec.max_members == 18
