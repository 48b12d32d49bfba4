"""The realk8s harness's pure parts and failure path, without the Go binaries.

Not marked realk8s: these run with ``make test`` (fast, no build). The CRD builder
is checked on small hand-written OpenAPI documents (the real one is checked by the
apiserver in test_control_plane.py); the start-up failure path with a fake etcd.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.realk8s.crd import SpecError, kubevirt_openapi, vmi_crd, vmi_schema
from tests.realk8s.harness import ControlPlane, HarnessError
from tests.sandbox.kube_api import validation
from tests.sandbox.kube_api.validation import VENDORED_KUBEVIRT

REF = "#/definitions/"


def doc(**defs: Any) -> dict[str, Any]:
    return {"definitions": {"v1.VirtualMachineInstance": {
        "type": "object", "required": ["spec"],
        "properties": {"metadata": {"$ref": REF + "Meta", "default": {}},
                       "spec": {"$ref": REF + "Spec"},
                       "status": {"$ref": REF + "Status", "default": {}}}},
        "Meta": {"type": "object", "properties": {"name": {"type": "string"}}},
        **defs}}


def test_refs_inlined_defaults_and_descriptions_dropped_metadata_left_open() -> None:
    schema = vmi_schema(doc(
        Spec={"type": "object", "description": "x", "required": ["domain"],
              "properties": {"domain": {"$ref": REF + "Domain", "default": {}}}},
        Domain={"type": "object", "properties": {"cores": {"type": "integer",
                                                           "format": "int32"}}},
        Status={"type": "object", "nullable": True, "properties": {}}))
    assert schema["properties"]["metadata"] == {"type": "object"}
    spec = schema["properties"]["spec"]
    assert spec == {"type": "object", "required": ["domain"], "properties": {
        "domain": {"type": "object", "properties": {
            "cores": {"type": "integer", "format": "int32"}}}}}
    assert schema["properties"]["status"]["nullable"] is True


def test_type_lists_become_structural() -> None:
    schema = vmi_schema(doc(
        Spec={"type": "object", "properties": {
            "when": {"type": ["string", "null"], "format": "date-time"},
            "port": {"type": ["string", "number"]},
            "size": {"$ref": REF + "Quantity"},
            "anything": {"description": "untyped"},
            "odd": {"type": ["boolean", "integer"]},
            "ios": {"type": "string", "format": "int-or-string"},
            "labels": {"type": "object", "additionalProperties": {"type": "string"}},
            "marker": {"type": "object"},
        }},
        Quantity={"type": ["string", "integer", "number"]},
        Status={"type": "object"}))
    props = schema["properties"]["spec"]["properties"]
    assert props["when"] == {"type": "string", "format": "date-time", "nullable": True}
    assert props["port"] == {"x-kubernetes-int-or-string": True}
    assert props["size"] == {"x-kubernetes-int-or-string": True}
    assert props["anything"] == {"x-kubernetes-preserve-unknown-fields": True}
    assert props["odd"] == {"x-kubernetes-preserve-unknown-fields": True}
    assert props["ios"] == {"x-kubernetes-int-or-string": True}
    assert props["labels"] == {"type": "object", "additionalProperties": {"type": "string"}}
    assert props["marker"] == {"type": "object"}


def test_a_reference_cycle_ends_in_an_open_object() -> None:
    schema = vmi_schema(doc(
        Spec={"type": "object", "properties": {"node": {"$ref": REF + "Node"}}},
        Node={"type": "object", "properties": {"child": {"$ref": REF + "Node"}}},
        Status={"type": "object"}))
    node = schema["properties"]["spec"]["properties"]["node"]
    assert node["properties"]["child"] == {"type": "object",
                                           "x-kubernetes-preserve-unknown-fields": True}


def test_crd_has_status_subresource_and_names() -> None:
    crd = vmi_crd(doc(Spec={"type": "object"}, Status={"type": "object"}))
    version = crd["spec"]["versions"][0]
    assert crd["metadata"]["name"] == "virtualmachineinstances.kubevirt.io"
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["kind"] == "VirtualMachineInstance"
    assert "vmi" in crd["spec"]["names"]["shortNames"]


@pytest.mark.parametrize(("spec", "message"), [
    ({"definitions": {}}, "no definitions['v1.VirtualMachineInstance']"),
    (doc(Spec={"$ref": REF + "Missing"}, Status={"type": "object"}),
     "missing definition 'Missing'"),
    (doc(Spec={"$ref": "other.json#/x"}, Status={"type": "object"}),
     "unsupported $ref 'other.json#/x'"),
])
def test_bad_specs_are_named(spec: dict[str, Any], message: str) -> None:
    with pytest.raises(SpecError, match=message.replace("$", r"\$").replace("[", r"\[")):
        vmi_crd(spec)


def test_a_component_that_dies_at_start_fails_the_start_with_its_log_and_leaves_nothing(
        tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    etcd = bin_dir / "etcd"
    etcd.write_text("#!/bin/sh\necho 'etcd: cannot bind: simulated' >&2\nexit 3\n")
    etcd.chmod(etcd.stat().st_mode | stat.S_IXUSR)
    work = tmp_path / "work"
    work.mkdir()
    cp = ControlPlane(bin_dir=bin_dir, vmi_openapi=tmp_path / "unused.json", workdir=work)
    with pytest.raises(HarnessError, match="etcd exited with 3") as err:
        cp.start()
    assert "cannot bind: simulated" in str(err.value)
    assert not work.exists()
    assert cp.procs == {}
    assert str(etcd) not in _cmdlines()


def _cmdlines() -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                out.append(Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode())
            except OSError:
                continue
    return out


def test_schema_source_falls_back_to_the_vendored_closure(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A clean clone (CI) builds the CRD from the vendored closure, which is the shared
    reference's VMI closure unchanged (tests/unit/sandbox/test_kube_api_validation.py)."""
    monkeypatch.setattr(validation, "shared_kubevirt_openapi", lambda: tmp_path / "absent.json")
    monkeypatch.delenv("REALK8S_KUBEVIRT_OPENAPI", raising=False)
    assert kubevirt_openapi() == VENDORED_KUBEVIRT
    monkeypatch.setenv("REALK8S_KUBEVIRT_OPENAPI", str(tmp_path / "mine.json"))
    assert kubevirt_openapi() == tmp_path / "mine.json"
