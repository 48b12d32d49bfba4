"""Kubernetes objects as the host agent holds them, and their identity (pure).

Objects stay the plain JSON mappings the API sent (``Obj``); an object is known by
``(namespace, name)`` (``Key``). Every stage uses these two names, defined once here.

The modules on the sync's hot path test ``isinstance(x, (dict, Mapping))``: what the API
sent is always a dict, which that tuple matches at C speed, while a test against the
``Mapping`` ABC alone is a Python-level call each time (about 260,000 in a 10,000-VMI
sync; tests/bench ``sync_profile``, issue 27). Other mappings are still accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: An API object as the JSON mapping the API sent (no model conversion, no renaming).
Obj = dict[str, Any]
#: (namespace, name): how an object, and an ensemble, is known.
Key = tuple[str, str]


def object_key(obj: Mapping[str, Any]) -> Key:
    meta = obj.get("metadata")
    meta = meta if isinstance(meta, (dict, Mapping)) else {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def resource_version(obj: Mapping[str, Any] | None) -> str | None:
    """``metadata.resourceVersion`` (None: no object, or none in it)."""
    meta = obj.get("metadata") if obj is not None else None
    if not isinstance(meta, (dict, Mapping)):
        return None
    rv = meta.get("resourceVersion")
    return rv if isinstance(rv, str) else None
