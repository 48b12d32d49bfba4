"""An ImexEnsemble's own Service: brought to the desired body, writing only differences.

The decision is pure (``ensembles.plan_service``); this is the small I/O part
around it. What the agent acts on is the Service as the informer last saw it,
or, when the informer has not caught up with our own last write yet, the
object that write returned (so a second pass right after a create does not
try to create again and read its own Service as someone else's).

Writes: ``create`` (POST; a 409 means a Service of that name exists that the
label-scoped informer does not show: someone else's, left alone) and forced
server-side apply for a Service that is ours or adoptable. The client checks
the write gate before each. Calls for one ensemble are serialized by the
reconciler; errors propagate to it, and it retries the ensemble later.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from host_agent.ensembles.owned_service import (
    ServicePlan,
    desired_service,
    foreign_message,
    plan_service,
    service_in_sync,
)
from host_agent.kube.client import AlreadyExists
from host_agent.kube.objects import Key, Obj, resource_version
from host_agent.state.snapshot import EnsembleSpec


class ServiceClient(Protocol):
    async def create_service(self, body: Obj) -> Obj:
        """POST; raises AlreadyExists (409) when the name is taken."""

    async def apply_service(self, body: Obj) -> Obj:
        """Forced server-side apply; returns the object as stored."""


@dataclass(frozen=True, slots=True)
class ServiceOutcome:
    """What ``ServiceApplier.ensure`` found and did."""

    plan: ServicePlan
    #: The Service as it now is (the slices' owner), None when there is none of ours.
    service: Mapping[str, Any] | None
    #: "create" or "apply" when this call wrote, else None.
    wrote: str | None = None

    @property
    def uid(self) -> str | None:
        meta = (self.service or {}).get("metadata")
        uid = meta.get("uid") if isinstance(meta, Mapping) else None
        return uid if isinstance(uid, str) and uid else None


class ServiceApplier:
    def __init__(
        self, client: ServiceClient, observed: Callable[[str, str], Mapping[str, Any] | None]
    ) -> None:
        self._client = client
        self._observed = observed
        #: our last write per Service: (resourceVersion observed before it, the result)
        self._last: dict[Key, tuple[str | None, Mapping[str, Any]]] = {}

    def view(self, namespace: str, name: str) -> Mapping[str, Any] | None:
        """The Service as the informer shows it, or our last write if that is newer."""
        key = (namespace, name)
        cached = self._observed(namespace, name)
        last = self._last.get(key)
        if last is None:
            return cached
        rv_before, written = last
        if resource_version(cached) == rv_before:
            return written  # the informer has not seen our write yet
        del self._last[key]  # the informer caught up (our write, or a newer change)
        return cached

    async def ensure(self, spec: EnsembleSpec) -> ServiceOutcome:
        ns, name = spec.ens.namespace, spec.ens.name
        view = self.view(ns, name)
        plan = plan_service(spec, view)
        desired = desired_service(spec)
        if plan.action == "create":
            try:
                created = await self._client.create_service(desired)
            except AlreadyExists:
                return ServiceOutcome(ServicePlan("foreign", foreign_message(spec)), None)
            self._last[(ns, name)] = (None, created)
            return ServiceOutcome(plan, created, "create")
        if plan.action == "own" and service_in_sync(desired, view):
            return ServiceOutcome(plan, view)
        if plan.action in ("own", "adopt"):
            applied = await self._client.apply_service(desired)
            self._last[(ns, name)] = (resource_version(view), applied)
            return ServiceOutcome(plan, applied, "apply")
        return ServiceOutcome(plan, view if plan.action == "conflict" else None)

    def forget(self, namespace: str, name: str) -> None:
        """The Service was deleted: what we wrote last says nothing any more."""
        self._last.pop((namespace, name), None)
