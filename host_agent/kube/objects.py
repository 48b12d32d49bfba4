"""Kubernetes objects as the host agent holds them, and their identity (pure).

Objects stay the plain JSON mappings the API sent (``Obj``); an object is known by
``(namespace, name)`` (``Key``). Every stage uses these two names, defined once here.
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
    meta = meta if isinstance(meta, Mapping) else {}
    return (str(meta.get("namespace") or ""), str(meta.get("name") or ""))


def resource_version(obj: Mapping[str, Any] | None) -> str | None:
    """``metadata.resourceVersion`` (None: no object, or none in it)."""
    meta = obj.get("metadata") if obj is not None else None
    if not isinstance(meta, Mapping):
        return None
    rv = meta.get("resourceVersion")
    return rv if isinstance(rv, str) else None
