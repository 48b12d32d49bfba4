"""The informers' cache: what is kept of each object, and the ``Store`` (pure, no I/O).

The informers (informer.py) fill it; the reconciler and the status writer read it.

What is cached (``cache_view``): never ``metadata.managedFields`` (nothing
here reads it); for VMIs only the metadata and status fields the reconciler
reads (ensembles/members.py), with repeated strings interned. At 10,000
VMIs the full objects were most of the agent's memory (tests/bench, issue 7:
about 9 KB each even for a minimal VMI; real ones carry far larger specs).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from sys import intern
from typing import Any, Final

from host_agent.kube.objects import Key, Obj, object_key

#: VMI metadata the agent reads (ensembles/members.py, the reconciler, the store's keys
#: and versions).
_VMI_META: Final = ("name", "namespace", "labels", "resourceVersion", "deletionTimestamp", "uid")
#: Interface fields members.py reads.
_VMI_IFACE: Final = ("name", "ipAddress", "ipAddresses")


def _without_managed_fields(obj: Obj) -> Obj:
    meta = obj.get("metadata")
    if not isinstance(meta, (dict, Mapping)) or "managedFields" not in meta:
        return obj
    out = dict(obj)
    out["metadata"] = {k: v for k, v in meta.items() if k != "managedFields"}
    return out


def _i(value: object) -> object:
    """Intern a string (label keys, phases, node names repeat across thousands of VMIs)."""
    return intern(value) if isinstance(value, str) and len(value) <= 253 else value


def _vmi_metadata(meta: Mapping[str, Any]) -> Obj:
    out: Obj = {}
    for key in _VMI_META:
        if key in meta:
            out[key] = meta[key]
    labels = out.get("labels")
    if isinstance(labels, (dict, Mapping)):
        out["labels"] = {_i(k): _i(v) for k, v in labels.items()}
    if isinstance(out.get("namespace"), str):
        out["namespace"] = _i(out["namespace"])
    return out


def _vmi_interface(iface: object) -> object:
    if not isinstance(iface, (dict, Mapping)):
        return iface  # malformed: members.py reports it
    out: Obj = {key: iface[key] for key in _VMI_IFACE if key in iface}
    if isinstance(out.get("name"), str):
        out["name"] = _i(out["name"])
    return out


#: The usual Ready conditions, one list each shared by every cached VMI that has it
#: (cached objects are read, never changed): ~1.7 MB at 10,000 VMIs (tests/bench ``ha``).
_READY: Final[Mapping[object, list[Obj]]] = {
    value: [{"type": "Ready", "status": value}] for value in ("True", "False", "Unknown")}


def _vmi_status(status: Mapping[str, Any]) -> Obj:
    out: Obj = {}
    if "phase" in status:
        out["phase"] = _i(status["phase"])
    if "nodeName" in status:
        out["nodeName"] = _i(status["nodeName"])
    conditions = status.get("conditions")
    if isinstance(conditions, list):  # only Ready is read (members._ready)
        ready = [
            {"type": "Ready", "status": _i(c.get("status"))}
            for c in conditions if isinstance(c, (dict, Mapping)) and c.get("type") == "Ready"
        ]
        value = ready[0]["status"] if len(ready) == 1 else None
        shared = _READY.get(value) if isinstance(value, str) else None
        out["conditions"] = shared if shared is not None else ready
    elif conditions is not None:
        out["conditions"] = conditions
    interfaces = status.get("interfaces")
    if isinstance(interfaces, list):
        out["interfaces"] = [_vmi_interface(i) for i in interfaces]
    elif interfaces is not None:
        out["interfaces"] = interfaces  # malformed: members.py reports it
    return out


def _vmi_view(obj: Obj) -> Obj:
    """What members.py and the reconciler read of a VMI, with repeated strings interned.

    Each watch event is decoded on its own, so a cached VMI held private copies
    of every key and value; at 10,000 VMIs the status fields nothing reads
    (MACs, info sources, probe times) and those copies grew the agent by about
    30 MB as watch events replaced the listed objects (tests/bench). Keys here
    are this module's literals, shared by every object. A field of the wrong
    type is kept as it came so members.py can report it.
    """
    out: Obj = {}
    meta = obj.get("metadata")
    if isinstance(meta, (dict, Mapping)):
        out["metadata"] = _vmi_metadata(meta)
    elif meta is not None:
        out["metadata"] = meta  # malformed: kept as it came, members.py reports it
    status = obj.get("status")
    if isinstance(status, (dict, Mapping)):
        out["status"] = _vmi_status(status)
    elif status is not None:
        out["status"] = status
    return out


def cache_view(kind: str) -> Callable[[Obj], Obj]:
    """The part of an object of ``kind`` that the cache keeps (module docstring)."""
    return _vmi_view if kind == "VirtualMachineInstance" else _without_managed_fields


class Store:
    """Objects of one kind by (namespace, name), with an optional secondary index.

    ``index_of(obj)`` returns the index key of an object (e.g. the ensemble a
    VMI belongs to) or None.
    """

    def __init__(self, kind: str, index_of: Callable[[Obj], Key | None] | None = None) -> None:
        self.kind = kind
        self._objects: dict[Key, Obj] = {}
        self._index_of = index_of
        self._index: dict[Key, set[Key]] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def get(self, namespace: str, name: str) -> Obj | None:
        return self._objects.get((namespace, name))

    def all_keys(self) -> list[Key]:
        return list(self._objects)

    def by_index(self, key: Key) -> list[Obj]:
        return [self._objects[k] for k in sorted(self._index.get(key, ()))]

    def put(self, obj: Obj) -> Obj | None:
        key = object_key(obj)
        old = self._objects.get(key)
        if old is not None:
            self._unindex(key, old)
        self._objects[key] = obj
        if self._index_of is not None:
            ikey = self._index_of(obj)
            if ikey is not None:
                self._index.setdefault(ikey, set()).add(key)
        return old

    def pop(self, key: Key) -> Obj | None:
        old = self._objects.pop(key, None)
        if old is not None:
            self._unindex(key, old)
        return old

    def _unindex(self, key: Key, obj: Obj) -> None:
        if self._index_of is None:
            return
        ikey = self._index_of(obj)
        if ikey is None:
            return
        members = self._index.get(ikey)
        if members is not None:
            members.discard(key)
            if not members:
                del self._index[ikey]

    def replace(
        self, items: Iterable[Obj], in_scope: Callable[[Key], bool]
    ) -> list[tuple[Obj | None, Obj | None]]:
        """Make the in-scope part equal to ``items``; returns every (old, new) pair."""
        fresh = {object_key(o): o for o in items}
        changes: list[tuple[Obj | None, Obj | None]] = []
        for key in [k for k in self._objects if in_scope(k) and k not in fresh]:
            changes.append((self.pop(key), None))
        for obj in fresh.values():
            changes.append((self.put(obj), obj))
        return changes
