"""What each client wrote and was sent, with one Lease's holder at every write.

TEST STAND-IN, never product code. Imitates the apiserver's audit log at the
ResponseComplete stage (verb, resource, object, response code, user agent) and adds
two things a real audit log only gives by reconstruction, which the soak
(tests/soak) checks its invariants over:

- **the holder of one Lease at the moment each write was committed.** The double is
  one event loop and a write is committed and answered with nothing else running in
  between (the verb handlers never await), so reading the Lease right after the answer
  reads the holder at the commit. On a real apiserver the same follows from the
  resourceVersions of the Lease's updates in the audit log;
- **deliveries**: which object versions each client was sent (list items, watch events,
  gets, the answer to its own write), kept for the resources named in ``keep``: what a
  client's informer can have observed, and when.

Off unless the server is given an :class:`Audit` (``KubeApiServer.audit``); the soak
drains both logs every tick, so they stay short. Records are plain tuples of JSON data
built on the server's loop and handed over through :meth:`Audit.drain`.
"""

from __future__ import annotations

import json
import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .http import Request, Response, StreamResponse

JSON = dict[str, Any]

WRITE_VERBS = frozenset({"create", "update", "patch", "apply", "delete"})


@dataclass(frozen=True)
class WriteRecord:
    """One write request as answered (a fault's answer included)."""

    t: float  # wall clock (time.time()) when it was answered
    verb: str
    resource: str  # plural, or plural/subresource
    namespace: str
    name: str
    code: int
    user_agent: str
    #: holderIdentity of the audited Lease when the write was committed (None: no holder)
    holder: str | None
    #: the object the API answered with, for kept resources and 2xx answers
    obj: JSON | None = None


@dataclass(frozen=True)
class Delivery:
    """One object version sent to a client."""

    t: float
    user_agent: str
    how: str  # list | watch | get | write
    resource: str
    obj: JSON


class Audit:
    """The two logs; see the module docstring. Thread-safe ``drain``."""

    def __init__(self, lease: tuple[str, str] | None = None,
                 keep: Iterable[str] = (), limit: int = 200_000) -> None:
        #: (namespace, name) of the Lease whose holder each write records
        self.lease = lease
        #: plurals whose objects are kept (write answers) and whose deliveries are logged
        self.keep = frozenset(keep)
        self.writes: deque[WriteRecord] = deque(maxlen=limit)
        self.deliveries: deque[Delivery] = deque(maxlen=limit)
        self._lock = threading.Lock()

    def kept(self, resource: str) -> bool:
        return resource.split("/")[0] in self.keep

    def write(self, verb: str, resource: str, path: str, code: int, user_agent: str,
              holder: str | None, answer: Mapping[str, Any] | None) -> None:
        ns, name = _names(path, answer)
        obj = dict(answer) if answer is not None and self.kept(resource) and \
            200 <= code < 300 else None
        rec = WriteRecord(time.time(), verb, resource, ns, name, code, user_agent, holder, obj)
        with self._lock:
            self.writes.append(rec)
            if obj is not None and obj.get("metadata"):
                self.deliveries.append(Delivery(rec.t, user_agent, "write", resource, obj))

    def delivered(self, user_agent: str, how: str, resource: str,
                  objs: Iterable[Mapping[str, Any]]) -> None:
        if not self.kept(resource):
            return
        now = time.time()
        with self._lock:
            for obj in objs:
                self.deliveries.append(Delivery(now, user_agent, how, resource, dict(obj)))

    def drain(self) -> tuple[list[WriteRecord], list[Delivery]]:
        with self._lock:
            writes, deliveries = list(self.writes), list(self.deliveries)
            self.writes.clear()
            self.deliveries.clear()
        return writes, deliveries


def _names(path: str, answer: Mapping[str, Any] | None) -> tuple[str, str]:
    """(namespace, name) of a write: from the answer's metadata, else from the path."""
    meta = (answer or {}).get("metadata") if isinstance(answer, Mapping) else None
    if isinstance(meta, Mapping) and meta.get("name"):
        return str(meta.get("namespace") or ""), str(meta["name"])
    parts = [p for p in path.split("/") if p]
    ns = parts[parts.index("namespaces") + 1] if "namespaces" in parts[:-1] else ""
    # .../<plural>/<name>[/status]: the name follows the plural, which follows the version
    tail = parts[parts.index("namespaces") + 2:] if ns else parts[2 if parts[:1] == ["api"]
                                                                  else 3:]
    return ns, tail[1] if len(tail) > 1 else ""


def holder_of(store: Any, lease: tuple[str, str] | None) -> str | None:
    """The Lease's ``spec.holderIdentity`` in ``store`` right now (None: none or no Lease)."""
    if lease is None:
        return None
    from .resources import LEASE

    entry = store.objects.get(LEASE.key, {}).get(lease)
    if entry is None:
        return None
    holder = (entry.obj.get("spec") or {}).get("holderIdentity")
    return str(holder) if holder else None


R = Response | StreamResponse


def record(audit: Audit | None, store: Any, req: Request, verb: str, resource: str,
           resp: R) -> R:
    """Log one answered request in ``audit`` when there is one, and pass the answer on:
    a write with the Lease holder now, at its commit (the double answers a write with
    nothing else run in between), or the objects a read sent."""
    if audit is None or req.query.get("dryRun") or isinstance(resp, StreamResponse):
        return resp
    ua = req.headers.get("user-agent", "")
    if verb in WRITE_VERBS:
        answer = _decoded(resp) if resp.status < 300 else None
        audit.write(verb, resource, req.path, resp.status, ua, holder_of(store, audit.lease),
                    answer)
    elif verb in ("get", "list") and resp.status == 200 and audit.kept(resource):
        doc = _decoded(resp) or {}
        items = doc.get("items") if verb == "list" else [doc]
        audit.delivered(ua, verb, resource, items if isinstance(items, list) else [])
    return resp


def _decoded(resp: Response) -> JSON | None:
    try:
        doc = json.loads(resp.body)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None
