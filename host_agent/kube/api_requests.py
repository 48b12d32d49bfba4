"""What one request to the Kubernetes API was, for ``imex_host_agent_api_requests_total``
(pure).

client.py counts every request the agent's client sends, by ``verb`` (the audit log's
words: get, list, watch, create, update, patch, apply, delete, deletecollection;
``discovery`` for /api, /apis and group versions; ``other`` for anything else),
``resource`` (the plural, with a subresource as ``imexensembles/status``) and ``code``
(the HTTP status, or ``error`` when no answer came). The label values are bounded: the
agent only ever calls a fixed set of resources, and a path this module does not
recognise counts as ``other`` instead of adding a value per object name.

The alert ImexHostAgentApiWritesFailing (docs/runbooks.md) reads the write verbs.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Final

WRITE_VERBS: Final = ("create", "update", "patch", "apply", "delete", "deletecollection")
#: a plural or plural/subresource; anything else is not a resource name we send
_RESOURCE = re.compile(r"^[a-z][a-z0-9.-]{0,62}(/[a-z][a-z0-9-]{0,62})?$")
_APPLY = "application/apply-patch+yaml"


def _split(path: str) -> list[str]:
    return [p for p in path.split("?", 1)[0].split("/") if p]


def resource_of(path: str) -> tuple[str, bool] | None:
    """(resource, names an object) of an API path; None for discovery and non-API paths.

    ``/api/v1/namespaces/gpu/services/gb200`` -> ("services", True);
    ``/apis/imex-ensemble.io/v1alpha1/namespaces/gpu/imexensembles/gb200/status`` ->
    ("imexensembles/status", True); ``/api/v1/namespaces/imex-system`` ->
    ("namespaces", True); ``/apis/discovery.k8s.io/v1/endpointslices`` ->
    ("endpointslices", False).
    """
    parts = _split(path)
    if parts[:1] == ["api"] and len(parts) >= 2:
        rest = parts[2:]
    elif parts[:1] == ["apis"] and len(parts) >= 3:
        rest = parts[3:]
    else:
        return None
    if not rest:
        return None
    if rest[0] == "namespaces" and len(rest) >= 3:
        rest = rest[2:]  # a namespaced resource; /namespaces/<ns> alone is the Namespace
    resource, name, sub = rest[0], rest[1] if len(rest) > 1 else None, rest[2:3]
    label = f"{resource}/{sub[0]}" if sub else resource
    if len(rest) > 3 or not _RESOURCE.match(label):
        return ("other", name is not None)
    return (label, name is not None)


def classify(method: str, path: str, params: Mapping[str, str],
             content_type: str | None = None) -> tuple[str, str]:
    """(verb, resource) of one request, as the metric labels them."""
    method = method.upper()
    found = resource_of(path)
    if found is None:
        parts = _split(path)
        if parts[:1] in (["api"], ["apis"]) and method == "GET":
            return ("discovery", "")
        return ("other", "")
    resource, named = found
    if method == "GET":
        watch = params.get("watch", "").lower() in ("true", "1")
        return ("watch" if watch else "get" if named else "list", resource)
    if method == "PATCH":
        apply = (content_type or "").split(";", 1)[0].strip().lower() == _APPLY
        return ("apply" if apply else "patch", resource)
    if method == "DELETE":
        return ("delete" if named else "deletecollection", resource)
    verb = {"POST": "create", "PUT": "update"}.get(method, "other")
    return (verb, resource)
