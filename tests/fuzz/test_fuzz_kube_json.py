"""VMI, Service and ImexEnsemble JSON of every shape (issue 30): known fields holding
values of every type, the right shapes with hostile values, and arbitrary JSON.

Properties: parsing never raises; an ensemble is either read or refused with a message
that starts with the object (``ImexEnsemble ns/name:``, ``Service ns/name``) and names
the field or annotation; members derived from VMIs are sound (unique indexes inside the
ensemble, usable addresses, Running) and every problem is a non-empty sentence.
"""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import example, given
from hypothesis import strategies as st

from host_agent.ensembles.cr_spec import parse_ensemble_cr
from host_agent.ensembles.members import derive_members
from host_agent.ensembles.service_spec import (
    AUTH_ENCRYPTION_ANNOTATION,
    CA_ROTATION_ANNOTATION,
    ENSEMBLE_LABEL,
    INDEX_LABEL,
    MAX_MEMBERS_ANNOTATION,
    MODE_ANNOTATION,
    NETWORK_ANNOTATION,
    PORT_ANNOTATION,
    TOKEN_ANNOTATION,
    parse_ensemble_service,
)
from host_agent.state.snapshot import EnsembleSpec
from imex_shared.model import EnsembleId, unusable_reason
from tests.fuzz.budget import count, fuzz

_scalar = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**64), 2**64), st.floats(), st.text(max_size=16),
    st.sampled_from(["Running", "10.0.2.2", "10.1.2.3/24", "fe80::1", "fd00::5", "default",
                     "gb200", "gb200-3", "3", "07", "-1", "true", "ips", "names", "a" * 64,
                     "0" * 64, "50000", "0x10", "\u0663", "In", "NotIn", "Exists"]))
_json = st.recursive(_scalar, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=10), kids, max_size=3)),
    max_leaves=10)
_name = st.one_of(st.sampled_from(["gb200", "gb200-b", "Bad_1", "", "a" * 70]), _json)
_meta = st.fixed_dictionaries({}, optional={
    "name": _name, "namespace": st.one_of(st.just("gpu"), _json), "uid": _json,
    "generation": _json, "deletionTimestamp": _json,
    "labels": st.one_of(_json, st.dictionaries(
        st.sampled_from([ENSEMBLE_LABEL, INDEX_LABEL, "x"]), st.one_of(_name, _json))),
    "annotations": st.one_of(_json, st.dictionaries(st.sampled_from([
        MAX_MEMBERS_ANNOTATION, MODE_ANNOTATION, PORT_ANNOTATION, NETWORK_ANNOTATION,
        TOKEN_ANNOTATION, AUTH_ENCRYPTION_ANNOTATION, CA_ROTATION_ANNOTATION]), _json,
        max_size=5)),
})
_selector = st.one_of(_json, st.fixed_dictionaries({}, optional={
    "matchLabels": st.one_of(_json, st.dictionaries(st.text(max_size=10), _json, max_size=2)),
    "matchExpressions": st.one_of(_json, st.lists(st.fixed_dictionaries({}, optional={
        "key": _json, "operator": _json, "values": _json}), max_size=2))}))
_cr_spec = st.fixed_dictionaries({}, optional={
    name: _json for name in ("maxMembers", "port", "mode", "network", "tokenSHA256",
                             "caRotation", "authEncryption")} | {"memberSelector": _selector})


@fuzz
@given(st.one_of(st.fixed_dictionaries({"metadata": _meta}, optional={
    "spec": st.one_of(_cr_spec, _json), "status": _json}), st.dictionaries(
    st.text(max_size=8), _json, max_size=3)))
@example({"metadata": {"namespace": "gpu", "name": "gb200"},
          "spec": {"maxMembers": True, "authEncryption": "yes"}})
@example({"metadata": {"namespace": "gpu", "name": "gb200"},
          "spec": {"memberSelector": {"matchExpressions": [{"key": 5, "operator": "In"}]}}})
def test_imexensemble_json_is_read_or_refused_by_field(cr: dict[str, Any]) -> None:
    count("imexensemble_json")
    parsed = parse_ensemble_cr(cr)
    if parsed.spec is None:
        assert parsed.reason and parsed.message, parsed
        assert parsed.message.startswith("ImexEnsemble "), parsed.message
        assert "spec." in parsed.message or "name" in parsed.message \
            or "namespace" in parsed.message or "label" in parsed.message, parsed.message
    else:
        assert parsed.spec.max_members >= 1 and 1 <= parsed.spec.port <= 65535


@fuzz
@given(st.one_of(st.fixed_dictionaries({"metadata": _meta}, optional={"spec": _json}),
                 st.dictionaries(st.text(max_size=8), _json, max_size=3)))
@example({"metadata": {"namespace": "gpu", "name": "gb200",
                       "labels": {ENSEMBLE_LABEL: "gb200"},
                       "annotations": {MAX_MEMBERS_ANNOTATION: "\u0663"}}})
def test_service_json_is_read_or_refused_by_annotation(service: dict[str, Any]) -> None:
    count("service_json")
    spec, problems = parse_ensemble_service(service)
    assert spec is not None or problems
    assert all(isinstance(p, str) and p.startswith("Service") for p in problems), problems
    if spec is not None:
        assert spec.max_members >= 1 and 1 <= spec.port <= 65535


SPEC = EnsembleSpec(EnsembleId("gpu", "gb200"), max_members=8, port=50000)
_iface = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["default", "imex-net"]), _json),
    "ipAddress": st.one_of(st.sampled_from(["10.1.0.1", "10.0.2.2", "fd00::1/64"]), _json),
    "ipAddresses": st.one_of(st.lists(st.sampled_from(["10.1.0.2", "169.254.0.1", "x",
                                                       "::ffff:10.1.0.3"])), _json)})
_vmi = st.fixed_dictionaries({}, optional={
    "metadata": st.one_of(_meta, st.fixed_dictionaries({"name": st.sampled_from(
        ["gb200-0", "gb200-1", "gb200-9", "gb200-07"])}, optional={"labels": st.just(
            {ENSEMBLE_LABEL: "gb200"})})),
    "status": st.one_of(_json, st.fixed_dictionaries({}, optional={
        "phase": st.one_of(st.sampled_from(["Running", "Failed"]), _json),
        "interfaces": st.one_of(st.lists(st.one_of(_iface, _json), max_size=3), _json),
        "conditions": st.one_of(_json, st.just([{"type": "Ready", "status": "True"}])),
        "nodeName": _json, "migrationState": _json}))})


@fuzz
@given(st.lists(_vmi, max_size=6))
def test_vmi_json_gives_sound_members(objs: list[dict[str, Any]]) -> None:
    count("vmi_json")
    members, problems = derive_members(SPEC, objs)
    indexes = [m.index for m in members]
    assert len(indexes) == len(set(indexes))
    for m in members:
        assert 0 <= m.index < SPEC.max_members
        assert unusable_reason(ipaddress.ip_address(m.ip)) is None
        assert m.phase == "Running"
    assert all(isinstance(p, str) and p for p in problems)
