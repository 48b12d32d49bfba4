"""Service JSON -> EnsembleSpec: defaults, fallbacks with problems, refusals."""

from __future__ import annotations

from typing import Any

import pytest

from host_agent.ensembles.service_spec import parse_ensemble_service, service_annotations
from imex_shared.model import EnsembleId
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


def test_mode_auth_encryption_and_ca_rotation() -> None:
    spec, problems = parse_ensemble_service(
        service(annotations={
            "imex-ensemble.io/mode": "ips",
            "imex-ensemble.io/auth-encryption": "False",
            "imex-ensemble.io/ca-rotation": " 2026-12-01 ",
        })
    )
    assert problems == []
    assert spec is not None
    assert (spec.mode, spec.auth_encryption, spec.ca_rotation, spec.source) == (
        "ips", False, "2026-12-01", "service")
    plain, _ = parse_ensemble_service(service())
    assert plain is not None
    assert (plain.mode, plain.auth_encryption, plain.ca_rotation) == ("names", False, None)


@pytest.mark.parametrize(
    ("annotations", "message"),
    [
        ({"imex-ensemble.io/mode": "names,ips"},
         "annotation imex-ensemble.io/mode='names,ips' is not 'names' or 'ips'; refusing to "
         "guess what every guest's nodes file holds"),
        ({"imex-ensemble.io/auth-encryption": "yes"},
         "annotation imex-ensemble.io/auth-encryption='yes' is not 'true' or 'false'; "
         "refusing to guess whether the peers speak TLS"),
        ({"imex-ensemble.io/auth-encryption": "true", "imex-ensemble.io/mode": "ips"},
         "authEncryption needs mode names: IMEX checks peer certificates against host names, "
         "which mode ips does not write"),
    ],
)
def test_domain_shaping_annotations_are_refusals(annotations: dict[str, str], message: str) -> None:
    spec, problems = parse_ensemble_service(service(annotations=annotations))
    assert spec is None
    assert problems == [f"Service rack1/gb200: {message}"]


def test_auth_encryption_with_names_is_fine() -> None:
    spec, problems = parse_ensemble_service(
        service(annotations={"imex-ensemble.io/auth-encryption": "TRUE"}))
    assert problems == [] and spec is not None and spec.auth_encryption is True


@pytest.mark.parametrize("value", ["", "   ", "x" * 64, "line\nbreak"])
def test_bad_ca_rotation_falls_back_to_no_rotation(value: str) -> None:
    spec, problems = parse_ensemble_service(
        service(annotations={"imex-ensemble.io/ca-rotation": value}))
    assert spec is not None and spec.ca_rotation is None
    assert problems == [
        "Service rack1/gb200: annotation imex-ensemble.io/ca-rotation must be 1-63 printable "
        "characters; no CA rotation is started until it is fixed"
    ]


@pytest.mark.parametrize(
    "annotations",
    [
        {},
        {"imex-ensemble.io/max-members": "4", "imex-ensemble.io/port": "50123",
         "imex-ensemble.io/network": "imex-net", "imex-ensemble.io/token-sha256": TOKEN,
         "imex-ensemble.io/mode": "ips", "imex-ensemble.io/ca-rotation": "r2"},
        {"imex-ensemble.io/auth-encryption": "true"},
    ],
)
def test_service_annotations_round_trip(annotations: dict[str, str]) -> None:
    """What the agent writes on an ImexEnsemble's Service parses back to the same spec."""
    spec, _ = parse_ensemble_service(service(annotations=annotations))
    assert spec is not None
    rendered = service_annotations(spec)
    again, problems = parse_ensemble_service(service(annotations=rendered))
    assert problems == [] and again == spec
    assert set(annotations.items()) <= set(rendered.items())


@pytest.mark.parametrize(("value", "required", "problem"), [
    (None, False, None), ("Optional", False, None), ("Required", True, None),
    ("required", True, None), ("yes", True, "is not Optional or Required"),
])
def test_registry_tls_annotation(value: str | None, required: bool, problem: str | None) -> None:
    annotations = {} if value is None else {"imex-ensemble.io/registry-tls": value}
    spec, problems = parse_ensemble_service(service(annotations=annotations))
    assert spec is not None and spec.registry_tls_required is required
    assert [p for p in problems if "registry-tls" in p] == ([] if problem is None else [
        p for p in problems if problem in p])
    assert ("imex-ensemble.io/registry-tls" in service_annotations(spec)) is required
