"""ImexEnsemble fixtures for the host agent's tests, as the apiserver returns them.

``imex_ensemble(...)`` builds the object with the CRD's defaults filled in (the
apiserver defaults on every read), taken from the CRD's one source of truth.
"""

from __future__ import annotations

from typing import Any

from guest_agent.ensemble_crd import SPEC_FIELDS
from host_agent.crd import API_VERSION, KIND

CR_UID = "0c0ffee0-0000-4000-8000-0000000000cr"


def imex_ensemble(
    name: str = "gb200",
    *,
    namespace: str = "rack1",
    uid: str = CR_UID,
    generation: int = 1,
    defaults: bool = True,
    status: dict[str, Any] | None = None,
    resource_version: str | None = None,
    **spec: Any,
) -> dict[str, Any]:
    body: dict[str, Any] = {}
    if defaults:
        body = {k: v["default"] for k, v in SPEC_FIELDS.items() if "default" in v}
    body.update(spec)
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "uid": uid,
                            "generation": generation}
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    obj: dict[str, Any] = {"apiVersion": API_VERSION, "kind": KIND, "metadata": meta,
                           "spec": body}
    if status is not None:
        obj["status"] = status
    return obj
