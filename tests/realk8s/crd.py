"""KubeVirt's VirtualMachineInstance CRD, built from KubeVirt's published OpenAPI v2 spec.

Pure functions, no I/O beyond reading the spec file. The apiserver only accepts a
*structural* openAPIV3Schema, so the v2 definitions are rewritten, not copied:

- every ``$ref`` is inlined (the VMI's definition graph has no cycles; a cycle, if
  one appeared, becomes an object that preserves unknown fields rather than an
  endless expansion);
- ``type`` lists become what a structural schema can say: ``[T, "null"]`` is
  ``T`` + ``nullable``; ``["string", "integer"|"number", ...]`` (Quantity,
  IntOrString ports) is ``x-kubernetes-int-or-string``;
- untyped nodes preserve unknown fields; typed objects without properties are
  KubeVirt's empty option structs (``masquerade: {}``) and stay empty objects;
- ``default``, ``description`` and list/map-type hints are dropped: defaults would
  make the apiserver rewrite fixtures behind the test's back, descriptions only
  cost size, and list-map keys must be required fields, which the v2 spec does
  not guarantee;
- ``metadata`` at the root is a bare object (the apiserver owns its schema).

Status is a subresource, as in KubeVirt, so a main-resource write drops status
changes and ``/status`` is the only way to set them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

GROUP = "kubevirt.io"
VERSION = "v1"
PLURAL = "virtualmachineinstances"
KIND = "VirtualMachineInstance"
ROOT_DEFINITION = "v1.VirtualMachineInstance"

_KEEP = {
    "type",
    "format",
    "required",
    "enum",
    "nullable",
    "minimum",
    "maximum",
    "pattern",
    "maxLength",
    "minLength",
    "maxItems",
    "minItems",
}
_INT_OR_STRING_FORMATS = {"int-or-string"}
_VALID_FORMATS = {"int32", "int64", "float", "double", "byte", "date-time", "date"}

Schema = dict[str, Any]


class SpecError(Exception):
    """The OpenAPI document lacks what the CRD needs (a definition, a resolvable $ref)."""


def _ref_name(ref: str) -> str:
    prefix = "#/definitions/"
    if not ref.startswith(prefix):
        raise SpecError(f"unsupported $ref {ref!r} (only {prefix}... is resolved)")
    return ref[len(prefix) :]


def _convert(node: Schema, defs: dict[str, Schema], stack: tuple[str, ...]) -> Schema:
    if "$ref" in node:
        name = _ref_name(node["$ref"])
        if name in stack:
            return {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
        if name not in defs:
            raise SpecError(f"$ref to missing definition {name!r}")
        return _convert(defs[name], defs, (*stack, name))

    out: Schema = {k: v for k, v in node.items() if k in _KEEP}
    typ = node.get("type")
    if isinstance(typ, list):
        kinds = [t for t in typ if t != "null"]
        if "null" in typ:
            out["nullable"] = True
        if "string" in kinds and ({"integer", "number"} & set(kinds)):
            out.pop("type", None)
            out["x-kubernetes-int-or-string"] = True
        elif len(kinds) == 1:
            out["type"] = kinds[0]
        else:
            out.pop("type", None)
            out["x-kubernetes-preserve-unknown-fields"] = True
    fmt = out.get("format")
    if fmt in _INT_OR_STRING_FORMATS:
        out.pop("format")
        out.pop("type", None)
        out["x-kubernetes-int-or-string"] = True
    elif fmt is not None and fmt not in _VALID_FORMATS:
        out.pop("format")

    if "properties" in node:
        out["type"] = "object"
        out["properties"] = {
            key: _convert(sub, defs, stack) for key, sub in node["properties"].items()
        }
    elif isinstance(node.get("additionalProperties"), dict):
        out["type"] = "object"
        out["additionalProperties"] = _convert(node["additionalProperties"], defs, stack)
    if "items" in node:
        out["items"] = _convert(node["items"], defs, stack)

    if (
        "type" not in out
        and "x-kubernetes-int-or-string" not in out
        and "x-kubernetes-preserve-unknown-fields" not in out
    ):
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def kubevirt_schema(openapi: Schema, root: str = ROOT_DEFINITION) -> Schema:
    """The structural openAPIV3Schema of one KubeVirt definition (``v1.VirtualMachineInstance``,
    ``v1beta1.VirtualMachinePool``)."""
    defs = openapi.get("definitions")
    if not isinstance(defs, dict) or root not in defs:
        raise SpecError(f"the OpenAPI document has no definitions[{root!r}]")
    schema = _convert(defs[root], defs, (root,))
    schema["properties"]["metadata"] = {"type": "object"}
    return schema


def vmi_schema(openapi: Schema) -> Schema:
    """The structural openAPIV3Schema of ``v1.VirtualMachineInstance``."""
    return kubevirt_schema(openapi, ROOT_DEFINITION)


def _crd(group: str, version: str, kind: str, plural: str, short_names: list[str],
         schema: Schema, status: bool) -> Schema:
    served: Schema = {"name": version, "served": True, "storage": True,
                      "schema": {"openAPIV3Schema": schema}}
    if status:
        served["subresources"] = {"status": {}}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{group}"},
        "spec": {
            "group": group,
            "scope": "Namespaced",
            "names": {"plural": plural, "singular": kind.lower(), "kind": kind,
                      "listKind": f"{kind}List", "shortNames": short_names,
                      "categories": ["all"]},
            "versions": [served],
        },
    }


def vmi_crd(openapi: Schema) -> Schema:
    """A CustomResourceDefinition for VMIs: namespaced, v1 served and stored, status subresource."""
    return _crd(GROUP, VERSION, KIND, PLURAL, ["vmi", "vmis"], vmi_schema(openapi), True)


def pool_crd(openapi: Schema) -> Schema:
    """KubeVirt's VirtualMachinePool (``pool.kubevirt.io/v1beta1``) as a CRD built the same
    way, so ``kubectl apply`` of a pool is judged by KubeVirt's schema."""
    return _crd("pool.kubevirt.io", "v1beta1", "VirtualMachinePool", "virtualmachinepools",
                ["vmpool", "vmpools"], kubevirt_schema(openapi, "v1beta1.VirtualMachinePool"),
                True)


def network_attachment_definition_crd() -> Schema:
    """Multus' NetworkAttachmentDefinition (``k8s.cni.cncf.io/v1``) as a cluster with Multus
    serves it: a ``spec.config`` string holding the CNI configuration."""
    schema: Schema = {"type": "object", "properties": {
        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
        "metadata": {"type": "object"},
        "spec": {"type": "object", "properties": {"config": {"type": "string"}}}}}
    return _crd("k8s.cni.cncf.io", "v1", "NetworkAttachmentDefinition",
                "network-attachment-definitions", ["net-attach-def"], schema, False)


def kubevirt_openapi() -> Path:
    """Where KubeVirt's schema comes from: ``REALK8S_KUBEVIRT_OPENAPI``, else the shared
    reference beside the repository, else the vendored VMI closure of the API double
    (the same definitions, unchanged: the CRD built from either is identical). A clean
    clone has no ``../shared``; CI must not depend on it."""
    from tests.sandbox.kube_api.validation import kubevirt_openapi_path

    override = os.environ.get("REALK8S_KUBEVIRT_OPENAPI")
    return Path(override) if override else kubevirt_openapi_path()


def load_vmi_crd(spec_path: Path) -> Schema:
    """Read KubeVirt's OpenAPI JSON and build the VMI CRD from it."""
    try:
        openapi = json.loads(spec_path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecError(f"cannot read OpenAPI spec {spec_path}: {exc}") from exc
    return vmi_crd(openapi)
