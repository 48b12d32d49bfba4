"""Which spec is in force for an ensemble, and what the pass declares about it.

A key (namespace, name) is an ensemble when an ImexEnsemble or a labelled Service
of that name exists. With a CR, the pass parses it (ensembles/cr_spec.py), brings
its own Service into being (create, adopt, or find it in conflict:
ensembles/owned_service.py) and puts the CR's spec in force; when the CR cannot
take over (refused, or its name is held by a Service it cannot adopt) a labelled
Service keeps working as a Service-only ensemble, exactly as before the CR came,
and the CR's ``Declaration`` says why. Without a CR, the Service is parsed as it
always was. A spec that stops parsing leaves the last valid one in force, with a
problem saying so; authEncryption never changes on a live ensemble.

Each pass's ``Declaration`` (None: no CR, or nothing in force for a Service) is
where the ImexEnsemble status and the Events start (the reconciler hands it to
the status writer).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any

from host_agent.ensembles.cr_spec import (
    SERVICE_CONFLICT,
    Declaration,
    cr_identity,
    parse_ensemble_cr,
)
from host_agent.ensembles.owned_service_io import ServiceApplier
from host_agent.ensembles.service_spec import parse_ensemble_service
from host_agent.kube.objects import Key, Obj
from host_agent.metrics import HostMetrics
from host_agent.reconcile.reconcile import keep_auth_encryption
from host_agent.state.snapshot import EnsembleSpec

log = logging.getLogger("imex.host.reconcile")


@dataclass(frozen=True, slots=True)
class InForce:
    """One pass's conclusion about a key, before anything is published."""

    spec: EnsembleSpec | None
    problems: list[str]
    declaration: Declaration | None
    #: look at the key again this many seconds after the pass (a Service we cannot see
    #: holds the CR's name: nothing we watch tells us when it goes)
    recheck: float | None = None


class Specs:
    """The spec in force per key, remembering each key's last valid one."""

    def __init__(self, owned: ServiceApplier | None, metrics: HostMetrics,
                 conflict_recheck: float) -> None:
        self._owned = owned
        self._metrics = metrics
        self._conflict_recheck = conflict_recheck
        self._last_good: dict[Key, EnsembleSpec] = {}

    def forget(self, key: Key) -> None:
        self._last_good.pop(key, None)

    async def resolve(self, key: Key, cr: Obj | None, service: Obj | None) -> InForce:
        """What is in force for ``key`` (``cr`` and ``service`` as the caches show them)."""
        if cr is not None:
            return await self._from_cr(key, cr, service)
        spec, problems = self._from_service(key, service)
        return InForce(spec, problems, self._service_declaration(key, service, spec))

    @staticmethod
    def _service_declaration(key: Key, service: Obj | None,
                             spec: EnsembleSpec | None) -> Declaration | None:
        """A Service-only ensemble's Declaration (its Events regard the Service)."""
        uid = ((service or {}).get("metadata") or {}).get("uid")
        if spec is None or not isinstance(uid, str) or not uid:
            return None
        return Declaration(key[0], key[1], uid, 0, spec, kind="Service")

    def _from_service(
        self, key: Key, service: Obj | None
    ) -> tuple[EnsembleSpec | None, list[str]]:
        """The spec a Service declares (or its last valid one), and its problems."""
        if service is None:
            return None, []
        ident = f"{key[0]}/{key[1]}"
        spec, problems = parse_ensemble_service(service)
        if spec is None:
            previous = self._last_good.get(key)
            if previous is None or previous.source != "service":
                return None, problems
            return previous, [*problems, f"Service {ident}: still using its last valid "
                              f"settings (max-members {previous.max_members})"]
        spec, problems = keep_auth_encryption(self._last_good.get(key), spec, problems)
        self._last_good[key] = spec
        return spec, problems

    async def _from_cr(self, key: Key, cr: Obj, service: Obj | None) -> InForce:
        """The spec an ImexEnsemble puts in force, after bringing its Service into being.

        When the CR cannot take over, a labelled Service of its name keeps working as a
        Service-only ensemble (its problems then come first in the list).
        """
        ident = f"{key[0]}/{key[1]}"
        uid, generation = cr_identity(cr)
        parsed = parse_ensemble_cr(cr)
        refusals: list[tuple[str, str]] = []
        problems: list[str] = []
        spec = parsed.spec
        if spec is not None:
            spec, problems = keep_auth_encryption(self._last_good.get(key), spec, problems)
            self._last_good[key] = spec
        else:
            assert parsed.reason is not None and parsed.message is not None
            refusals.append((parsed.reason, parsed.message))
            problems.append(parsed.message)
            previous = self._last_good.get(key)
            if previous is not None and previous.source == "cr" and previous.owner_uid == uid:
                spec = previous
                problems.append(f"ImexEnsemble {ident}: still using its last valid settings "
                                f"(maxMembers {previous.max_members})")

        def declare(in_force: EnsembleSpec | None, action: Any = None,
                    wrote: str | None = None) -> Declaration:
            return Declaration(key[0], key[1], uid, generation, in_force, tuple(refusals),
                               action, wrote)

        if spec is None or self._owned is None:
            fallback, more = self._from_service(key, service)
            return InForce(fallback, [*problems, *more], declare(fallback))
        outcome = await self._owned.ensure(spec)
        action = outcome.plan.action
        if action in ("conflict", "foreign"):
            assert outcome.plan.message is not None
            refusals.append((SERVICE_CONFLICT, outcome.plan.message))
            problems.append(outcome.plan.message)
            recheck = self._conflict_recheck if action == "foreign" else None
            fallback, more = self._from_service(key, service) if action == "conflict" \
                else (None, [])
            return InForce(fallback, [*problems, *more], declare(fallback, action), recheck)
        if outcome.wrote is not None:
            self._metrics.service_writes.labels(
                "adopt" if action == "adopt" else outcome.wrote).inc()
            what = {"create": "created", "adopt": "adopted (ownerReference added; domain id "
                    f"{spec.ens.domain_id} unchanged)", "own": "updated"}[action]
            log.info("%s: Service %s %s", ident, ident, what, extra={"ensemble": ident})
        spec = replace(spec, uid=outcome.uid)
        return InForce(spec, problems, declare(spec, action, outcome.wrote))
