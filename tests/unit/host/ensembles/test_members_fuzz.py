"""Whatever JSON a VMI holds, member derivation returns; what it publishes is sound."""

from __future__ import annotations

import ipaddress
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from host_agent.ensembles.members import derive_members
from host_agent.ensembles.service_spec import parse_ensemble_service
from host_agent.state.snapshot import EnsembleSpec
from imex_shared.model import EnsembleId, unusable_reason

SPEC = EnsembleSpec(EnsembleId("rack1", "gb200"), max_members=8, port=50000)

scalars = st.one_of(
    st.none(), st.booleans(), st.integers(-3, 20), st.text(max_size=12),
    st.sampled_from(["Running", "Pending", "10.0.2.2", "10.1.2.3/24", "fe80::1", "fd00::5",
                     "default", "gb200-3", "3", "-1", "True", "Ready", "127.0.0.1"]),
)
json_values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4),
                            st.dictionaries(st.text(max_size=8), inner, max_size=4)),
    max_leaves=12,
)
iface = st.fixed_dictionaries({}, optional={
    "name": st.one_of(st.sampled_from(["default", "imex-net"]), json_values),
    "ipAddress": st.one_of(st.sampled_from(["10.1.0.1", "10.0.2.2", "fd00::1/64"]), json_values),
    "ipAddresses": st.one_of(st.lists(st.sampled_from(["10.1.0.2", "169.254.0.1", "x"])),
                             json_values),
})
vmis = st.fixed_dictionaries({}, optional={
    "metadata": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "name": st.one_of(st.sampled_from(["gb200-0", "gb200-1", "gb200-9", "vm", "Bad_1"]),
                          json_values),
        "labels": st.one_of(json_values, st.fixed_dictionaries({}, optional={
            "imex-ensemble.io/index": st.one_of(st.sampled_from(["0", "1", "07", "x"]),
                                                json_values)})),
        "deletionTimestamp": json_values,
    })),
    "status": st.one_of(json_values, st.fixed_dictionaries({}, optional={
        "phase": st.one_of(st.sampled_from(["Running", "Failed", ""]), json_values),
        "interfaces": st.one_of(st.lists(st.one_of(iface, json_values), max_size=3),
                                json_values),
        "conditions": json_values,
        "nodeName": json_values,
    })),
})


@settings(max_examples=150, deadline=None)
@given(st.lists(vmis, max_size=6))
def test_any_vmis_give_sound_members(objs: list[dict[str, Any]]) -> None:
    members, problems = derive_members(SPEC, objs)
    indexes = [m.index for m in members]
    assert len(indexes) == len(set(indexes))
    for m in members:
        assert 0 <= m.index < SPEC.max_members
        assert unusable_reason(ipaddress.ip_address(m.ip)) is None
        assert isinstance(m.vmi, str) and m.phase == "Running"
    assert all(isinstance(p, str) and p for p in problems)


@settings(max_examples=100, deadline=None)
@given(json_values)
def test_any_service_json_is_parsed_or_refused(obj: Any) -> None:
    if not isinstance(obj, dict):
        obj = {"metadata": obj}
    spec, problems = parse_ensemble_service(obj)
    assert spec is not None or problems
