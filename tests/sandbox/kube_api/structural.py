"""Custom resources under a CRD's structural schema: defaulting, pruning, validation.

TEST STAND-IN, never product code. What the apiextensions apiserver does with
a custom resource of a CRD with an `openAPIV3Schema`, in the order it does
it, with its answers (Kubernetes v1.37.2: apiextensions-apiserver's
schema/defaulting, schema/pruning, schema/listtype and schema/cel packages,
and kube-openapi's validator whose messages the causes carry):

1. `prune_nulls_and_default`: a `null` for a non-nullable field is dropped
   (or replaced by the field's default); absent fields with a `default` get
   it, top-down (a defaulted object gets its children's defaults).
2. `unknown_fields`: paths the schema does not declare (`spec.foo`,
   `status.members[0].bar`); the store drops them with a warning, or refuses
   them under `fieldValidation=Strict` ("strict decoding error").
3. `validate`: the OpenAPI checks (type, format, enum, bounds, lengths,
   pattern, items, properties, required), then the list-type map/set
   invariants (duplicate keys), then the `x-kubernetes-validations` CEL
   rules through cel.py, skipped with the apiserver's own cause when an
   earlier error blocks them (unsupported value, required, too long, too
   many, wrong type). Transition rules (`oldSelf`) run on update only, for
   values correlated with the old object by field, map key and list-map key.

Not imitated: validation ratcheting (an unchanged invalid value is refused
here, only warned about upstream), `x-kubernetes-embedded-resource`,
int-or-string, preserve-unknown-fields below the root, the formats other than
date-time, `messageExpression`.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator, Mapping
from typing import Any

from . import cel

JSON = dict[str, Any]
Cause = dict[str, str]
Path = tuple[str | int, ...]

_DATE_TIME = re.compile(
    r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}:\d{2}(\.\d+)?([Zz]|[+-]\d{2}:?\d{2})?$")
_ROOT_FIELDS = ("apiVersion", "kind", "metadata")


def _go(value: Any) -> str:
    """A Go field.Error's rendering of a bad value (%v for scalars, %q for strings)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return str(int(value)) if isinstance(value, float) and value.is_integer() else str(value)
    if isinstance(value, str):
        return json.dumps(value)
    return json.dumps(value, separators=(",", ":"), sort_keys=True)


def _cause(reason: str, field: str, body: str) -> Cause:
    return {"reason": reason, "message": body, "field": field}


def invalid(field: str, value: Any, detail: str) -> Cause:
    return _cause("FieldValueInvalid", field, f"Invalid value: {_go(value)}: {detail}")


def path_text(path: Path) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part
    return out


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, int):
        return "integer"
    if isinstance(value, float):
        return "number"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return "array"
    if isinstance(value, Mapping):
        return "object"
    return "null"


def _props(schema: Mapping[str, Any]) -> Mapping[str, Any]:
    props = schema.get("properties")
    return props if isinstance(props, Mapping) else {}


def _values_schema(schema: Mapping[str, Any]) -> Mapping[str, Any] | None:
    extra = schema.get("additionalProperties")
    return extra if isinstance(extra, Mapping) else None


# ------------------------------------------------------------ 1. defaulting


def prune_nulls_and_default(schema: Mapping[str, Any], obj: Any) -> Any:
    """Apply defaults (and drop non-nullable nulls) in place; returns `obj`."""
    if isinstance(obj, dict):
        props = _props(schema)
        for name, sub in props.items():
            if name in obj and obj[name] is None and not sub.get("nullable"):
                if "default" in sub:
                    obj[name] = copy.deepcopy(sub["default"])
                else:
                    del obj[name]
            if name not in obj and "default" in sub:
                obj[name] = copy.deepcopy(sub["default"])
            if name in obj:
                prune_nulls_and_default(sub, obj[name])
        values = _values_schema(schema)
        if values is not None:
            for key in list(obj):
                if obj[key] is None and not values.get("nullable"):
                    del obj[key]
                else:
                    prune_nulls_and_default(values, obj[key])
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for item in obj:
            prune_nulls_and_default(schema["items"], item)
    return obj


# --------------------------------------------------------------- 2. pruning


def unknown_fields(schema: Mapping[str, Any], obj: Any, path: Path = (),
                   root: bool = True) -> list[Path]:
    """Paths in `obj` that `schema` does not declare (pruned upstream)."""
    out: list[Path] = []
    if isinstance(obj, Mapping):
        if schema.get("x-kubernetes-preserve-unknown-fields"):
            return out
        props = _props(schema)
        values = _values_schema(schema)
        for key, value in obj.items():
            if root and key in _ROOT_FIELDS:
                continue
            if key in props:
                out.extend(unknown_fields(props[key], value, (*path, key), False))
            elif values is not None:
                out.extend(unknown_fields(values, value, (*path, key), False))
            else:
                out.append((*path, key))
    elif isinstance(obj, list) and isinstance(schema.get("items"), Mapping):
        for i, item in enumerate(obj):
            out.extend(unknown_fields(schema["items"], item, (*path, i), False))
    return out


# ---------------------------------------------------------- 3. validation


def _schema_errors(schema: Mapping[str, Any], value: Any, path: Path,
                   prefix: Path = ()) -> Iterator[Cause]:
    """kube-openapi's validators for one node, then its children. Messages name the
    node relative to where validation started; the cause's field adds `prefix`
    (a /status write validates the status alone, under the prefix "status")."""
    name = path_text(path)
    at = path_text((*prefix, *path))
    want = schema.get("type")
    have = _json_type(value)
    type_ok = want is None or want == have or (
        want == "integer" and have == "number" and float(value).is_integer()) or (
        want == "number" and have == "integer")
    if not type_ok:
        yield _cause("FieldValueTypeInvalid", at,
                     f"Invalid value: {_go(have)}: {name} in body must be of type {want}: "
                     f"{json.dumps(have)}")
    if type_ok and have == "string":
        length = len(value)
        if "maxLength" in schema and length > schema["maxLength"]:
            limit = schema["maxLength"]
            yield _cause("FieldValueTooLong", at,
                         f"Too long: may not be more than {limit} byte{'s' if limit != 1 else ''}")
        if "minLength" in schema and length < schema["minLength"]:
            yield invalid(at, value, f"{name} in body should be at least "
                                       f"{schema['minLength']} chars long")
        if "pattern" in schema and re.search(schema["pattern"], value) is None:
            yield invalid(at, value, f"{name} in body should match '{schema['pattern']}'")
        if schema.get("format") == "date-time" and not _DATE_TIME.match(value):
            yield _cause("FieldValueTypeInvalid", at,
                         f"Invalid value: {_go(value)}: {name} in body must be of type "
                         f"date-time: {json.dumps(value)}")
    if type_ok and have in ("integer", "number"):
        if "minimum" in schema and value < schema["minimum"]:
            yield invalid(at, value, f"{name} in body should be greater than or equal to "
                                       f"{_go(schema['minimum'])}")
        if "maximum" in schema and value > schema["maximum"]:
            yield invalid(at, value, f"{name} in body should be less than or equal to "
                                       f"{_go(schema['maximum'])}")
    if type_ok and have == "array":
        if "maxItems" in schema and len(value) > schema["maxItems"]:
            limit = schema["maxItems"]
            yield _cause("FieldValueTooMany", at,
                         f"Too many: {len(value)}: must have at most {limit} "
                         f"item{'s' if limit != 1 else ''}")
        items = schema.get("items")
        if isinstance(items, Mapping):
            for i, item in enumerate(value):
                yield from _schema_errors(items, item, (*path, i), prefix)
    if "enum" in schema and not any(value == e and _json_type(e) == have
                                    for e in schema["enum"]):
        allowed = ", ".join(json.dumps(e if isinstance(e, str) else json.dumps(e))
                            for e in schema["enum"])
        yield _cause("FieldValueNotSupported", at,
                     f"Unsupported value: {_go(value)}: supported values: {allowed}")
    if type_ok and have == "object":
        values = _values_schema(schema)
        if values is not None:
            for key, item in value.items():
                yield from _schema_errors(values, item, (*path, key), prefix)
        if "maxProperties" in schema and len(value) > schema["maxProperties"]:
            yield _cause("FieldValueTooMany", at,
                         f"Too many: {len(value)}: must have at most "
                         f"{schema['maxProperties']} items")
        for key, sub in _props(schema).items():
            if key in value:
                yield from _schema_errors(sub, value[key], (*path, key), prefix)
        for key in schema.get("required") or ():
            if key not in value:
                yield _cause("FieldValueRequired", path_text((*prefix, *path, key)),
                             "Required value")


def _list_errors(schema: Mapping[str, Any], value: Any, path: Path) -> Iterator[Cause]:
    """x-kubernetes-list-type map/set: no two items with one key (schema/listtype)."""
    if isinstance(value, Mapping):
        for key, sub in _props(schema).items():
            if key in value:
                yield from _list_errors(sub, value[key], (*path, key))
        values = _values_schema(schema)
        if values is not None:
            for key, item in value.items():
                yield from _list_errors(values, item, (*path, key))
        return
    if not isinstance(value, list):
        return
    raw_items = schema.get("items")
    items: Mapping[str, Any] = raw_items if isinstance(raw_items, Mapping) else {}
    kind = schema.get("x-kubernetes-list-type")
    if kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []
        seen: set[str] = set()
        for i, item in enumerate(value):
            if not isinstance(item, Mapping):
                continue
            item_key = {k: item[k] for k in keys if k in item}
            text = json.dumps(item_key, sort_keys=True)
            if text in seen:
                shown = json.dumps(item_key, separators=(",", ":"), sort_keys=True)
                yield _cause("FieldValueDuplicate", path_text((*path, i)),
                             f"Duplicate value: {shown}")
            seen.add(text)
    elif kind == "set":
        seen_values: list[Any] = []
        for i, item in enumerate(value):
            if item in seen_values:
                yield _cause("FieldValueDuplicate", path_text((*path, i)),
                             f"Duplicate value: {_go(item)}")
            seen_values.append(item)
    for i, item in enumerate(value):
        yield from _list_errors(items, item, (*path, i))


_BLOCKING = {"FieldValueNotSupported", "FieldValueRequired", "FieldValueTooLong",
             "FieldValueTooMany", "FieldValueTypeInvalid"}
_MISSING = object()


def _child_path(path: Path, field_path: str) -> Path:
    """A rule's `fieldPath` (".a.b", ".a['b']") below `path`."""
    parts = re.findall(r"\.([A-Za-z_][A-Za-z0-9_]*)|\['([^']*)'\]", field_path)
    return (*path, *[a or b for a, b in parts])


def _rule_errors(schema: Mapping[str, Any], value: Any, old: Any, path: Path) -> Iterator[Cause]:
    for rule in schema.get("x-kubernetes-validations") or ():
        src = rule["rule"]
        transition = cel.uses_old_self(src)
        if transition and old is _MISSING:
            continue
        message = (rule.get("message") or "").strip() or f"failed rule: {src.strip()}"
        at = path_text(_child_path(path, rule.get("fieldPath") or ""))
        try:
            result = cel.evaluate(src, value, None if old is _MISSING else old, transition)
        except cel.CelError as e:
            yield invalid(at, schema.get("type", ""), f"{e} evaluating rule: {message}")
            continue
        if result is True:
            continue
        shown = "" if schema.get("type") in ("object", "array") else f"{_go(value)}: "
        reason = rule.get("reason") or "FieldValueInvalid"
        if reason == "FieldValueForbidden":
            yield _cause(reason, at, f"Forbidden: {message}")
        elif reason == "FieldValueRequired":
            yield _cause(reason, at, f"Required value: {message}")
        elif reason == "FieldValueDuplicate":
            yield _cause(reason, at, f"Duplicate value: {_go(value)}")
        else:
            yield _cause("FieldValueInvalid", at, f"Invalid value: {shown}{message}")
    yield from _child_rule_errors(schema, value, old, path)


def _child_rule_errors(schema: Mapping[str, Any], value: Any, old: Any,
                       path: Path) -> Iterator[Cause]:
    old_map = old if isinstance(old, Mapping) else {}
    if isinstance(value, Mapping):
        for key, sub in _props(schema).items():
            if key in value:
                yield from _rule_errors(sub, value[key], old_map.get(key, _MISSING),
                                        (*path, key))
        values = _values_schema(schema)
        if values is not None:
            for key, item in value.items():
                yield from _rule_errors(values, item, old_map.get(key, _MISSING), (*path, key))
    elif isinstance(value, list) and isinstance(schema.get("items"), Mapping):
        items = schema["items"]
        olds = _correlate(schema, value, old)
        for i, item in enumerate(value):
            yield from _rule_errors(items, item, olds[i], (*path, i))


def _correlate(schema: Mapping[str, Any], new: list[Any], old: Any) -> list[Any]:
    """Old items matched to new ones: list-maps by key, sets by value, atomic lists never."""
    none = [_MISSING] * len(new)
    if not isinstance(old, list):
        return none
    kind = schema.get("x-kubernetes-list-type")
    if kind == "map":
        keys = schema.get("x-kubernetes-list-map-keys") or []

        def key(item: Any) -> str:
            return json.dumps({k: item.get(k) for k in keys} if isinstance(item, Mapping)
                              else item, sort_keys=True)
        by_key = {key(o): o for o in old}
        return [by_key.get(key(n), _MISSING) for n in new]
    if kind == "set":
        return [n if n in old else _MISSING for n in new]
    return none


def validate(schema: Mapping[str, Any], obj: Mapping[str, Any],
             old: Mapping[str, Any] | None = None, subresource: str = "") -> list[Cause]:
    """Every cause for storing `obj` (defaulted, pruned) under `schema`.

    A write to /status validates the status alone against its schema (messages
    then name fields relative to it), its list-type invariants only where the
    old status kept them, and the CEL rules of the whole object, as upstream."""
    if subresource == "status":
        status_schema = _props(schema).get("status") or {}
        causes = list(_schema_errors(status_schema, obj["status"], (), ("status",))) \
            if "status" in obj else []
        if old is None or not list(_list_errors(schema, old, ())):
            causes.extend(_list_errors(schema, obj, ()))
    else:
        causes = list(_schema_errors(schema, obj, ()))
        causes.extend(_list_errors(schema, obj, ()))
    if any(c["reason"] in _BLOCKING for c in causes):
        causes.append(_cause("FieldValueInvalid", "<nil>",
                             "Invalid value: null: some validation rules were not checked "
                             "because the object was invalid; correct the existing errors to "
                             "complete validation"))
    else:
        causes.extend(_rule_errors(schema, obj, _MISSING if old is None else old, ()))
    return causes


def list_map_keys(schema: Mapping[str, Any], path: tuple[str, ...] = ()) -> dict[
        tuple[str, ...], tuple[str, ...]]:
    """Where the schema has list-type maps: {field path ('*' for list items and map
    values): key fields}, for server-side apply's per-item merge (patching.py)."""
    out: dict[tuple[str, ...], tuple[str, ...]] = {}
    for key, sub in _props(schema).items():
        out.update(list_map_keys(sub, (*path, key)))
    values = _values_schema(schema)
    if values is not None:
        out.update(list_map_keys(values, (*path, "*")))
    items = schema.get("items")
    if isinstance(items, Mapping):
        if schema.get("x-kubernetes-list-type") == "map":
            out[path] = tuple(schema.get("x-kubernetes-list-map-keys") or ())
        out.update(list_map_keys(items, (*path, "*")))
    return out
