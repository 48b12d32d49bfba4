"""Kubernetes objects for the realk8s tests, shaped by DESIGN.md's contracts.

Plain dict builders, no I/O. The EndpointSlice builder is the hand-written
contract shape (what the host agent must publish), used where the tests check
the apiserver and CoreDNS without the agent.
"""

from __future__ import annotations

from typing import Any

from imex_shared.model import EnsembleId

ENSEMBLE_LABEL = "imex-ensemble.io/ensemble"
INDEX_LABEL = "imex-ensemble.io/index"
# DESIGN.md wrote "imex-ensemble.io/host-agent": no valid label value ("/"), the
# real apiserver answers 422. The host agent uses this form (host_agent/ensembles/slices.py).
MANAGED_BY = "host-agent.imex-ensemble.io"


def ensemble_service(namespace: str, name: str, *, max_members: int = 4,
                     port: int = 50000) -> dict[str, Any]:
    """A headless, selector-less ensemble Service (DESIGN.md "Names")."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {ENSEMBLE_LABEL: name},
            "annotations": {
                "imex-ensemble.io/max-members": str(max_members),
                "imex-ensemble.io/port": str(port),
            },
        },
        "spec": {
            "clusterIP": "None",
            "ports": [{"name": "imex", "port": port, "protocol": "TCP"}],
        },
    }


def vmi(namespace: str, name: str, ensemble: str | None, *, ip: str | None = None,
        node: str = "node-a", phase: str = "Running", ready: bool = True,
        index: int | None = None) -> dict[str, Any]:
    """A VMI as virt-controller leaves it: spec from the user, status from KubeVirt."""
    labels: dict[str, str] = {}
    if ensemble is not None:
        labels[ENSEMBLE_LABEL] = ensemble
    if index is not None:
        labels[INDEX_LABEL] = str(index)
    obj: dict[str, Any] = {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {
            "domain": {
                "cpu": {"cores": 2},
                "memory": {"guest": "1Gi"},
                "resources": {"requests": {"memory": "1Gi", "cpu": "500m"}},
                "devices": {
                    "interfaces": [{"name": "default", "masquerade": {}}],
                    "disks": [{"name": "root", "disk": {"bus": "virtio"}}],
                },
            },
            "networks": [{"name": "default", "pod": {}}],
            "volumes": [{"name": "root",
                         "containerDisk": {"image": "example.invalid/guest:1"}}],
        },
    }
    status: dict[str, Any] = {
        "phase": phase,
        "nodeName": node,
        "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
    }
    if ip is not None:
        status["interfaces"] = [{"name": "default", "ipAddress": f"{ip}/24",
                                 "ipAddresses": [ip], "mac": "02:00:00:00:00:01",
                                 "infoSource": "domain, guest-agent"}]
    obj["status"] = status
    return obj


def contract_slice(ens: EnsembleId, service_uid: str, members: list[dict[str, Any]],
                   *, port: int = 50000) -> dict[str, Any]:
    """The EndpointSlice DESIGN.md specifies, written by hand.

    ``members``: dicts with index, ip, vmi, node, ready.
    """
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{ens.name}-imex",
            "namespace": ens.namespace,
            "labels": {"kubernetes.io/service-name": ens.name,
                       "endpointslice.kubernetes.io/managed-by": MANAGED_BY},
            "ownerReferences": [{"apiVersion": "v1", "kind": "Service", "name": ens.name,
                                 "uid": service_uid, "controller": True,
                                 "blockOwnerDeletion": True}],
        },
        "addressType": "IPv4",
        "ports": [{"name": "imex", "port": port, "protocol": "TCP"}],
        "endpoints": [
            {
                "hostname": ens.slot(m["index"]),
                "addresses": [m["ip"]],
                "conditions": {"ready": m["ready"]},
                "nodeName": m["node"],
                "targetRef": {"apiVersion": "kubevirt.io/v1",
                              "kind": "VirtualMachineInstance",
                              "namespace": ens.namespace, "name": m["vmi"]},
            }
            for m in members
        ],
    }
