"""The object store: etcd plus the apiserver's registry logic, in memory.

TEST STAND-IN, never product code. What it imitates and how:

- One global, monotonically increasing resourceVersion, as etcd's revision:
  every effective write gets the next number, across all kinds. A write that
  changes nothing (same object, same field ownership) is skipped and keeps
  the old resourceVersion, as the real storage layer's no-op update check
  does; so it emits no watch event.
- Lists are complete unless `limit` asks for pages; a `continue` token
  lists the rest as of the first page's version (rebuilt from history).
- Event history for watch resumption, bounded (`history_limit`) and
  compactable (`compact()`), like etcd compaction plus the watch cache: a
  watch from a resourceVersion older than the oldest kept event gets a
  single ERROR event with a 410 `Expired` Status ("too old resource
  version"), which is what a client sees from a real server.
- Watch semantics of the real watch cache: no resourceVersion or "0" first
  sends a synthetic ADDED for every current object; a MODIFIED that moves an
  object into a watcher's selector is sent as ADDED and one that moves it out
  as DELETED.
- Registry behaviour: uid/creationTimestamp/generation, `generateName`,
  optimistic concurrency on update (409), status subresource split, Service
  clusterIP allocation and defaults, finalizers (delete sets
  deletionTimestamp; the object goes when the last finalizer is removed),
  namespace deletion removing its contents, and ownerReference garbage
  collection as kube-controller-manager's garbage collector does (dependents
  whose owners are all gone are deleted, also when they are written after
  the owner went, e.g. a late apply referencing a deleted Service's uid;
  `propagationPolicy=Orphan` strips the reference instead). GC runs right
  after the owner's deletion, as its own writes (their own
  resourceVersions), before the DELETE returns: faster than a real
  cluster, where it is asynchronous.
- managedFields for server-side apply (see patching.py); for kinds a CRD
  defines, lists of `x-kubernetes-list-type: map` merge item by item.
- CustomResourceDefinitions (crds.py): storing one makes its kind served
  (discovery, REST, Tables), with defaulting, pruning and validation by its
  structural schema and CEL rules (structural.py, cel.py); deleting it
  deletes its custom resources.
- Unknown fields (not in the kind's schema) are dropped with a warning, or
  refused with 400 under `fieldValidation=Strict`, as upstream decoding and
  structural-schema pruning do.
- `dryRun=All`: the request is defaulted, validated and answered, nothing
  is stored, no resourceVersion is taken, no event is sent.

Concurrency: everything here is synchronous and runs on the server's event
loop thread, so each operation is atomic with respect to the others; the
only asynchronous part is the per-watcher queue the HTTP layer drains.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import datetime
import ipaddress
import itertools
import json
import secrets
import uuid
from collections import Counter, deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import crds, events, patching, selectors, structural, validation
from . import resources as rt
from .errors import ApiError, already_exists, bad_request, conflict, not_found
from .resources import ResourceType

JSON = dict[str, Any]
ObjKey = tuple[str, str]  # (namespace or "", name)

FieldPaths = list[tuple[str, ...]]  # (a module alias: Store.list shadows the builtin)
Causes = list[validation.Cause]
WATCH_CLOSE = "CLOSE"  # sentinel event types on a watcher queue
WATCH_ABORT = "ABORT"


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


@dataclass
class Entry:
    obj: JSON  # without metadata.managedFields
    managers: patching.Managers = field(default_factory=dict)
    manager_times: dict[patching.ManagerKey, str] = field(default_factory=dict)


@dataclass(frozen=True)
class HistoryEvent:
    rv: int
    type_key: str
    namespace: str
    kind: str  # ADDED | MODIFIED | DELETED
    old: JSON | None
    new: JSON


@dataclass(frozen=True)
class ListPage:
    items: list[JSON]
    resource_version: str
    continue_token: str | None = None
    remaining: int | None = None


def _parse_rv(text: str | None) -> int:
    try:
        return int(text or "")
    except ValueError as e:
        raise bad_request(f"invalid resourceVersion {text!r}") from e


def _encode_continue(rv: int, last: ObjKey) -> str:
    raw = json.dumps({"rv": rv, "start": list(last)}).encode()
    return base64.urlsafe_b64encode(raw).decode()


def _decode_continue(token: str) -> tuple[int, ObjKey]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token.encode()))
        return int(data["rv"]), (str(data["start"][0]), str(data["start"][1]))
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise bad_request("continue key is not valid: " + str(e)) from e


@dataclass(eq=False)
class Watcher:
    """One open watch: its filter and the queue of events still to send."""

    t: ResourceType
    namespace: str | None
    labels: tuple[selectors.Requirement, ...]
    fields: tuple[selectors.FieldRequirement, ...]
    queue: asyncio.Queue[tuple[str, JSON]] = field(default_factory=asyncio.Queue)
    last_rv: int = 0

    def matches(self, obj: Mapping[str, Any] | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata") or {}
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return (selectors.labels_match(self.labels, meta.get("labels"))
                and selectors.fields_match(self.fields, obj))

    def translate(self, ev: HistoryEvent) -> tuple[str, JSON] | None:
        """The event this watcher should see for `ev`, if any (selector moves)."""
        old_in, new_in = self.matches(ev.old), self.matches(ev.new)
        if ev.kind == "ADDED":
            return ("ADDED", ev.new) if new_in else None
        if ev.kind == "DELETED":
            return ("DELETED", ev.new) if new_in or old_in else None
        if old_in and new_in:
            return ("MODIFIED", ev.new)
        if new_in:
            return ("ADDED", ev.new)
        if old_in:
            return ("DELETED", ev.new)
        return None


_SPEC_IGNORED = ("metadata", "status", "apiVersion", "kind")


class Store:
    """All objects of all kinds; see the module docstring for the rules."""

    def __init__(self, history_limit: int = 100_000,
                 clock: Callable[[], str] = now_rfc3339,
                 crds: Iterable[JSON] = ()) -> None:
        """`crds`: CustomResourceDefinitions stored at start (as a cluster that has
        them installed), after the namespaces default and kube-system."""
        self.rv = 1
        self.types = rt.TypeRegistry()
        self._crd_keys: dict[str, str] = {}  # CRD name -> the type key it serves
        self.history: deque[HistoryEvent] = deque()
        self.history_limit = history_limit
        self.compacted_rv = 0  # watches from an rv below this get 410
        self.objects: dict[str, dict[ObjKey, Entry]] = {t.key: {} for t in rt.ALL_TYPES}
        self.watchers: set[Watcher] = set()
        self.changes: Counter[tuple[str, str]] = Counter()  # (plural, ADDED|MODIFIED|DELETED)
        self.clock = clock
        self.dry_run = False  # set around one request by the API layer (`?dryRun=All`)
        self.field_validation = "Warn"  # per request too: Ignore | Warn | Strict
        self.warnings: list[str] = []  # collected during one request, sent as Warning headers
        self.uids: set[str] = set()  # of stored objects, for garbage collection
        # Objects written with owners that no longer exist are collected too (the
        # garbage collector verifies owners by uid); tests may switch this off.
        self.gc_dangling = True
        self._cluster_ips = (str(ipaddress.ip_address("10.96.0.10") + i)
                             for i in itertools.count())
        for ns in ("default", "kube-system"):
            self.create(rt.NAMESPACE, None, {"metadata": {"name": ns}}, "sandbox")
        for crd in crds:
            self.create(rt.CRD, None, crd, "sandbox")

    # ------------------------------------------------------------ reading

    def render(self, entry: Entry) -> JSON:
        out = copy.deepcopy(entry.obj)
        if entry.managers:
            meta = out.setdefault("metadata", {})
            meta["managedFields"] = [
                {"manager": key[0], "operation": key[1], "apiVersion": out.get("apiVersion", ""),
                 "time": entry.manager_times.get(key, ""), "fieldsType": "FieldsV1",
                 "fieldsV1": patching.fields_v1(paths),
                 **({"subresource": key[2]} if key[2] else {})}
                for key, paths in sorted(entry.managers.items())
            ]
        return out

    def _entry(self, t: ResourceType, ns: str | None, name: str) -> Entry:
        entry = self.objects[t.key].get((ns or "", name))
        if entry is None:
            raise not_found(t.qualified, name, t.group, t.plural)
        return entry

    def get(self, t: ResourceType, ns: str | None, name: str) -> JSON:
        return self.render(self._entry(t, ns, name))

    def list(self, t: ResourceType, ns: str | None, label_selector: str | None = None,
             field_selector: str | None = None) -> tuple[list[JSON], str]:
        """Every matching object now, and the current resourceVersion."""
        page = self.list_page(t, ns, label_selector, field_selector)
        return page.items, page.resource_version

    def list_page(self, t: ResourceType, ns: str | None, label_selector: str | None = None,
                  field_selector: str | None = None, resource_version: str | None = None,
                  match: str | None = None, limit: int | None = None,
                  continue_token: str | None = None) -> ListPage:
        """A list as the apiserver serves it (API concepts, "Retrieving large results").

        `limit` cuts the list into pages; the `continue` token of a page lists the
        rest *as of the first page's resourceVersion* (a consistent snapshot, rebuilt
        from the watch history; 410 once that history is compacted away).
        `resourceVersionMatch=Exact` lists at exactly `resource_version`.
        """
        w = self._filter(t, ns, label_selector, field_selector)
        after: ObjKey | None = None
        entries = self.objects[t.key]
        state: Mapping[ObjKey, Entry | JSON]
        if continue_token:
            at, after = _decode_continue(continue_token)
            state = self._state_at(t, at, continued=True)
        elif match == "Exact" and resource_version not in (None, "", "0"):
            at = _parse_rv(resource_version)
            state = self._state_at(t, at)
        elif match not in (None, "", "NotOlderThan", "Exact"):
            raise bad_request(f'resourceVersionMatch: Unsupported value: "{match}"')
        else:  # now: match on stored objects, render only what is returned
            at = self.rv
            state = entries

        def obj(v: Entry | JSON) -> JSON:
            return v.obj if isinstance(v, Entry) else v

        # As etcd serves it: the key range after the continue key, read in key order and
        # filtered until the page is full (one more match says there is a rest). The
        # apiserver counts what is left (remainingItemCount) only for a list without
        # selectors, where etcd's count of the range is exact; with a selector it leaves
        # the count out. Filtering the whole kind for every page made a 10,000-VMI list in
        # 20 pages cost the double 20 full scans (tests/bench ``host``, issue 27).
        keys = sorted(k for k in state if after is None or k > after)
        paged = limit is not None and limit > 0
        page: list[ObjKey] = []
        more = False
        for k in keys:
            if not w.matches(obj(state[k])):
                continue
            if paged and len(page) == limit:
                more = True
                break
            page.append(k)
        token = _encode_continue(at, page[-1]) if more and page else None
        remaining = None
        if token is not None and not (w.labels or w.fields):
            remaining = sum(1 for k in keys if k > page[-1] and w.matches(obj(state[k])))
        items = [self.render(v) if isinstance(v, Entry) else v
                 for v in (state[k] for k in page)]
        return ListPage(items, str(at), token, remaining)

    def _state_at(self, t: ResourceType, at: int,
                  continued: bool = False) -> dict[ObjKey, Entry | JSON]:
        """Objects of kind `t` as they were at resourceVersion `at` (history rolled back):
        an `Entry` where the object is unchanged since, else the object as it was."""
        if at < self.compacted_rv:
            if continued:
                raise ApiError(410, "Expired", "The provided continue parameter is too old to "
                               "display a consistent list result. You can start a new list "
                               "without the continue parameter.")
            raise ApiError(410, "Expired", f"too old resource version: {at} "
                           f"({self.compacted_rv})")
        # Current objects stay entries (rendered only if they end up on the page): a
        # deep copy of every object per page made paging a 10,000-object list take
        # seconds, where the real apiserver reads one page from etcd.
        state: dict[ObjKey, Entry | JSON] = dict(self.objects[t.key])
        for ev in reversed(self.history):
            if ev.rv <= at:
                break
            if ev.type_key != t.key:
                continue
            key = (ev.namespace, ev.new["metadata"]["name"])
            if ev.kind == "ADDED":
                state.pop(key, None)
            elif ev.old is not None:
                state[key] = ev.old
        return state

    def _filter(self, t: ResourceType, ns: str | None, label_selector: str | None,
                field_selector: str | None) -> Watcher:
        try:
            labels = selectors.parse_label_selector(label_selector)
            fields = selectors.parse_field_selector(field_selector, t.kind)
        except selectors.SelectorError as e:
            raise bad_request(str(e)) from e
        return Watcher(t, ns, labels, fields)

    def exists_uid(self, uid: str) -> bool:
        return uid in self.uids

    # ------------------------------------------------------------- watching

    def watch(self, t: ResourceType, ns: str | None, label_selector: str | None,
              field_selector: str | None, resource_version: str | None) -> Watcher:
        """Register a watcher with its backlog already queued.

        Raises ApiError(410) when `resource_version` is older than the kept history.
        """
        w = self._filter(t, ns, label_selector, field_selector)
        if resource_version in (None, "", "0"):
            for _, entry in sorted(self.objects[t.key].items()):
                if w.matches(entry.obj):
                    w.queue.put_nowait(("ADDED", self.render(entry)))
        else:
            since = _parse_rv(resource_version)
            if since < self.compacted_rv:
                raise ApiError(410, "Expired",
                               f"too old resource version: {since} ({self.compacted_rv})")
            for ev in self.history:
                if ev.rv > since and ev.type_key == t.key:
                    out = w.translate(ev)
                    if out is not None:
                        w.queue.put_nowait(out)
        w.last_rv = self.rv
        self.watchers.add(w)
        return w

    def unwatch(self, w: Watcher) -> None:
        self.watchers.discard(w)

    def close_watches(self, abort: bool = False) -> int:
        """End every open watch (clean end of stream, or a connection reset)."""
        n = len(self.watchers)
        for w in list(self.watchers):
            w.queue.put_nowait((WATCH_ABORT if abort else WATCH_CLOSE, {}))
        self.watchers.clear()
        return n

    def compact(self) -> int:
        """Forget all history: a watch resuming from any older resourceVersion gets 410."""
        self.history.clear()
        self.compacted_rv = self.rv
        return self.rv

    def _publish(self, t: ResourceType, kind: str, old: JSON | None, new: JSON) -> None:
        ev = HistoryEvent(self.rv, t.key, new["metadata"].get("namespace", ""), kind, old, new)
        self.history.append(ev)
        while len(self.history) > self.history_limit:
            self.compacted_rv = self.history.popleft().rv
        self.changes[(t.plural, kind)] += 1
        for w in self.watchers:
            if w.t.key == t.key:
                out = w.translate(ev)
                if out is not None:
                    w.queue.put_nowait(out)

    # -------------------------------------------------------------- writing

    def _check_namespace(self, t: ResourceType, ns: str | None) -> str:
        if not t.namespaced:
            return ""
        if not ns:
            raise bad_request("the namespace of the provided object does not match the "
                              "namespace sent on the request")
        if ("", ns) not in self.objects[rt.NAMESPACE.key]:
            raise not_found("namespaces", ns, "", "namespaces")
        return ns

    def _body_identity(self, t: ResourceType, ns: str | None, body: Any,
                       name: str | None = None) -> JSON:
        if not isinstance(body, dict):
            raise bad_request("the body of the request must be a JSON object")
        obj = copy.deepcopy(body)
        if obj.get("apiVersion", t.api_version) != t.api_version or \
                obj.get("kind", t.kind) != t.kind:
            raise bad_request(
                f"the API version in the data ({obj.get('apiVersion')}) / kind "
                f"({obj.get('kind')}) does not match the expected {t.api_version} {t.kind}")
        obj["apiVersion"], obj["kind"] = t.api_version, t.kind
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise bad_request("metadata must be an object")
        if t.namespaced:
            if meta.get("namespace") not in (None, "", ns):
                raise bad_request("the namespace of the provided object does not match the "
                                  "namespace sent on the request")
            meta["namespace"] = ns
        else:
            meta.pop("namespace", None)
        if name is not None and meta.get("name") not in (None, name):
            raise bad_request(f"the name of the object ({meta.get('name')}) does not match the "
                              f"name on the URL ({name})")
        if name is not None:
            meta["name"] = name
        meta.pop("managedFields", None)
        return obj

    def _decode(self, t: ResourceType, obj: JSON) -> None:
        """Errors the request body's decoding finds upstream (400)."""
        if t is rt.EVENT_V1 and (err := events.decode_error(obj)) is not None:
            raise bad_request(f'{t.kind} in version "{t.version}" cannot be handled as a '
                              f"{t.kind}: {err}")

    def create(self, t: ResourceType, ns: str | None, body: Any, manager: str,
               keep_status: bool = False) -> JSON:
        ns = self._check_namespace(t, ns)
        obj = self._body_identity(t, ns, body)
        self._decode(t, obj)
        meta = obj["metadata"]
        if not meta.get("name") and meta.get("generateName"):
            meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
        if t.has_status and not keep_status:
            obj.pop("status", None)
        name = meta.get("name") or ""
        if (ns, name) in self.objects[t.key]:
            raise already_exists(t.qualified, name, t.group, t.plural)
        for volatile in ("resourceVersion", "uid", "creationTimestamp", "deletionTimestamp",
                         "generation", "selfLink"):
            meta.pop(volatile, None)
        _decode_defaults(t, obj)
        managers = patching.record_update(None, obj, {}, manager, custom=t.custom,
                                          list_maps=_list_maps(t))
        return self._commit(t, None, obj, managers, manager)

    def put(self, obj: JSON) -> JSON:
        """Create or replace an object as a controller would, status included (no HTTP)."""
        if not isinstance(obj, dict) or not isinstance(obj.get("metadata"), dict):
            raise bad_request("an object with apiVersion, kind and metadata is needed")
        t = self.types.find_kind(obj.get("apiVersion", ""), obj.get("kind", ""))
        if t is None:
            raise bad_request(f"unknown kind {obj.get('apiVersion')}/{obj.get('kind')}")
        ns = ((obj.get("metadata") or {}).get("namespace") or "default") if t.namespaced \
            else None
        name = (obj.get("metadata") or {}).get("name", "")
        if (ns or "", name) in self.objects[t.key]:
            cur = self.get(t, ns, name)
            body = copy.deepcopy(obj)
            body["metadata"]["resourceVersion"] = cur["metadata"]["resourceVersion"]
            self.update(t, ns, name, body, "sandbox")
            if t.has_status and "status" in obj:
                return self.update(t, ns, name, body, "sandbox", subresource="status")
            return self.get(t, ns, name)
        return self.create(t, ns, obj, "sandbox", keep_status=True)

    def update(self, t: ResourceType, ns: str | None, name: str, body: Any, manager: str,
               subresource: str = "") -> JSON:
        entry = self._entry(t, ns, name)
        base = self._client_managed_fields(t, entry, body)
        obj = self._body_identity(t, ns, body, name)
        self._decode(t, obj)
        want_rv = obj["metadata"].get("resourceVersion")
        have_rv = entry.obj["metadata"]["resourceVersion"]
        if want_rv not in (None, "") and want_rv != have_rv:
            raise conflict(t.qualified, name, "the object has been modified; please apply your "
                           "changes to the latest version and try again", t.group, t.plural)
        new = self._merge_subresource(t, entry.obj, obj, subresource)
        _decode_defaults(t, new)
        managers = patching.record_update(entry.obj, new, base, manager, subresource,
                                          custom=t.custom, list_maps=_list_maps(t))
        return self._commit(t, entry, new, managers, manager, subresource)

    def patch(self, t: ResourceType, ns: str | None, name: str, patch_type: str, body: Any,
              manager: str | None, force: bool = False, subresource: str = "") -> JSON:
        if patch_type == "apply":
            return self._apply(t, ns, name, body, manager, force, subresource)
        entry = self._entry(t, ns, name)
        current = self.render(entry)
        try:
            if patch_type == "merge":
                patched = patching.merge_patch(current, body)
            elif patch_type == "json":
                patched = patching.json_patch(current, body)
            elif patch_type == "strategic":
                if t.custom:
                    raise ApiError(415, "UnsupportedMediaType",
                                   "the body of the request was in an unknown format - accepted "
                                   "media types include: application/json-patch+json, "
                                   "application/merge-patch+json, application/apply-patch+yaml")
                patched = patching.strategic_merge_patch(current, body)
            else:
                raise bad_request(f"unknown patch type {patch_type!r}")
        except patching.PatchError as e:
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in "
                           f"our request: {e}") from e
        base = self._client_managed_fields(t, entry, patched)
        obj = self._body_identity(t, ns, patched, name)
        if t is rt.EVENT_V1 and (err := events.decode_error(obj)) is not None:
            shown = json.dumps(obj, separators=(",", ":"))
            raise ApiError(422, "Invalid", f'{t.qualified_kind} "{name}" is invalid: patch: '
                           f"Invalid value: {json.dumps(shown)}: {err}", {
                               "name": name, "group": t.group, "kind": t.kind, "causes": [
                                   {"reason": "FieldValueInvalid", "field": "patch",
                                    "message": f"Invalid value: {json.dumps(shown)}: {err}"}]})
        want_rv = obj["metadata"].get("resourceVersion")
        if want_rv not in (None, "") and want_rv != entry.obj["metadata"]["resourceVersion"]:
            raise conflict(t.qualified, name, "the object has been modified; please apply your "
                           "changes to the latest version and try again", t.group, t.plural)
        new = self._merge_subresource(t, entry.obj, obj, subresource)
        _decode_defaults(t, new)
        managers = patching.record_update(entry.obj, new, base, manager or "unknown",
                                          subresource, custom=t.custom, list_maps=_list_maps(t))
        return self._commit(t, entry, new, managers, manager or "unknown", subresource)

    def _client_managed_fields(self, t: ResourceType, entry: Entry,
                               body: Any) -> patching.Managers:
        """Ownership to start from: the client's managedFields if it changed them.

        As upstream: a request that sends managedFields different from the stored
        ones replaces them (kubectl does this when it migrates client-side apply
        ownership to server-side apply); an empty list clears them.
        """
        meta = body.get("metadata") if isinstance(body, dict) else None
        sent = meta.get("managedFields") if isinstance(meta, dict) else None
        if sent is None:
            return entry.managers
        stored = self.render(entry)["metadata"].get("managedFields")
        if sent == stored:
            return entry.managers
        return patching.parse_managed_fields(sent, items=t.crd is not None)

    def _apply(self, t: ResourceType, ns: str | None, name: str, body: Any,
               manager: str | None, force: bool, subresource: str) -> JSON:
        if not manager:
            raise ApiError(422, "Invalid", 'PatchOptions.meta.k8s.io "" is invalid: '
                           "fieldManager: Required value: is required for apply patch",
                           {"causes": [validation.required("fieldManager")]})
        if not isinstance(body, dict) or not body.get("apiVersion") or not body.get("kind"):
            raise bad_request("apply patches need apiVersion and kind")
        ns = self._check_namespace(t, ns)
        applied = self._body_identity(t, ns, body, name)
        want_rv = applied["metadata"].pop("resourceVersion", None)
        entry = self.objects[t.key].get((ns, name))
        if entry is not None and want_rv not in (None, "") and \
                want_rv != entry.obj["metadata"]["resourceVersion"]:
            # as upstream: a resourceVersion in an apply configuration is a precondition
            # on an existing object (and ignored when the apply creates it)
            raise conflict(t.qualified, name, "the object has been modified; please apply your "
                           "changes to the latest version and try again", t.group, t.plural)
        if entry is None and subresource:
            raise not_found(t.qualified, name, t.group, t.plural)
        applied = patching.restrict(applied, subresource, t.has_status)
        try:
            new, managers = patching.server_side_apply(
                entry.obj if entry else None, applied, entry.managers if entry else {},
                manager, force, subresource, list_maps=_list_maps(t))
        except patching.ApplyConflict as e:
            raise ApiError(409, "Conflict", str(e), {
                "name": name, "group": t.group, "kind": t.plural,
                "causes": [{"reason": "FieldManagerConflict",
                            "message": f'conflict with "{m}"', "field": patching.path_text(p)}
                           for m, p in e.conflicts]}) from e
        except patching.PatchError as e:
            raise ApiError(422, "Invalid", f"the server rejected our request due to an error in "
                           f"our request: {e}") from e
        new.setdefault("metadata", {}).update(name=name, **({"namespace": ns} if ns else {}))
        new["apiVersion"], new["kind"] = t.api_version, t.kind
        return self._commit(t, entry, new, managers, manager, subresource)

    def _merge_subresource(self, t: ResourceType, old: JSON, new: JSON, sub: str) -> JSON:
        """Apply the spec/status split: each endpoint keeps the other half from `old`."""
        if sub == "status":
            out = copy.deepcopy(old)
            if "status" in new:
                out["status"] = new["status"]
            else:
                out.pop("status", None)
            return out
        if t.has_status:
            new = copy.deepcopy(new)
            if "status" in old:
                new["status"] = copy.deepcopy(old["status"])
            else:
                new.pop("status", None)
        # system-owned metadata survives any update
        for keep in ("uid", "creationTimestamp", "deletionTimestamp", "generation"):
            if keep in old["metadata"]:
                new["metadata"][keep] = old["metadata"][keep]
            else:
                new["metadata"].pop(keep, None)
        return new

    def _default(self, t: ResourceType, obj: JSON, old: JSON | None) -> None:
        """Registry defaulting (PrepareForCreate/Update) for the kinds that need it."""
        if t.crd is not None:
            structural.prune_nulls_and_default(t.crd.schema, obj)
        elif t is rt.EVENT_V1:
            events.default(obj)
        elif t is rt.VAP:
            _default_policy(obj)
        elif t is rt.SERVICE:
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if spec["type"] != "ExternalName":
                old_spec = (old or {}).get("spec") or {}
                if not spec.get("clusterIP") and old_spec.get("clusterIP"):
                    spec["clusterIP"] = old_spec["clusterIP"]
                    spec["clusterIPs"] = old_spec.get("clusterIPs", [old_spec["clusterIP"]])
                if not spec.get("clusterIP"):
                    spec["clusterIP"] = next(self._cluster_ips)
                spec.setdefault("clusterIPs", [spec["clusterIP"]])
                if spec["clusterIP"] == "None" and not spec.get("selector"):
                    # headless + selectorless: dual-stack unless told otherwise (upstream)
                    spec.setdefault("ipFamilyPolicy", old_spec.get("ipFamilyPolicy",
                                                                   "RequireDualStack"))
                    fams = spec.setdefault("ipFamilies", ["IPv4"])
                    if len(fams) < 2 and spec["ipFamilyPolicy"] != "SingleStack":
                        spec["ipFamilies"] = [*fams, "IPv6" if fams[0] == "IPv4" else "IPv4"]
                spec.setdefault("ipFamilies", ["IPv4"])
                spec.setdefault("ipFamilyPolicy", old_spec.get("ipFamilyPolicy", "SingleStack"))
                spec.setdefault("internalTrafficPolicy", "Cluster")
            spec.setdefault("sessionAffinity", "None")
            for port in spec.get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")
                    if "port" in port:
                        port.setdefault("targetPort", port["port"])
            obj.setdefault("status", {"loadBalancer": {}})
        elif t is rt.ENDPOINTSLICE:
            for port in obj.get("ports") or []:
                if isinstance(port, dict):
                    port.setdefault("protocol", "TCP")
            for ep in obj.get("endpoints") or []:
                if isinstance(ep, dict):
                    ep.setdefault("conditions", {})  # a struct, never omitted upstream
        elif t is rt.NAMESPACE:
            obj["metadata"].setdefault("labels", {})["kubernetes.io/metadata.name"] = \
                obj["metadata"]["name"]
            obj.setdefault("spec", {"finalizers": ["kubernetes"]})
            obj.setdefault("status", {"phase": "Active"})
        elif t is rt.POD:
            obj.setdefault("status", {"phase": "Pending"})

    def _commit(self, t: ResourceType, entry: Entry | None, new: JSON,
                managers: patching.Managers, manager: str, subresource: str = "") -> JSON:
        """Default, validate, and store `new` unless it changes nothing."""
        old = entry.obj if entry else None
        meta = new["metadata"]
        name = meta.get("name") or ""
        undecodable = validation.decode_problem(t, new)
        if undecodable is not None:
            raise bad_request(undecodable)
        self._default(t, new, old)
        pruned = self._prune_unknown(t, new)
        if pruned:  # nobody owns a field that was never stored
            managers = {k: {p for p in v if not any(p[:len(q)] == q for q in pruned)}
                        for k, v in managers.items()}
            managers = {k: v for k, v in managers.items() if v}
        causes = self._validate(t, new, old, subresource)
        if causes:
            raise ApiError(422, "Invalid", validation.invalid_message(t, name, causes),
                           {"name": name, "group": t.group, "kind": t.kind, "causes": causes})
        if old is not None and entry is not None:
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
            if new == old and managers == entry.managers:
                return self.render(entry)  # no-op: no new resourceVersion, no event
            if _spec_of(new) != _spec_of(old):
                meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
        else:
            meta["uid"] = str(uuid.uuid4())
            meta["creationTimestamp"] = self.clock()
            meta["generation"] = 1
        if self.dry_run:  # validated and defaulted, as the real dry run; nothing stored
            if entry is None:
                meta.pop("resourceVersion", None)
            return self.render(Entry(new, managers, {k: self.clock() for k in managers}))
        times = dict(entry.manager_times) if entry else {}
        for key in managers:
            if key[0] == manager or entry is None or managers.get(key) != entry.managers.get(key):
                times[key] = self.clock()
        new_entry = Entry(new, managers, {k: v for k, v in times.items() if k in managers})
        ns = meta.get("namespace", "")
        if entry is not None and meta.get("deletionTimestamp") and not meta.get("finalizers"):
            # the last finalizer went: one DELETED event with this final state, as upstream
            self.objects[t.key][(ns, name)] = new_entry
            return self._remove(t, ns, name)
        self.rv += 1
        meta["resourceVersion"] = str(self.rv)
        self.objects[t.key][(ns, name)] = new_entry
        self.uids.add(meta["uid"])
        rendered = self.render(new_entry)
        old_rendered = self.render(entry) if entry else None
        self._publish(t, "MODIFIED" if entry else "ADDED", old_rendered, rendered)
        if self._dangling(meta):
            self.delete(t, ns or None, name)  # as the garbage collector would, shortly after
        elif t is rt.CRD:
            return self._crd_written(name)
        return rendered

    def _validate(self, t: ResourceType, new: JSON, old: JSON | None,
                  subresource: str = "") -> Causes:
        if t.crd is not None:  # a CRD-defined kind: its structural schema and CEL rules
            causes = validation.validate_metadata(t, new)
            causes.extend(structural.validate(t.crd.schema, new, old, subresource))
            return causes
        causes = validation.validate(t, new)
        if t is rt.CRD and not causes:
            causes = crds.check(new)
        elif t is rt.EVENT_V1:
            # the registry's own checks say what is required (the OpenAPI lists differ)
            causes = [c for c in causes if c["reason"] != "FieldValueRequired"]
            causes.extend(events.validate(new, old))
        return causes

    # ------------------------------------------------------------------ CRDs

    def _crd_written(self, name: str) -> JSON:
        """Serve the kind a stored CRD defines, and write the status its controllers
        would (a second write, as upstream); returns the CRD as stored now."""
        entry = self.objects[rt.CRD.key][("", name)]
        t = crds.resource_type(entry.obj)
        old_key = self._crd_keys.get(name)
        if old_key is not None and old_key != t.key:
            self._drop_kind(old_key)
        self.types.add(t)
        self._crd_keys[name] = t.key
        self.objects.setdefault(t.key, {})
        want = crds.accepted_status(entry.obj, self.clock())
        have = entry.obj.get("status") or {}

        def essence(st: Mapping[str, Any]) -> Any:
            conds = sorted((c.get("type"), c.get("status")) for c in st.get("conditions") or [])
            return conds, st.get("acceptedNames"), st.get("storedVersions")

        if essence(have) == essence(want) or self.dry_run:
            return self.render(entry)
        new = copy.deepcopy(entry.obj)
        new["status"] = want
        managers = patching.record_update(entry.obj, new, entry.managers, "kube-apiserver",
                                          "status")
        return self._commit(rt.CRD, entry, new, managers, "kube-apiserver", "status")

    def _drop_kind(self, key: str) -> None:
        """A CRD went (or changed its kind): its objects go, its watches end."""
        t = self.types.remove(key)
        if t is None:
            return
        for ns, obj_name in sorted(self.objects.get(key, {})):
            if (ns, obj_name) in self.objects[key]:
                self._remove(t, ns, obj_name)
        self.objects.pop(key, None)
        for w in [w for w in self.watchers if w.t.key == key]:
            w.queue.put_nowait((WATCH_CLOSE, {}))
            self.watchers.discard(w)

    def _dangling(self, meta: Mapping[str, Any]) -> bool:
        """Owned, and every owner (by uid) is gone: the garbage collector deletes it."""
        refs = meta.get("ownerReferences") or []
        uids = [r.get("uid") for r in refs if isinstance(r, Mapping)]
        return self.gc_dangling and bool(uids) and not any(u in self.uids for u in uids)

    def _prune_unknown(self, t: ResourceType, obj: JSON) -> FieldPaths:
        """Drop fields the schema does not declare, as decoding does upstream.

        `fieldValidation=Strict` (kubectl's default) refuses them with 400 instead;
        `Warn` (the server default) drops them with a warning; `Ignore` drops them.
        """
        unknown = structural.unknown_fields(t.crd.schema, obj) if t.crd is not None \
            else validation.unknown_fields(t, obj)
        if not unknown:
            return FieldPaths()
        named = [validation.field_path(p) for p in unknown]
        if self.field_validation == "Strict":
            listed = ", ".join(f'unknown field "{n}"' for n in named)
            raise bad_request(f'{t.kind} in version "{t.version}" cannot be handled as a '
                              f"{t.kind}: strict decoding error: {listed}")
        for path in unknown:
            _delete_any(obj, path)
        if self.field_validation == "Warn":
            self.warnings.extend(f'unknown field "{n}"' for n in named)
        return FieldPaths(tuple(map(str, p)) for p in unknown
                          if all(isinstance(x, str) for x in p))

    # ------------------------------------------------------------- deleting

    def delete(self, t: ResourceType, ns: str | None, name: str,
               propagation: str | None = None, precondition_rv: str | None = None) -> JSON:
        entry = self._entry(t, ns, name)
        if precondition_rv and precondition_rv != entry.obj["metadata"]["resourceVersion"]:
            raise conflict(t.qualified, name, "the ResourceVersion in the precondition "
                           f"({precondition_rv}) does not match the ResourceVersion in record "
                           f"({entry.obj['metadata']['resourceVersion']}). The object might "
                           "have been modified", t.group, t.plural)
        if self.dry_run:
            return self.render(entry)
        if entry.obj["metadata"].get("finalizers"):
            if entry.obj["metadata"].get("deletionTimestamp"):
                return self.render(entry)
            new = copy.deepcopy(entry.obj)
            new["metadata"]["deletionTimestamp"] = self.clock()
            new["metadata"]["deletionGracePeriodSeconds"] = 0
            return self._commit(t, entry, new, entry.managers, "")
        if t is rt.CRD and name in self._crd_keys:  # its custom resources go first
            self._drop_kind(self._crd_keys.pop(name))
        return self._remove(t, ns or "", name, propagation)

    def _remove(self, t: ResourceType, ns: str, name: str,
                propagation: str | None = None) -> JSON:
        entry = self.objects[t.key].pop((ns, name))
        self.uids.discard(entry.obj["metadata"].get("uid", ""))
        if t is rt.NAMESPACE:
            for other in list(self.types.all()):
                if other.namespaced:
                    for key in [k for k in self.objects[other.key] if k[0] == name]:
                        if key in self.objects[other.key]:
                            self._remove(other, key[0], key[1])
        self.rv += 1
        gone = self.render(entry)
        gone["metadata"]["resourceVersion"] = str(self.rv)
        self._publish(t, "DELETED", self.render(entry), gone)
        self._collect_garbage(entry.obj["metadata"].get("uid", ""), propagation)
        return gone

    def _collect_garbage(self, owner_uid: str, propagation: str | None) -> None:
        if not owner_uid:
            return
        for t in list(self.types.all()):
            for (ns, name), entry in list(self.objects.get(t.key, {}).items()):
                refs = entry.obj["metadata"].get("ownerReferences") or []
                if not any(r.get("uid") == owner_uid for r in refs):
                    continue
                if (ns, name) not in self.objects[t.key]:
                    continue
                if propagation == "Orphan":
                    new = copy.deepcopy(entry.obj)
                    kept = [r for r in refs if r.get("uid") != owner_uid]
                    if kept:
                        new["metadata"]["ownerReferences"] = kept
                    else:
                        new["metadata"].pop("ownerReferences")
                    managers = patching.record_update(entry.obj, new, entry.managers,
                                                      "garbage-collector", custom=t.custom,
                                                      list_maps=_list_maps(t))
                    self._commit(t, entry, new, managers, "garbage-collector")
                elif not any(self.exists_uid(r.get("uid", "")) for r in refs):
                    self.delete(t, ns or None, name)


def _delete_any(obj: Any, path: tuple[str | int, ...]) -> None:
    cur = obj
    for part in path[:-1]:
        try:
            cur = cur[part]
        except (KeyError, IndexError, TypeError):
            return
    if isinstance(cur, dict):
        cur.pop(path[-1], None)


def _default_policy(obj: JSON) -> None:
    """admissionregistration/v1 defaults of a ValidatingAdmissionPolicy's match rules."""
    match = (obj.get("spec") or {}).get("matchConstraints")
    if not isinstance(match, dict):
        return
    match.setdefault("namespaceSelector", {})
    match.setdefault("objectSelector", {})
    match.setdefault("matchPolicy", "Equivalent")
    for rule in match.get("resourceRules") or []:
        if isinstance(rule, dict):
            rule.setdefault("scope", "*")
    spec = obj["spec"]
    spec.setdefault("failurePolicy", "Fail")


def _decode_defaults(t: ResourceType, obj: JSON) -> None:
    """A CRD-defined kind is defaulted while the request is decoded, before field
    ownership is computed: the writer owns the defaulted fields, as upstream."""
    if t.crd is not None:
        structural.prune_nulls_and_default(t.crd.schema, obj)


def _list_maps(t: ResourceType) -> patching.ListMaps | None:
    """Where a CRD-defined kind's lists merge by key (None: every list is atomic)."""
    return t.crd.list_maps if t.crd is not None else None


def _spec_of(obj: Mapping[str, Any]) -> JSON:
    return {k: v for k, v in obj.items() if k not in _SPEC_IGNORED}
