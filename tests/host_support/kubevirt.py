"""VMI and Service fixtures for the host agent's tests, checked against real schemas.

``vmi(...)`` builds a VirtualMachineInstance the way KubeVirt reports one;
``validate_vmi`` checks it against ``v1.VirtualMachineInstance`` from
KubeVirt's published OpenAPI document (shared/reference, or the vendored closure of
the API double in a clean clone), resolving every
``$ref``, so no fixture describes a VMI that KubeVirt could not produce.
"""

from __future__ import annotations

import copy
import functools
import json
from typing import Any

import jsonschema

from tests.sandbox.kube_api.validation import kubevirt_openapi_path


@functools.cache
def _validator() -> jsonschema.protocols.Validator:
    # the shared reference beside the repository, else the vendored closure (clean clones)
    doc = json.loads(kubevirt_openapi_path().read_text())
    schema = {"$ref": "#/definitions/v1.VirtualMachineInstance", "definitions": doc["definitions"]}
    cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft4Validator)
    return cls(schema)  # type: ignore[no-any-return]


def validate_vmi(obj: dict[str, Any]) -> None:
    """Raise jsonschema.ValidationError when ``obj`` is not a valid KubeVirt VMI."""
    errors = sorted(_validator().iter_errors(obj), key=lambda e: list(e.absolute_path))
    if errors:
        raise errors[0]


def vmi(
    name: str,
    *,
    namespace: str = "rack1",
    ensemble: str | None = "gb200",
    index: str | None = None,
    phase: str | None = "Running",
    ip: str | None = None,
    ips: list[str] | None = None,
    network: str = "default",
    interfaces: list[dict[str, Any]] | None = None,
    node: str | None = "node-a",
    ready: bool | None = True,
    deleting: bool = False,
    status: bool = True,
    extra_labels: dict[str, str] | None = None,
    uid: str | None = None,
) -> dict[str, Any]:
    """A VMI as KubeVirt reports it (status as virt-controller/handler write it)."""
    labels: dict[str, str] = {}
    if ensemble is not None:
        labels["imex-ensemble.io/ensemble"] = ensemble
    if index is not None:
        labels["imex-ensemble.io/index"] = index
    labels.update(extra_labels or {})
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels}
    if uid:
        meta["uid"] = uid
    if deleting:
        meta["deletionTimestamp"] = "2026-11-29T18:00:00Z"
        meta["finalizers"] = ["foregroundDeleteVirtualMachine"]
    obj: dict[str, Any] = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": meta,
        "spec": {
            "domain": {
                "devices": {"interfaces": [{"name": network, "masquerade": {}}]},
                "resources": {"requests": {"memory": "1Gi"}},
            },
            "networks": [{"name": network, "pod": {}}],
        },
    }
    if not status:
        return obj
    st: dict[str, Any] = {}
    if phase is not None:
        st["phase"] = phase
    if node is not None:
        st["nodeName"] = node
    if ready is not None:
        st["conditions"] = [
            {"type": "Ready", "status": "True" if ready else "False", "lastProbeTime": None}
        ]
    if interfaces is not None:
        st["interfaces"] = interfaces
    elif ip is not None or ips is not None:
        iface: dict[str, Any] = {
            "name": network,
            "mac": "02:00:00:00:00:01",
            "infoSource": "domain, guest-agent",
            "podInterfaceName": "eth0",
        }
        if ip is not None:
            iface["ipAddress"] = ip
        iface["ipAddresses"] = ips if ips is not None else ([ip] if ip is not None else [])
        st["interfaces"] = [iface]
    obj["status"] = st
    return obj


def service(
    name: str = "gb200",
    *,
    namespace: str = "rack1",
    annotations: dict[str, str] | None = None,
    label: str | None = None,
    uid: str = "6f0f1d5e-0000-4000-8000-000000000001",
    selector: dict[str, str] | None = None,
    cluster_ip: str = "None",
) -> dict[str, Any]:
    """A headless, selector-less ensemble Service."""
    spec: dict[str, Any] = {
        "clusterIP": cluster_ip,
        "ports": [{"name": "imex", "port": 50000, "protocol": "TCP"}],
    }
    if selector:
        spec["selector"] = selector
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid,
            "labels": {"imex-ensemble.io/ensemble": label if label is not None else name},
            "annotations": dict(annotations or {}),
        },
        "spec": spec,
    }


def clone(obj: dict[str, Any]) -> dict[str, Any]:
    return copy.deepcopy(obj)
