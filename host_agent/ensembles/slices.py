"""An ensemble's EndpointSlices: the desired objects, and when to write them (pure).

Desired state (DESIGN.md "Names"): one slice per address family,
``<service>-imex`` (IPv4) and ``<service>-imex-v6`` (IPv6), because a slice
holds one addressType. Labelled ``kubernetes.io/service-name`` (cluster DNS
finds it by that) and ``endpointslice.kubernetes.io/managed-by`` (ours, never
the built-in controller's), owned by the Service so the garbage collector
removes it with the Service. One endpoint per published member: hostname =
slot name, addresses = [ip], ``conditions.ready``, ``nodeName``, ``targetRef``
-> the VMI; one port ``imex``. A family without members has no slice.

In sidecar scope (one VMI per agent) each agent owns a slice of its own,
``<service>-imex-vmi-<vmi>`` (``-imex-v6-vmi-``), since endpoint lists are
atomic under server-side apply and agents would otherwise overwrite each
other; cluster DNS merges all slices of a Service.

Writing (``SliceApplier``, slices_io.py): server-side apply, field manager
``imex-host-agent``, force. A write happens only when the desired object
differs from what the slice informer last observed, and not when the same
body was already written and the informer simply has not caught up (the
observed resourceVersion is still the one seen before, or the one returned
by, our own write). So a repeated reconcile, a relist or an agent restart
causes no write; an edit or deletion by someone else is repaired.
Errors propagate to the reconciler, which retries the ensemble later.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

import msgspec

from host_agent.kube.objects import resource_version
from host_agent.state.snapshot import EnsembleSnapshot
from imex_shared.model import ipv4_octets

FIELD_MANAGER: Final = "imex-host-agent"
#: DESIGN.md wrote "imex-ensemble.io/host-agent", but a label *value* may not hold
#: "/" (the API server refuses such a slice with 422); this is the same name in
#: the form Kubernetes' own controllers use (endpointslice-controller.k8s.io).
MANAGED_BY: Final = "host-agent.imex-ensemble.io"
MANAGED_BY_LABEL: Final = "endpointslice.kubernetes.io/managed-by"
SERVICE_NAME_LABEL: Final = "kubernetes.io/service-name"
PORT_NAME: Final = "imex"
KUBEVIRT_API_VERSION: Final = "kubevirt.io/v1"

Body = dict[str, Any]


def slice_name(service: str, family: str, vmi: str | None = None) -> str:
    """Name of the slice for ``family`` ("IPv4"/"IPv6"); per-VMI in sidecar scope."""
    base = f"{service}-imex" if family == "IPv4" else f"{service}-imex-v6"
    return base if vmi is None else f"{base}-vmi-{vmi}"


def _family(ip: str) -> str:
    """Address family of a published (canonical) IP. A dotted quad is read as text:
    parsing each of a first sync's 10,000 distinct addresses was a hot spot, and a
    memo of them only missed. Anything else is parsed (and raises if it is no address)."""
    if ipv4_octets(ip) is not None:
        return "IPv4"
    return "IPv6" if isinstance(ipaddress.ip_address(ip), ipaddress.IPv6Address) else "IPv4"


def desired_slices(snap: EnsembleSnapshot, *, vmi: str | None = None) -> dict[str, Body | None]:
    """slice name -> desired body, or None where the slice must not exist.

    Both families are always in the result, so a family that lost its last
    member is deleted. With ``vmi`` (sidecar scope) only that VMI's endpoint
    is considered, in that VMI's own slices.
    """
    spec = snap.spec
    ens = spec.ens
    by_family: dict[str, list[Body]] = {"IPv4": [], "IPv6": []}
    for published in snap.members:
        m = published.member
        if vmi is not None and m.vmi != vmi:
            continue
        endpoint: Body = {
            "addresses": [m.ip],
            "conditions": {"ready": bool(m.ready)},
            "hostname": ens.slot(m.index),
        }
        if m.node:
            endpoint["nodeName"] = m.node
        if m.vmi:
            endpoint["targetRef"] = {
                "apiVersion": KUBEVIRT_API_VERSION,
                "kind": "VirtualMachineInstance",
                "name": m.vmi,
                "namespace": ens.namespace,
            }
        by_family[_family(m.ip)].append(endpoint)

    result: dict[str, Body | None] = {}
    for family, endpoints in by_family.items():
        name = slice_name(ens.name, family, vmi)
        if not endpoints:
            result[name] = None
            continue
        metadata: Body = {
            "name": name,
            "namespace": ens.namespace,
            "labels": {SERVICE_NAME_LABEL: ens.name, MANAGED_BY_LABEL: MANAGED_BY},
        }
        if spec.uid:
            metadata["ownerReferences"] = [
                {
                    "apiVersion": "v1",
                    "kind": "Service",
                    "name": ens.name,
                    "uid": spec.uid,
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ]
        result[name] = {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": metadata,
            "addressType": family,
            "endpoints": endpoints,
            "ports": [{"name": PORT_NAME, "port": spec.port, "protocol": "TCP"}],
        }
    return result


def contains(desired: object, observed: object) -> bool:
    """True when every field of ``desired`` is in ``observed`` with that value.

    Maps may carry extra keys (server defaults, other managers' labels);
    lists must match element by element and in length (endpoint lists are
    atomic: an extra endpoint is a difference).
    """
    if isinstance(desired, Mapping):
        if not isinstance(observed, Mapping):
            return False
        return all(k in observed and contains(v, observed[k]) for k, v in desired.items())
    if isinstance(desired, list):
        if not isinstance(observed, list) or len(desired) != len(observed):
            return False
        return all(contains(d, o) for d, o in zip(desired, observed, strict=True))
    return desired == observed


def encode_body(body: Body | None) -> bytes | None:
    """A slice body as compact JSON: what the write memory keeps of it.

    The leader remembers its last write of each of its slices; as dicts the 1,000
    slices of 10,000 VMIs held ~8 MB (35 small dicts and lists per slice) beside the
    informer's copy of the same slices, as JSON ~2.5 MB. Bodies come from
    ``desired_slices``, which builds them in a fixed key order, so equal bodies
    encode to equal bytes; a different order would only cost one more write.
    """
    return None if body is None else msgspec.json.encode(body)


@dataclass(frozen=True, slots=True)
class Written:
    """Our last write of one slice: the body as ``encode_body`` keeps it (None:
    deleted) and the versions observed before it and returned by it."""

    encoded: bytes | None
    rv_before: str | None
    rv_after: str | None

    @classmethod
    def of(cls, body: Body | None, rv_before: str | None, rv_after: str | None) -> Written:
        return cls(encode_body(body), rv_before, rv_after)

    @property
    def deleted(self) -> bool:
        return self.encoded is None

    def wrote(self, encoded: bytes | None) -> bool:
        """This write left the body that encodes to ``encoded`` (None: a delete)."""
        return self.encoded == encoded


def in_sync(desired: Body | None, observed: Mapping[str, Any] | None) -> bool:
    """The observed slice already is what we want (absent when ``desired`` is None)."""
    if desired is None:
        return observed is None
    return observed is not None and contains(desired, observed)


def needs_write(
    desired: Body | None, observed: Mapping[str, Any] | None, last: Written | None
) -> bool:
    """Decide whether the slice must be written (pure; see the module docstring).

    ``last`` must be forgotten (or refreshed) once the observation has shown
    the write, see ``SliceApplier.sync``; otherwise a later deletion by
    someone else would look like informer lag.
    """
    if in_sync(desired, observed):
        return False
    if last is not None and last.wrote(encode_body(desired)):
        rv = resource_version(observed)
        if rv == last.rv_before or (rv is not None and rv == last.rv_after):
            return False  # our write is not observed yet, or observed as written
    return True


def is_our_write(observed: Mapping[str, Any] | None, last: Written | None) -> bool:
    """``observed`` carries the resourceVersion our last (non-delete) write returned."""
    if observed is None or last is None or last.deleted or last.rv_after is None:
        return False
    return resource_version(observed) == last.rv_after


def current_version(observed: Mapping[str, Any] | None, last: Written | None) -> str | None:
    """The resourceVersion the slice has on the server as far as we know: the observed
    one, or the one our own last write returned when the informer has not seen it yet.
    None: we believe it does not exist (an apply then creates it, unconditionally)."""
    rv = resource_version(observed)
    if last is not None and not last.deleted and last.rv_after is not None and (
        rv == last.rv_before
    ):
        return last.rv_after
    return rv
