"""Patch formats and server-side apply, as pure functions on JSON dicts.

TEST STAND-IN, never product code. Imitates what the real apiserver does for
each `Content-Type` of a PATCH (Kubernetes docs, "Update API Objects in Place
Using kubectl patch" and "Server-Side Apply"):

- `application/merge-patch+json`: RFC 7386 (null deletes, maps merge, lists
  replace);
- `application/json-patch+json`: RFC 6902 (add, remove, replace, move, copy,
  test);
- `application/strategic-merge-patch+json`: RFC 7386 plus lists of maps
  merged by their merge key (`containers` by `name`, `conditions` by `type`,
  ...), `$patch: delete|replace` directives; a simplification of the real
  patchMeta-driven merge, good for the built-in kinds here;
- `application/apply-patch+yaml`: server-side apply with per-manager field
  ownership. Simplified: a field is a path of map keys; lists are atomic
  (owned whole), except, for kinds a CRD defines, lists the schema marks
  `x-kubernetes-list-type: map`, whose items merge by their key fields and
  are owned item by item (`k:{"type":"Ready"}` in managedFields), as
  structured-merge-diff does: an object is turned into a tree where such a
  list is a map keyed by `k:{...}`, merged, and turned back (items keep
  their order, new ones are appended). Conflicts are reported against any
  other manager owning a field whose value the apply would change (409
  unless `force`), fields a manager stops applying are removed unless
  another manager owns them. An apply that changes nothing returns the
  object unchanged, which is what lets the store skip the write (no new
  resourceVersion, no watch event).

Nothing here does I/O; errors are `PatchError` (-> 422/400) and
`ApplyConflict` (-> 409).
"""

from __future__ import annotations

import copy
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

JSON = dict[str, Any]
Path = tuple[str, ...]
# (manager, operation "Apply"|"Update", subresource "" | "status")
ManagerKey = tuple[str, str, str]


class PatchError(ValueError):
    """A patch that cannot be applied to the object (the server answers 422)."""


@dataclass
class ApplyConflict(Exception):
    """Server-side apply would change fields another manager owns (409)."""

    conflicts: list[tuple[str, Path]]

    def __str__(self) -> str:
        n = len(self.conflicts)
        parts = [f'conflict with "{m}": {path_text(p)}' for m, p in self.conflicts]
        return f"Apply failed with {n} conflict{'s' if n != 1 else ''}: " + "; ".join(parts)


def path_text(p: Path) -> str:
    """`.status.conditions[type="Ready"].status`, as upstream names a field."""
    out = ""
    for part in p:
        if part.startswith("k:{"):
            keys = json.loads(part[2:])
            out += "[" + ",".join(f"{k}={json.dumps(v)}" for k, v in keys.items()) + "]"
        elif part != ".":
            out += "." + part
    return out


# -------------------------------------------------------- list-type maps (CRDs)

#: Where lists merge by key: {field path, "*" for any list item or map value: key fields}
ListMaps = dict[tuple[str, ...], tuple[str, ...]]


def _map_keys(maps: ListMaps, path: tuple[str, ...]) -> tuple[str, ...] | None:
    for pattern, keys in maps.items():
        if len(pattern) == len(path) and all(a in ("*", b) for a, b in zip(pattern, path,
                                                                          strict=True)):
            return keys
    return None


def item_key(item: Mapping[str, Any], keys: Iterable[str]) -> str:
    """The managedFields name of a list-map item: `k:{"index":0}` (keys sorted)."""
    return "k:" + json.dumps({k: item.get(k) for k in sorted(keys)}, separators=(",", ":"))


class DuplicateKey(PatchError):
    """A list-type map with two items of one key (the apply is refused)."""


def to_tree(obj: Any, maps: ListMaps | None, path: tuple[str, ...] = (),
            strict: bool = True) -> Any:
    """`obj` with every list-type map turned into a dict keyed by item_key.

    A list with a key twice raises DuplicateKey (`strict`), or stays a list (an
    update: validation then refuses it naming the item, as upstream)."""
    if isinstance(obj, dict):
        return {k: to_tree(v, maps, (*path, k), strict) for k, v in obj.items()}
    if isinstance(obj, list) and maps:
        keys = _map_keys(maps, path)
        if keys is not None and all(isinstance(i, dict) for i in obj):
            out: JSON = {}
            for item in obj:
                name = item_key(item, keys)
                if name in out:
                    if not strict:
                        return copy.deepcopy(obj)
                    raise DuplicateKey(f"{path_text(path)}: duplicate entries for key "
                                       f"{path_text((name,))}")
                out[name] = to_tree(item, maps, (*path, "*"), strict)
            return out
    return copy.deepcopy(obj)


def merge_order(live: list[str], config: list[str]) -> list[str]:
    """The order structured-merge-diff gives a merged associative list: the live items,
    with those the applied configuration names moved into its order, new ones where
    the configuration has them (typed/merge.go, visitListItems)."""
    in_config, in_live = set(config), set(live)
    shared = iter([k for k in config if k in in_live])
    next_shared = next(shared, None)
    out: list[str] = []
    merged: set[str] = set()
    li = ci = 0
    while li < len(live) or ci < len(config):
        if li < len(live) and ci < len(config):
            item = live[li]
            if item == config[ci]:
                merged.add(item)
                out.append(item)
                li, ci = li + 1, ci + 1
                next_shared = next(shared, None)
                continue
            if item in in_config and next_shared is not None and next_shared != item:
                li += 1
                continue
        if li < len(live):
            item = live[li]
            if item not in in_config:
                out.append(item)
                li += 1
                continue
            if item in merged:
                li += 1
        if ci < len(config):
            item = config[ci]
            merged.add(item)
            out.append(item)
            ci += 1
            if next_shared is not None and next_shared == item:
                next_shared = next(shared, None)
    return out


def _reorder(tree: Any, live: Any, config: Any, maps: ListMaps, path: Path) -> None:
    """Put every list-type map of the merged `tree` in merge_order, in place."""
    if not isinstance(tree, dict):
        return
    live_d = live if isinstance(live, dict) else {}
    config_d = config if isinstance(config, dict) else {}
    if path and _is_list_map(maps, path):
        order = [k for k in merge_order(list(live_d), list(config_d)) if k in tree]
        order += [k for k in tree if k not in order]
        items = {k: tree[k] for k in order}
        tree.clear()
        tree.update(items)
    for key, sub in tree.items():
        _reorder(sub, live_d.get(key), config_d.get(key), maps, (*path, key))


def _is_list_map(maps: ListMaps, path: Path) -> bool:
    return _map_keys(maps, tuple("*" if p.startswith("k:{") else p for p in path)) is not None


def from_tree(tree: Any, maps: ListMaps | None, path: tuple[str, ...] = ()) -> Any:
    """Inverse of to_tree; an item's key fields are restored from its key."""
    if not isinstance(tree, dict):
        return tree
    keys = _map_keys(maps, path) if maps else None
    if keys is not None:
        items = []
        for name, item in tree.items():
            restored = from_tree(item, maps, (*path, "*"))
            if isinstance(restored, dict) and name.startswith("k:{"):
                for k, v in json.loads(name[2:]).items():
                    restored.setdefault(k, v)
            items.append(restored)
        return items
    return {k: from_tree(v, maps, (*path, k)) for k, v in tree.items()}


# ---------------------------------------------------------------- merge patch


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON Merge Patch."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result: JSON = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# ----------------------------------------------------------------- JSON patch


def _pointer(path: str) -> list[str]:
    if path == "":
        return []
    if not path.startswith("/"):
        raise PatchError(f"JSON pointer {path!r} must start with '/'")
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve_parent(doc: Any, parts: list[str], path: str) -> tuple[Any, str]:
    cur = doc
    for part in parts[:-1]:
        if isinstance(cur, dict):
            if part not in cur:
                raise PatchError(f"path {path!r}: {part!r} not found")
            cur = cur[part]
        elif isinstance(cur, list):
            try:
                cur = cur[int(part)]
            except (ValueError, IndexError) as e:
                raise PatchError(f"path {path!r}: bad index {part!r}") from e
        else:
            raise PatchError(f"path {path!r}: cannot descend into a scalar")
    return cur, parts[-1]


def _get(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        return doc
    parent, last = _resolve_parent(doc, parts, path)
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {path!r} not found")
        return parent[last]
    if isinstance(parent, list):
        try:
            return parent[int(last)]
        except (ValueError, IndexError) as e:
            raise PatchError(f"path {path!r}: bad index {last!r}") from e
    raise PatchError(f"path {path!r}: not a container")


def _add(doc: Any, path: str, value: Any) -> Any:
    parts = _pointer(path)
    if not parts:
        return value
    parent, last = _resolve_parent(doc, parts, path)
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        if last == "-":
            parent.append(value)
        else:
            try:
                idx = int(last)
            except ValueError as e:
                raise PatchError(f"path {path!r}: bad index {last!r}") from e
            if idx < 0 or idx > len(parent):
                raise PatchError(f"path {path!r}: index {idx} out of range")
            parent.insert(idx, value)
    else:
        raise PatchError(f"path {path!r}: not a container")
    return doc


def _remove(doc: Any, path: str) -> Any:
    parts = _pointer(path)
    if not parts:
        raise PatchError("cannot remove the whole document")
    parent, last = _resolve_parent(doc, parts, path)
    if isinstance(parent, dict):
        if last not in parent:
            raise PatchError(f"path {path!r} not found, cannot remove")
        del parent[last]
    elif isinstance(parent, list):
        try:
            del parent[int(last)]
        except (ValueError, IndexError) as e:
            raise PatchError(f"path {path!r}: bad index {last!r}") from e
    else:
        raise PatchError(f"path {path!r}: not a container")
    return doc


def json_patch(doc: Any, ops: Any) -> Any:
    """RFC 6902 JSON Patch; the whole patch fails if any operation fails."""
    if not isinstance(ops, list):
        raise PatchError("a JSON patch must be a list of operations")
    result = copy.deepcopy(doc)
    for i, op in enumerate(ops):
        if not isinstance(op, dict) or "op" not in op or "path" not in op:
            raise PatchError(f"operation {i}: needs 'op' and 'path'")
        kind, path = op["op"], op["path"]
        if kind in ("add", "replace", "test") and "value" not in op:
            raise PatchError(f"operation {i} ({kind}): missing 'value'")
        if kind == "add":
            result = _add(result, path, copy.deepcopy(op["value"]))
        elif kind == "remove":
            result = _remove(result, path)
        elif kind == "replace":
            _get(result, path)
            result = _add(_remove(result, path), path, copy.deepcopy(op["value"])) \
                if _pointer(path) else copy.deepcopy(op["value"])
        elif kind in ("move", "copy"):
            if "from" not in op:
                raise PatchError(f"operation {i} ({kind}): missing 'from'")
            value = copy.deepcopy(_get(result, op["from"]))
            if kind == "move":
                result = _remove(result, op["from"])
            result = _add(result, path, value)
        elif kind == "test":
            if _get(result, path) != op["value"]:
                raise PatchError(f"operation {i}: test failed at {path!r}")
        else:
            raise PatchError(f"operation {i}: unknown op {kind!r}")
    return result


# ------------------------------------------------------ strategic merge patch

_MERGE_KEYS: dict[str, str] = {
    "containers": "name", "initContainers": "name", "ephemeralContainers": "name",
    "conditions": "type", "env": "name", "volumes": "name", "volumeMounts": "mountPath",
    "ownerReferences": "uid", "imagePullSecrets": "name", "hostAliases": "ip",
}
_MERGE_PRIMITIVES = {"finalizers"}


def _merge_key(field: str, items: list[Any]) -> str | None:
    if field == "ports":
        sample = next((i for i in items if isinstance(i, dict)), {})
        return "containerPort" if "containerPort" in sample else "port"
    return _MERGE_KEYS.get(field)


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch for built-in kinds (see module docstring)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    if patch.get("$patch") == "replace":
        return {k: copy.deepcopy(v) for k, v in patch.items() if k != "$patch"}
    result: JSON = copy.deepcopy(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue  # $setElementOrder/..., $retainKeys, $deleteFromPrimitiveList/...
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and isinstance(result.get(key), list):
            result[key] = _merge_list(key, result[key], value)
        elif isinstance(value, dict):
            result[key] = strategic_merge_patch(result.get(key), value)
        else:
            result[key] = copy.deepcopy(value)
    return result


def _merge_list(field: str, current: list[Any], patch: list[Any]) -> list[Any]:
    if field in _MERGE_PRIMITIVES:
        out = list(current)
        out.extend(v for v in patch if v not in out)
        return out
    mkey = _merge_key(field, current + patch)
    if mkey is None or not all(isinstance(i, dict) for i in patch):
        return [i for i in copy.deepcopy(patch) if not (isinstance(i, dict) and "$patch" in i)]
    out = copy.deepcopy(current)
    for item in patch:
        if item.get("$patch") == "replace":
            return [i for i in copy.deepcopy(patch) if i.get("$patch") != "replace"]
        idx = next((n for n, c in enumerate(out)
                    if isinstance(c, dict) and c.get(mkey) == item.get(mkey)), None)
        if item.get("$patch") == "delete":
            if idx is not None:
                del out[idx]
        elif idx is None:
            out.append(copy.deepcopy(item))
        else:
            out[idx] = strategic_merge_patch(out[idx], item)
    return out


# ---------------------------------------------------------- server-side apply

# metadata fields a manager can own; the rest is identity or system-set.
_OWNABLE_METADATA = {"labels", "annotations", "ownerReferences", "finalizers"}


def leaf_paths(obj: Mapping[str, Any], prefix: Path = ()) -> set[Path]:
    """Every owned field of `obj`: map keys down to a scalar, a list or an empty map."""
    out: set[Path] = set()
    for key, value in obj.items():
        path = (*prefix, key)
        if not prefix and key in ("apiVersion", "kind"):
            continue
        if prefix == ("metadata",) and key not in _OWNABLE_METADATA:
            continue
        if isinstance(value, dict) and value:
            out |= leaf_paths(value, path)
        else:
            out.add(path)
    return out


def get_path(obj: Any, path: Path) -> tuple[bool, Any]:
    cur = obj
    for part in path:
        if not isinstance(cur, dict) or part not in cur:
            return False, None
        cur = cur[part]
    return True, cur


def set_path(obj: JSON, path: Path, value: Any) -> None:
    cur = obj
    for part in path[:-1]:
        nxt = cur.get(part)
        if not isinstance(nxt, dict):
            nxt = {}
            cur[part] = nxt
        cur = nxt
    cur[path[-1]] = copy.deepcopy(value)


def delete_path(obj: JSON, path: Path) -> None:
    """Remove `path` and every map left empty by the removal (below the top level)."""
    chain: list[JSON] = [obj]
    cur: Any = obj
    for part in path[:-1]:
        if not isinstance(cur, dict) or not isinstance(cur.get(part), dict):
            return
        cur = cur[part]
        chain.append(cur)
    cur.pop(path[-1], None)
    for depth in range(len(chain) - 1, 1, -1):
        if not chain[depth]:
            chain[depth - 1].pop(path[depth - 1], None)


def fields_v1(paths: Iterable[Path]) -> JSON:
    """Render owned paths in the managedFields `FieldsV1` shape (`{"f:spec": {...}}`)."""
    root: JSON = {}
    for path in sorted(paths):
        cur = root
        for part in path:
            name = part if part == "." or part.startswith("k:{") else f"f:{part}"
            cur = cur.setdefault(name, {})
    return root


def parse_fields_v1(fields: Any, prefix: Path = (), items: bool = False) -> set[Path]:
    """Inverse of fields_v1 for the `f:` entries, and the list-map `k:` ones when
    `items` (kinds with list-type maps); `v:` set entries are skipped."""
    out: set[Path] = set()
    if not isinstance(fields, dict):
        return out
    for key, sub in fields.items():
        if key == "." and prefix:
            out.add((*prefix, "."))
            continue
        if key.startswith("f:"):
            path = (*prefix, key[2:])
        elif items and key.startswith("k:{"):
            path = (*prefix, key)
        else:
            continue
        children = parse_fields_v1(sub, path, items)
        out |= children or {path}
    return out


def parse_managed_fields(entries: Any, items: bool = False) -> dict[ManagerKey, set[Path]]:
    """metadata.managedFields as a client sent it -> ownership (client-driven reset)."""
    owners: dict[ManagerKey, set[Path]] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not entry.get("manager"):
            continue
        key = (str(entry["manager"]), str(entry.get("operation") or "Update"),
               str(entry.get("subresource") or ""))
        owners[key] = owners.get(key, set()) | parse_fields_v1(entry.get("fieldsV1"),
                                                               items=items)
    return {k: v for k, v in owners.items() if v}


Managers = dict[ManagerKey, set[Path]]


def restrict(obj: JSON, subresource: str, has_status: bool) -> JSON:
    """The part of an applied/updated object a request may touch."""
    out = copy.deepcopy(obj)
    if subresource == "status":
        return {k: v for k, v in out.items() if k in ("apiVersion", "kind", "metadata", "status")}
    if has_status:
        out.pop("status", None)
    return out


def server_side_apply(
    current: JSON | None,
    applied: JSON,
    managers: Managers,
    manager: str,
    force: bool,
    subresource: str = "",
    list_maps: ListMaps | None = None,
) -> tuple[JSON, Managers]:
    """Merge an apply configuration into `current`; return (object, new ownership).

    `applied` must already be restricted to what the endpoint may change.
    Raises ApplyConflict when another manager owns a field this apply changes,
    DuplicateKey for an applied list-type map with a key twice.
    """
    if list_maps:
        live = to_tree(current, list_maps) if current is not None else None
        config = to_tree(applied, list_maps)
        tree, owners = _ssa(live, config, managers, manager, force, subresource, list_maps)
        _reorder(tree, live, config, list_maps, ())
        return from_tree(tree, list_maps), owners
    return _ssa(current, applied, managers, manager, force, subresource)


def _ssa(current: JSON | None, applied: JSON, managers: Managers, manager: str, force: bool,
         subresource: str, list_maps: ListMaps | None = None) -> tuple[JSON, Managers]:
    me: ManagerKey = (manager, "Apply", subresource)
    scope = ("status",) if subresource == "status" else None
    base: JSON = copy.deepcopy(current) if current is not None else {
        k: copy.deepcopy(v) for k, v in applied.items() if k in ("apiVersion", "kind")
    }
    new_paths = {p for p in leaf_paths(applied) if scope is None or p[:1] == scope}
    # An empty list-type map owns nothing: the items other managers own stay (it
    # only brings the field into being when it is absent).
    empty_maps = {p for p in new_paths if list_maps and _is_list_map(list_maps, p)}
    new_paths -= empty_maps
    owners: Managers = {k: set(v) for k, v in managers.items()}
    # a list-map item the apply names is owned as such (".") besides its fields
    marks = {(*p[:i + 1], ".") for p in new_paths if list_maps
             for i, part in enumerate(p) if part.startswith("k:{")}

    conflicts: list[tuple[str, Path]] = []
    for path in sorted(new_paths):
        found, cur_val = get_path(base, path)
        _, new_val = get_path(applied, path)
        if not found or contained(new_val, cur_val):
            continue
        for key, owned in owners.items():
            if key != me and _overlaps(path, owned):
                conflicts.append((key[0], path))
    if conflicts and not force:
        raise ApplyConflict(conflicts)
    if force:  # only the conflicting fields change hands; equal values stay shared
        taken = {p for _, p in conflicts}
        for key, owned in owners.items():
            if key != me:
                owned -= {p for p in owned if any(_related(p, q) for q in taken)}

    result = base
    for path in owners.get(me, set()) - new_paths - marks:
        if path[-1] == ".":
            continue
        if not any(key != me and _overlaps(path, owned) for key, owned in owners.items()):
            delete_path(result, path)
    for path in new_paths:
        _, value = get_path(applied, path)
        set_path(result, path, value)
    for path in empty_maps:
        if not get_path(result, path)[0]:
            set_path(result, path, {})
    owners[me] = new_paths | marks
    return result, {k: v for k, v in owners.items() if v}


def contained(applied: Any, current: Any) -> bool:
    """True when `current` is `applied` plus server-filled defaults (no real change)."""
    if isinstance(applied, dict) and isinstance(current, dict):
        return all(k in current and contained(v, current[k]) for k, v in applied.items())
    if isinstance(applied, list) and isinstance(current, list):
        return len(applied) == len(current) and all(
            contained(a, c) for a, c in zip(applied, current, strict=True))
    return bool(applied == current)


def _related(a: Path, b: Path) -> bool:
    n = min(len(a), len(b))
    return a[:n] == b[:n]


def _overlaps(path: Path, owned: set[Path]) -> bool:
    return any(_related(path, q) for q in owned)


def record_update(
    old: JSON | None, new: JSON, managers: Managers, manager: str, subresource: str = "",
    custom: bool = False, list_maps: ListMaps | None = None,
) -> Managers:
    """Ownership after a create/update/patch by `manager`: it takes every field it changed.

    A map the update brought into being is owned as a whole too ("." in FieldsV1),
    which keeps the manager listed after it loses the map's fields, as upstream.
    Upstream decides by schema which maps get "."; here: every map of a custom
    resource, and labels/annotations of any kind (the built-ins' other maps are
    mostly plain structs, which get none).
    """
    if list_maps:
        old = to_tree(old, list_maps, strict=False) if old is not None else None
        new = to_tree(new, list_maps, strict=False)
    owners: Managers = {k: set(v) for k, v in managers.items()}
    new_leaves = leaf_paths(new)
    old_leaves = leaf_paths(old) if old is not None else set()
    changed = {p for p in new_leaves
               if p not in old_leaves or get_path(old, p)[1] != get_path(new, p)[1]}
    changed |= {(*q, ".") for p in changed for q in (p[:i] for i in range(1, len(p)))
                if q != ("metadata",) and isinstance(get_path(new, q)[1], dict)
                and not get_path(old, q)[0]
                and (custom or q in (("metadata", "labels"), ("metadata", "annotations")))}
    if subresource != "status":
        changed = {p for p in changed if p[:1] != ("status",)}
    else:
        changed = {p for p in changed if p[:1] == ("status",)}
    gone = old_leaves - new_leaves
    for key in owners:
        owners[key] = {p for p in owners[key]
                       if p not in gone and not any(_related(p, c) for c in changed)
                       and (p[-1] != "." or isinstance(get_path(new, p[:-1])[1], dict))}
    if changed:
        me: ManagerKey = (manager, "Update", subresource)
        owners[me] = owners.get(me, set()) | changed
    return {k: v for k, v in owners.items() if v}
