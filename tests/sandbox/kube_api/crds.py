"""CustomResourceDefinitions: a stored CRD makes the double serve its kind.

TEST STAND-IN, never product code. What the apiextensions apiserver and its
controllers do when a CRD is written, collapsed into the write itself:

- `check`: the CRD's own validation that the double repeats (its name is
  `<plural>.<group>`, exactly one storage version, a structural schema with
  a type on every node, printer columns with a known type, CEL rules inside
  the subset cel.py evaluates); anything else about CRDs comes from the
  OpenAPI schema of apiextensions.k8s.io/v1 (validation.py);
- `accepted_status`: the status the naming and establishing controllers
  write (NamesAccepted and Established True, acceptedNames, storedVersions);
- `resource_type`: the served kind (discovery, REST paths, the status
  subresource, short names, printer columns), from the storage version.

Simplifications: only the storage version is served (no conversion); a CRD
is Established the moment it is written, where the real one takes a moment
(clients should wait for the condition either way); deleting a CRD deletes
its custom resources at once (upstream a finalizer does it shortly after).
Printer-column JSONPath: the subset `.a.b`, `[n]`, `[?(@.k=="v")]`.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import cel, structural
from .resources import ResourceType

JSON = dict[str, Any]
Cause = dict[str, str]
COLUMN_TYPES = ("integer", "number", "string", "boolean", "date")
NAME_DESCRIPTION = (
    "Name must be unique within a namespace. Is required when creating resources, although "
    "some resources may allow a client to request the generation of an appropriate name "
    "automatically. Name is primarily intended for creation idempotence and configuration "
    "definition. Cannot be updated. More info: "
    "https://kubernetes.io/docs/concepts/overview/working-with-objects/names#names")


@dataclass(frozen=True)
class CrdSpec:
    """What serving one CRD-defined kind needs beyond its ResourceType."""

    crd_name: str
    schema: JSON  # the storage version's openAPIV3Schema
    columns: tuple[JSON, ...]  # additionalPrinterColumns
    list_maps: dict[tuple[str, ...], tuple[str, ...]]


def _storage_version(crd: Mapping[str, Any]) -> Mapping[str, Any] | None:
    versions = (crd.get("spec") or {}).get("versions") or []
    stored = [v for v in versions if isinstance(v, Mapping) and v.get("storage")]
    return stored[0] if len(stored) == 1 else None


def _cause(field: str, message: str, reason: str = "FieldValueInvalid") -> Cause:
    return {"reason": reason, "message": message, "field": field}


def _schema_nodes(node: Any, path: str) -> list[tuple[str, Mapping[str, Any]]]:
    if not isinstance(node, Mapping):
        return []
    out = [(path, node)]
    for key, sub in (node.get("properties") or {}).items():
        out += _schema_nodes(sub, f"{path}.properties[{key}]")
    if isinstance(node.get("items"), Mapping):
        out += _schema_nodes(node["items"], f"{path}.items")
    if isinstance(node.get("additionalProperties"), Mapping):
        out += _schema_nodes(node["additionalProperties"], f"{path}.additionalProperties")
    return out


def check(crd: Mapping[str, Any]) -> list[Cause]:
    """The apiextensions rules the double repeats (see the module docstring)."""
    spec = crd.get("spec") or {}
    names = spec.get("names") or {}
    causes: list[Cause] = []
    want = f"{names.get('plural')}.{spec.get('group')}"
    name = (crd.get("metadata") or {}).get("name")
    if name != want:
        causes.append(_cause("metadata.name", f'Invalid value: "{name}": must be '
                                              "spec.names.plural+\".\"+spec.group"))
    versions = spec.get("versions") or []
    if sum(1 for v in versions if isinstance(v, Mapping) and v.get("storage")) != 1:
        causes.append(_cause("spec.versions", "Invalid value: null: must have exactly one "
                                              "version marked as storage version"))
        return causes
    for i, version in enumerate(versions):
        base = f"spec.versions[{i}]"
        schema = ((version.get("schema") or {}).get("openAPIV3Schema"))
        if not isinstance(schema, Mapping):
            causes.append(_cause(f"{base}.schema.openAPIV3Schema", "Required value: "
                                 "schemas are required", "FieldValueRequired"))
            continue
        for path, node in _schema_nodes(schema, f"{base}.schema.openAPIV3Schema"):
            if "type" not in node and not node.get("x-kubernetes-int-or-string") and \
                    not node.get("x-kubernetes-preserve-unknown-fields") and \
                    path != f"{base}.schema.openAPIV3Schema.properties[metadata]":
                causes.append(_cause(f"{path}.type", "Required value: must not be empty for "
                                     "specified object fields", "FieldValueRequired"))
            for j, rule in enumerate(node.get("x-kubernetes-validations") or []):
                try:
                    cel.compile_rule(str(rule.get("rule", "")))
                except cel.CelError as e:
                    causes.append(_cause(f"{path}.x-kubernetes-validations[{j}].rule",
                                         f"Invalid value: {rule.get('rule')!r}: outside the "
                                         f"sandbox's CEL subset (cel.py): {e}"))
        for j, col in enumerate(version.get("additionalPrinterColumns") or []):
            if col.get("type") not in COLUMN_TYPES:
                allowed = ", ".join(f'"{t}"' for t in COLUMN_TYPES)
                causes.append(_cause(f"{base}.additionalPrinterColumns[{j}].type",
                                     f'Unsupported value: "{col.get("type")}": supported '
                                     f"values: {allowed}", "FieldValueNotSupported"))
    return causes


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def accepted_status(crd: Mapping[str, Any], now: str | None = None) -> JSON:
    """The status the naming and establishing controllers leave on a healthy CRD."""
    when = now or _now()
    spec = crd.get("spec") or {}
    names = dict(spec.get("names") or {})
    names.setdefault("singular", str(names.get("kind", "")).lower())
    names.setdefault("listKind", f"{names.get('kind')}List")
    stored = _storage_version(crd)
    return {
        "conditions": [
            {"type": "NamesAccepted", "status": "True", "lastTransitionTime": when,
             "reason": "NoConflicts", "message": "no conflicts found"},
            {"type": "Established", "status": "True", "lastTransitionTime": when,
             "reason": "InitialNamesAccepted", "message": "the initial names have been accepted"},
        ],
        "acceptedNames": names,
        "storedVersions": [stored["name"]] if stored else [],
    }


def resource_type(crd: Mapping[str, Any]) -> ResourceType:
    """The kind a valid CRD defines (its storage version)."""
    spec = crd["spec"]
    names = spec["names"]
    version = _storage_version(crd)
    assert version is not None, "check() first"
    schema: JSON = dict(version["schema"]["openAPIV3Schema"])
    info = CrdSpec(crd["metadata"]["name"], schema,
                   tuple(version.get("additionalPrinterColumns") or ()),
                   structural.list_map_keys(schema))
    return ResourceType(
        spec["group"], version["name"], names["kind"], names["plural"],
        names.get("singular") or names["kind"].lower(), spec.get("scope") == "Namespaced",
        tuple(names.get("shortNames") or ()),
        "status" in (version.get("subresources") or {}), True, crd=info)


# ------------------------------------------------------------ printer columns

_SEGMENT = re.compile(r"""\.([A-Za-z0-9_-]+)|\[(\d+)\]"""
                      r"""|\[\?\(@\.([A-Za-z0-9_]+)\s*==\s*["']([^"']*)["']\)\]""")


def json_path(obj: Any, path: str) -> list[Any]:
    """All values `path` selects in `obj` (client-go jsonpath, the subset above)."""
    current = [obj]
    pos = 0
    while pos < len(path):
        m = _SEGMENT.match(path, pos)
        if m is None:
            raise ValueError(f"unsupported JSONPath {path!r} at {pos}")
        pos = m.end()
        field, index, key, value = m.groups()
        nxt: list[Any] = []
        for cur in current:
            if field is not None and isinstance(cur, Mapping) and field in cur:
                nxt.append(cur[field])
            elif index is not None and isinstance(cur, list) and int(index) < len(cur):
                nxt.append(cur[int(index)])
            elif key is not None and isinstance(cur, list):
                nxt.extend(i for i in cur if isinstance(i, Mapping) and str(i.get(key)) == value)
        current = nxt
    return current


def _go_print(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        import json
        return json.dumps(value, separators=(",", ":"))
    return str(value)


def cell(column: Mapping[str, Any], obj: Mapping[str, Any], age: Any) -> Any:
    """One printer-column cell as the CRD table convertor computes it."""
    values = json_path(obj, str(column.get("jsonPath", "")))
    if not values:
        return None
    value = values[0]
    kind = column.get("type")
    if kind == "string":
        return _go_print(value) if value is not None else None
    if value is None:
        return None
    if kind == "integer":
        if isinstance(value, bool):
            return None
        return int(value) if isinstance(value, (int, float)) else None
    if kind == "number":
        return float(value) if isinstance(value, (int, float)) and \
            not isinstance(value, bool) else None
    if kind == "boolean":
        return value if isinstance(value, bool) else None
    if kind == "date":
        return age(value) if isinstance(value, str) else None
    return None
