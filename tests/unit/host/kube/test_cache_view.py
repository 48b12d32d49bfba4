"""What the informer cache keeps (a benchmark-driven memory cut, issue 7): VMIs without
spec, annotations and managedFields, other kinds without managedFields, and the same
members derived either way."""

from __future__ import annotations

import copy
from typing import Any

from host_agent.ensembles.members import derive_members
from host_agent.kube.cache import Store, cache_view
from host_agent.state.snapshot import EnsembleSpec
from imex_shared.model import EnsembleId
from tests.host_support.kubevirt import service, vmi
from tests.unit.host.kube.test_informer import Script, drive

MANAGED = [{"manager": "virt-controller", "operation": "Update", "fieldsType": "FieldsV1",
            "fieldsV1": {"f:status": {"f:phase": {}}}}]


def full(obj: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["metadata"]["managedFields"] = copy.deepcopy(MANAGED)
    out["metadata"]["annotations"] = {"kubevirt.io/latest-observed-api-version": "v1"}
    out["metadata"]["resourceVersion"] = "42"
    return out


VMIS = [
    vmi("gb200-0", ip="10.244.0.1"),
    vmi("gb200-1", ip="10.0.2.2"),
    vmi("gb200-2", ips=["fe80::1", "10.244.0.3/24"]),
    vmi("gb200-3", ip="10.244.0.4", deleting=True),
    vmi("gb200-4", phase="Failed", ip="10.244.0.5"),
    vmi("gb200-5", ip="10.244.0.6", ready=False, node=None),
    vmi("odd", index="7", ip="10.244.0.7"),
    vmi("gb200-8", status=False),
]


def test_vmi_view_keeps_what_members_read() -> None:
    view = cache_view("VirtualMachineInstance")
    got = view(full(VMIS[0]))
    assert set(got) == {"metadata", "status"}
    assert "managedFields" not in got["metadata"] and "annotations" not in got["metadata"]
    assert got["metadata"]["resourceVersion"] == "42"
    assert got["metadata"]["labels"] == VMIS[0]["metadata"]["labels"]
    assert got["status"] == {
        "phase": "Running", "nodeName": "node-a",
        "conditions": [{"type": "Ready", "status": "True"}],
        "interfaces": [{"name": "default", "ipAddress": "10.244.0.1",
                        "ipAddresses": ["10.244.0.1"]}],
    }
    spec = EnsembleSpec(EnsembleId("rack1", "gb200"), 18, 50000)
    assert derive_members(spec, [view(full(v)) for v in VMIS]) == derive_members(spec, VMIS)


def test_vmi_view_shares_repeated_strings_and_keeps_malformed_fields() -> None:
    import json

    view = cache_view("VirtualMachineInstance")
    text = json.dumps(VMIS[0])
    a, b = view(json.loads(text)), view(json.loads(text))  # each decoded on its own
    assert a == b
    assert a["status"]["phase"] is b["status"]["phase"]
    assert a["metadata"]["namespace"] is b["metadata"]["namespace"]
    la, lb = list(a["metadata"]["labels"]), list(b["metadata"]["labels"])
    assert all(x is y for x, y in zip(la, lb, strict=True))
    odd = vmi("gb200-9", ip="10.244.0.9")
    odd["status"]["interfaces"] = {"name": "default"}  # not a list
    odd["status"]["conditions"] = "Ready"
    got = view(copy.deepcopy(odd))
    assert got["status"]["interfaces"] == {"name": "default"}
    assert got["status"]["conditions"] == "Ready"
    odd["status"] = ["not", "a", "mapping"]
    assert view(copy.deepcopy(odd))["status"] == ["not", "a", "mapping"]
    spec = EnsembleSpec(EnsembleId("rack1", "gb200"), 18, 50000)
    bad = vmi("gb200-9", ip="10.244.0.9")
    bad["status"]["interfaces"] = [{"name": "default", "ipAddress": 7}, "junk"]
    assert derive_members(spec, [view(copy.deepcopy(bad))]) == derive_members(spec, [bad])


def test_other_kinds_lose_only_managed_fields() -> None:
    view = cache_view("Service")
    svc = full(service())
    got = view(svc)
    assert "managedFields" not in got["metadata"]
    assert got["metadata"]["annotations"] == svc["metadata"]["annotations"]
    assert got["spec"] == svc["spec"]
    assert "managedFields" in svc["metadata"]  # the input is not modified
    plain = service()
    assert view(plain) is plain


async def test_informer_caches_the_view_from_lists_and_watches() -> None:
    script = Script(lists=[([full(VMIS[0])], "10")],
                    watches=[[("MODIFIED", full(VMIS[0])), ("ADDED", full(VMIS[2]))]])
    script.kind = "VirtualMachineInstance"  # type: ignore[misc]
    store, seen, _ = await drive(script, Store("vmi"))
    for name in ("gb200-0", "gb200-2"):
        cached = store.get("rack1", name)
        assert cached is not None and "spec" not in cached
        assert "managedFields" not in cached["metadata"]
    assert all(n is None or "spec" not in n for _, n in seen)


def test_vmi_view_shares_the_usual_ready_condition() -> None:
    import json

    view = cache_view("VirtualMachineInstance")
    text = json.dumps(VMIS[0])
    a, b = view(json.loads(text)), view(json.loads(text))
    assert a["status"]["conditions"] == [{"type": "Ready", "status": "True"}]
    assert a["status"]["conditions"] is b["status"]["conditions"]  # one list for all
    odd = json.loads(text)
    odd["status"]["conditions"] = [{"type": "Ready", "status": ["x"]},
                                   {"type": "Paused", "status": "True"}]
    got = view(odd)["status"]["conditions"]
    assert got == [{"type": "Ready", "status": ["x"]}]  # kept as it came, not shared
    two = json.loads(text)
    two["status"]["conditions"] = [{"type": "Ready", "status": "True"},
                                   {"type": "Ready", "status": "False"}]
    assert view(two)["status"]["conditions"] == [{"type": "Ready", "status": "True"},
                                                 {"type": "Ready", "status": "False"}]
