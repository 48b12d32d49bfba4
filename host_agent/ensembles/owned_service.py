"""An ImexEnsemble's own Service: what it should be, and what to do with the one found (pure).

The agent creates and owns a headless, selector-less Service of the CR's name
(controller ownerReference to the CR, ``blockOwnerDeletion``), labelled and
annotated as a Service-only ensemble would be (service_spec.service_annotations),
so the Service alone still says what the ensemble is. What it finds decides
(``plan_service``):

- no Service: **create** it;
- labelled ``imex-ensemble.io/ensemble=<name>``, controlled by this CR: **own**
  (re-applied only when it differs from the desired body);
- labelled so, no controller reference, headless and selector-less:
  **adopt** (the ownerReference is added; the name, and with it the domain
  id and every slot name, stays, so guests see nothing: no IMEX restart, no
  DNS gap);
- labelled so but controlled by something else, or not headless, or with a
  selector: **conflict**; the Service keeps working as a Service-only
  ensemble, exactly as before the CR came, and the CR is Degraded;
- labelled for another ensemble (or, found at create time, not labelled at
  all): **foreign**; it is left alone and the CR is Degraded.

owned_service_io.py brings the Service to the desired body.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from host_agent.crd.imexensemble import API_VERSION, KIND
from host_agent.ensembles.service_spec import ENSEMBLE_LABEL, service_annotations
from host_agent.ensembles.slices import PORT_NAME
from host_agent.state.snapshot import EnsembleSpec


def _mapping(value: object) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}

Action = Literal["create", "own", "adopt", "conflict", "foreign"]


@dataclass(frozen=True, slots=True)
class ServicePlan:
    """What to do with the Service named like the CR (see the module docstring)."""

    action: Action
    #: Why, for conflict and foreign (a Degraded message and an Event note).
    message: str | None = None


def owner_reference(cr_name: str, cr_uid: str) -> dict[str, Any]:
    """The controller reference an ImexEnsemble's Service carries."""
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": cr_name,
        "uid": cr_uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def controller_of(obj: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The ownerReference with ``controller: true``, if any."""
    for ref in _mapping(obj.get("metadata")).get("ownerReferences") or ():
        if isinstance(ref, Mapping) and ref.get("controller") is True:
            return ref
    return None


def desired_service(spec: EnsembleSpec) -> dict[str, Any]:
    """The Service an ImexEnsemble owns: headless, selector-less, labelled and annotated."""
    assert spec.owner_uid is not None, "only an ImexEnsemble's spec has an owned Service"
    ens = spec.ens
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {
            "name": ens.name,
            "namespace": ens.namespace,
            "labels": {ENSEMBLE_LABEL: ens.name},
            "annotations": service_annotations(spec),
            "ownerReferences": [owner_reference(ens.name, spec.owner_uid)],
        },
        "spec": {
            "clusterIP": "None",
            "ports": [{"name": PORT_NAME, "port": spec.port, "protocol": "TCP"}],
        },
    }


def plan_service(spec: EnsembleSpec, observed: Mapping[str, Any] | None) -> ServicePlan:
    """Create, own, adopt, or leave alone the Service named like the CR (module docstring)."""
    if observed is None:
        return ServicePlan("create")
    ens = spec.ens
    what = f"Service {ens.key}"
    meta = _mapping(observed.get("metadata"))
    label = _mapping(meta.get("labels")).get(ENSEMBLE_LABEL)
    if label != ens.name:
        return ServicePlan("foreign", foreign_message(spec, label))
    if meta.get("deletionTimestamp") is not None:
        return ServicePlan("conflict", (
            f"{what} is being deleted; this ImexEnsemble creates its own once it is gone"))
    ref = controller_of(observed)
    if ref is not None:
        if ref.get("uid") == spec.owner_uid:
            return ServicePlan("own")
        return ServicePlan("conflict", (
            f"{what} is controlled by {ref.get('kind')} {ref.get('name')} "
            f"(uid {ref.get('uid')}), not by this ImexEnsemble; it keeps working as it is. "
            "If that owner is gone, the garbage collector deletes the Service and this "
            "ImexEnsemble creates its own"))
    svc = _mapping(observed.get("spec"))
    if svc.get("selector"):
        return ServicePlan("conflict", (
            f"{what} has a selector, so it cannot be adopted (an ensemble Service is "
            "selector-less); it keeps working as a Service-only ensemble. Remove its "
            "selector to let this ImexEnsemble adopt it"))
    cluster_ip = svc.get("clusterIP")
    if cluster_ip is not None and cluster_ip != "None":
        return ServicePlan("conflict", (
            f"{what} is not headless (clusterIP {cluster_ip!r}) and a cluster IP cannot be "
            "removed; it keeps working as a Service-only ensemble. Recreate it with "
            "clusterIP: None (or delete it and let this ImexEnsemble create it)"))
    return ServicePlan("adopt")


def foreign_message(spec: EnsembleSpec, label: object = None) -> str:
    """Why a Service of the CR's name is not the ensemble's (left alone)."""
    what = f"Service {spec.ens.key}"
    if label is None:
        return (f"{what} exists and is not labelled {ENSEMBLE_LABEL}={spec.ens.name}; it "
                "belongs to something else and is left alone. Rename this ImexEnsemble, or "
                f"label the Service {ENSEMBLE_LABEL}={spec.ens.name} to let it be adopted")
    return (f"{what} is labelled {ENSEMBLE_LABEL}={label!r}, another ensemble's name; it is "
            "left alone. Rename this ImexEnsemble")


def service_in_sync(desired: Mapping[str, Any], observed: Mapping[str, Any] | None) -> bool:
    """The observed Service already carries everything of ``desired``.

    Labels, annotations, ownerReferences and ports may hold more than ours (another
    manager's label, a hand-made Service's extra port): server-side apply leaves what
    it does not own, so comparing whole lists would re-apply on every pass, forever.
    """
    if observed is None:
        return False
    want, have = _mapping(desired.get("metadata")), _mapping(observed.get("metadata"))
    for key in ("labels", "annotations"):
        theirs = _mapping(have.get(key))
        if any(theirs.get(k) != v for k, v in _mapping(want.get(key)).items()):
            return False
    refs = [r for r in have.get("ownerReferences") or () if isinstance(r, Mapping)]
    for ref in want.get("ownerReferences") or ():
        if not any(all(r.get(k) == v for k, v in ref.items()) for r in refs):
            return False
    want_spec, have_spec = _mapping(desired.get("spec")), _mapping(observed.get("spec"))
    if have_spec.get("clusterIP") != want_spec.get("clusterIP"):
        return False
    ports = [p for p in have_spec.get("ports") or () if isinstance(p, Mapping)]
    return all(any(all(p.get(k) == v for k, v in port.items()) for p in ports)
               for port in want_spec.get("ports") or ())
