"""A minimal OpenAPI v3 surface, enough for kubectl's field-validation probe.

TEST STAND-IN, never product code. kubectl (1.27+) decides between client-
and server-side validation by reading `/openapi/v3` and, for the object's
group/version, the PATCH operation tagged with its
`x-kubernetes-group-version-kind`: when that operation lists the
`fieldValidation` query parameter, kubectl sends `fieldValidation=Strict`
and leaves validation to the server (which this double does, see
validation.py). So the documents here carry paths and operations, not the
schemas. Without them kubectl refuses `apply`/`create` ("failed to download
openapi") unless run with `--validate=false`.
"""

from __future__ import annotations

from typing import Any

from .resources import TypeRegistry

JSON = dict[str, Any]
DOC_HASH = "sandbox0"

_QUERY_PARAMS = ("dryRun", "fieldManager", "fieldValidation", "force", "pretty")


def _gv_path(group: str, version: str) -> str:
    return f"apis/{group}/{version}" if group else f"api/{version}"


def index(types: TypeRegistry) -> JSON:
    paths = {}
    for group, version in types.group_versions().items():
        key = _gv_path(group, version)
        paths[key] = {"serverRelativeURL": f"/openapi/v3/{key}?hash={DOC_HASH}"}
    return {"paths": paths}


def group_version_doc(types: TypeRegistry, gv_path: str) -> JSON | None:
    """The document for "api/v1" or "apis/<group>/<version>", or None if unknown."""
    parts = gv_path.strip("/").split("/")
    if parts[0] == "api" and len(parts) == 2:
        group, version = "", parts[1]
    elif parts[0] == "apis" and len(parts) == 3:
        group, version = parts[1], parts[2]
    else:
        return None
    served = types.types_in(group, version)
    if not served:
        return None
    params = [{"name": p, "in": "query", "schema": {"type": "string"}, "uniqueItems": True}
              for p in _QUERY_PARAMS]
    paths: JSON = {}
    for t in served:
        base = f"/{_gv_path(group, version)}/"
        item = base + (f"namespaces/{{namespace}}/{t.plural}/{{name}}" if t.namespaced
                       else f"{t.plural}/{{name}}")
        gvk = {"group": t.group, "version": t.version, "kind": t.kind}
        op = {"operationId": f"patch{t.kind}", "x-kubernetes-action": "patch",
              "x-kubernetes-group-version-kind": gvk, "parameters": params,
              "responses": {"200": {"description": "OK"}}}
        paths[item] = {"patch": op}
        if t.has_status:
            paths[item + "/status"] = {"patch": dict(op, operationId=f"patch{t.kind}Status")}
    return {"openapi": "3.0.0",
            "info": {"title": "Kubernetes (sandbox API double)", "version": "v1.33.0"},
            "paths": paths, "components": {"schemas": {}}}
