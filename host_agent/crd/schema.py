"""A small vocabulary for writing a CRD's schema once, as data.

``host_agent/crd/imexensemble.py`` describes the ImexEnsemble with these values; the
functions here turn that one description into the three things that must
agree with it: the ``openAPIV3Schema`` of the CRD (``openapi``), the field
table of the docs (``doc_rows``), and the spec's defaults and bounds the
agents apply themselves (``spec_facts``). Pure and dependency-free.

Why a vocabulary and not a literal OpenAPI dict: immutability, list-map keys
and CEL rules are properties of one field here, and the generated schema
places them where the apiserver wants them (a transition rule on the field,
``x-kubernetes-list-map-keys`` beside ``items``, bounds that keep the CEL
cost estimator under its limit).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

JSON = dict[str, Any]
Kind = Literal["integer", "string", "boolean", "object", "array", "map"]


@dataclass(frozen=True)
class Rule:
    """One ``x-kubernetes-validations`` entry (CEL), on the field that holds it.

    ``field_path`` (relative, e.g. ``.authEncryption``) makes the apiserver name
    that field in its answer instead of the one holding the rule.
    """

    rule: str
    message: str
    field_path: str | None = None
    reason: str | None = None

    def openapi(self) -> JSON:
        out: JSON = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        if self.reason:
            out["reason"] = self.reason
        return out


@dataclass(frozen=True)
class Field:
    """One schema node. ``kind`` "map" is an object with ``additionalProperties``."""

    name: str
    kind: Kind
    doc: str
    fmt: str | None = None
    default: Any = None
    minimum: int | None = None
    maximum: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    pattern: str | None = None
    enum: tuple[str, ...] = ()
    max_items: int | None = None
    max_properties: int | None = None
    required: bool = False
    fields: tuple[Field, ...] = ()
    items: Field | None = None  # arrays
    values: Field | None = None  # maps
    list_type: Literal["atomic", "set", "map"] | None = None
    list_map_keys: tuple[str, ...] = ()
    map_type: Literal["atomic", "granular"] | None = None
    immutable: bool = False
    immutable_why: str = "set it when the object is created"
    rules: tuple[Rule, ...] = ()
    #: where the value comes from, for the docs ("user", "agent")
    written_by: str = ""

    def child(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def all_rules(self) -> tuple[Rule, ...]:
        if not self.immutable:
            return self.rules
        return (Rule("self == oldSelf", f"{self.name} is immutable: {self.immutable_why}"),
                *self.rules)


def openapi(f: Field) -> JSON:
    """The structural OpenAPI v3 schema of ``f`` as the apiserver wants it."""
    out: JSON = {"description": f.doc}
    if f.kind == "map":
        out["type"] = "object"
        assert f.values is not None, f.name
        out["additionalProperties"] = openapi(f.values)
    else:
        out["type"] = f.kind
    for key, value in (("format", f.fmt), ("default", f.default), ("minimum", f.minimum),
                       ("maximum", f.maximum), ("minLength", f.min_length),
                       ("maxLength", f.max_length), ("pattern", f.pattern),
                       ("maxItems", f.max_items), ("maxProperties", f.max_properties)):
        if value is not None:
            out[key] = value
    if f.enum:
        out["enum"] = list(f.enum)
    if f.fields:
        out["properties"] = {c.name: openapi(c) for c in f.fields}
        req = [c.name for c in f.fields if c.required]
        if req:
            out["required"] = req
    if f.items is not None:
        out["items"] = openapi(f.items)
    if f.list_type:
        out["x-kubernetes-list-type"] = f.list_type
    if f.list_map_keys:
        out["x-kubernetes-list-map-keys"] = list(f.list_map_keys)
    if f.map_type:
        out["x-kubernetes-map-type"] = f.map_type
    rules = f.all_rules()
    if rules:
        out["x-kubernetes-validations"] = [r.openapi() for r in rules]
    return out


@dataclass(frozen=True)
class DocRow:
    path: str
    type: str
    default: str
    constraints: str
    doc: str


def _type_text(f: Field) -> str:
    if f.kind == "array":
        assert f.items is not None
        inner = _type_text(f.items)
        return f"[]{inner}" + (f" (map keyed by {', '.join(f.list_map_keys)})"
                               if f.list_type == "map" else "")
    if f.kind == "map":
        assert f.values is not None
        return f"map[string]{_type_text(f.values)}"
    return f"{f.kind} ({f.fmt})" if f.fmt else f.kind


def _constraints(f: Field) -> str:
    parts: list[str] = []
    if f.minimum is not None and f.maximum is not None:
        parts.append(f"{f.minimum}..{f.maximum}")
    elif f.minimum is not None:
        parts.append(f"at least {f.minimum}")
    elif f.maximum is not None:
        parts.append(f"at most {f.maximum}")
    if f.enum:
        parts.append("one of " + ", ".join(f"`{e}`" for e in f.enum))
    if f.pattern:
        parts.append(f"pattern `{f.pattern}`")
    if f.min_length:
        parts.append("not empty" if f.min_length == 1 else f"at least {f.min_length} characters")
    if f.max_length is not None and not f.pattern:
        parts.append(f"at most {f.max_length} characters")
    if f.max_items is not None:
        parts.append(f"at most {f.max_items} items")
    if f.max_properties is not None:
        parts.append(f"at most {f.max_properties} entries")
    if f.required:
        parts.append("required")
    if f.immutable:
        parts.append("**immutable**")
    parts.extend(f"CEL: {r.message}" for r in f.rules)
    return "; ".join(parts).replace("|", "\\|") if parts else ""


def doc_rows(f: Field, prefix: str = "") -> Iterator[DocRow]:
    """One row per field below ``f`` (``f`` itself excluded), depth first."""
    for c in f.fields:
        path = f"{prefix}.{c.name}" if prefix else c.name
        default = "" if c.default is None else f"`{_json_text(c.default)}`"
        yield DocRow(path, _type_text(c), default, _constraints(c), c.doc)
        if c.kind == "object":
            yield from doc_rows(c, path)
        elif c.kind == "array" and c.items is not None and c.items.kind == "object":
            yield from doc_rows(c.items, f"{path}[]")
        elif c.kind == "map" and c.values is not None and c.values.kind == "object":
            yield from doc_rows(c.values, f"{path}{{}}")


def _json_text(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping):
        return "{}" if not value else str(dict(value))
    return str(value)


@dataclass(frozen=True)
class ScalarFacts:
    """What an agent needs to default and check one scalar spec field itself."""

    kind: str
    default: Any = None
    minimum: int | None = None
    maximum: int | None = None
    enum: tuple[str, ...] = ()
    pattern: str | None = None
    max_length: int | None = None
    immutable: bool = False

    def as_dict(self) -> JSON:
        out: JSON = {"kind": self.kind}
        for key in ("default", "minimum", "maximum", "pattern", "max_length"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.enum:
            out["enum"] = list(self.enum)
        if self.immutable:
            out["immutable"] = True
        return out


def spec_facts(spec: Field) -> dict[str, ScalarFacts]:
    """The scalar fields of ``spec``: defaults, bounds, enums, patterns."""
    return {c.name: ScalarFacts(c.kind, c.default, c.minimum, c.maximum, c.enum, c.pattern,
                                c.max_length, c.immutable)
            for c in spec.fields if c.kind in ("integer", "string", "boolean")}


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    doc: str
    priority: int = 0

    def openapi(self) -> JSON:
        out: JSON = {"name": self.name, "type": self.type, "jsonPath": self.json_path,
                     "description": self.doc}
        if self.priority:
            out["priority"] = self.priority
        return out


@dataclass(frozen=True)
class CustomResource:
    """Everything a CustomResourceDefinition of one version says."""

    group: str
    version: str
    kind: str
    plural: str
    singular: str
    short_names: tuple[str, ...]
    categories: tuple[str, ...]
    doc: str
    spec: Field
    status: Field
    columns: tuple[PrinterColumn, ...]
    root_rules: tuple[Rule, ...] = field(default=())
    #: how later API versions will be served beside this one (docs only, Markdown)
    versioning: str = ""

    @property
    def name(self) -> str:
        return f"{self.plural}.{self.group}"

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}"

    def schema(self) -> JSON:
        root: JSON = {
            "description": self.doc,
            "type": "object",
            "properties": {
                "apiVersion": {"type": "string", "description": "APIVersion of this object."},
                "kind": {"type": "string", "description": "Kind of this object."},
                "metadata": {"type": "object"},
                "spec": openapi(self.spec),
                "status": openapi(self.status),
            },
        }
        if self.root_rules:
            root["x-kubernetes-validations"] = [r.openapi() for r in self.root_rules]
        return root

    def definition(self, labels: Mapping[str, str] | None = None) -> JSON:
        """The CustomResourceDefinition object (apiextensions.k8s.io/v1)."""
        meta: JSON = {"name": self.name}
        if labels:
            meta["labels"] = dict(labels)
        names: JSON = {"plural": self.plural, "singular": self.singular, "kind": self.kind,
                       "listKind": f"{self.kind}List", "shortNames": list(self.short_names)}
        if self.categories:
            names["categories"] = list(self.categories)
        return {
            "apiVersion": "apiextensions.k8s.io/v1",
            "kind": "CustomResourceDefinition",
            "metadata": meta,
            "spec": {
                "group": self.group,
                "scope": "Namespaced",
                "names": names,
                "versions": [{
                    "name": self.version,
                    "served": True,
                    "storage": True,
                    "subresources": {"status": {}},
                    "additionalPrinterColumns": [c.openapi() for c in self.columns],
                    "schema": {"openAPIV3Schema": self.schema()},
                }],
            },
        }
