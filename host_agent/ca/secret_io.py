"""The CA Secrets (``imex-ca-<namespace>.<name>`` in the agent's own namespace): I/O and policy.

The agent reads Secrets here and nowhere else, and only these: RBAC grants get,
create and update on Secrets in its own namespace (a Role; nothing
cluster-wide, no list or watch). So the Secret is read with a GET by name, on
every reconcile pass of an authEncryption ensemble and, for signing, at most
every ``cache_seconds`` per ensemble.

Who writes (issue 19 "With several replicas"): only the leader creates,
rotates or ends an overlap, each write preceded by ``gate.ensure()``; an update
carries the resourceVersion it read (a stale leader gets 409, never overwrites).
Every replica signs with the CA it reads from that one Secret.

Failure rules: a missing Secret is created (leader) or waited for (others). A
Secret that exists but does not parse is a **problem** reported on the
ensemble (Degraded) and in the log, never replaced: a new CA would split the
domain (old-CA members would refuse new-CA members). A new CA comes only from
a rotation, which needs the old key for its cross-signature, so a broken Secret
must be fixed by hand (or deleted, which starts a new CA that every guest's
pinned fingerprint refuses: they need user-data with the new ``caSHA256``).
"""

from __future__ import annotations

import datetime as dt
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from types import ModuleType
from typing import TYPE_CHECKING, Any, Protocol

from host_agent.kube.leadership import WriteGate
from host_agent.kube.objects import Obj
from host_agent.state.snapshot import CaPublished, EnsembleSpec
from imex_shared.model import EnsembleId

if TYPE_CHECKING:
    from host_agent.ca import authority as ca_mod

log = logging.getLogger("imex.host.ca")


class CaUnavailable(Exception):
    """No usable CA for the ensemble right now (not created yet, or its Secret is bad)."""


def _secret() -> ModuleType:
    """host_agent.ca.secret, imported on first use (``cryptography``, as ``_ca``)."""
    import host_agent.ca.secret

    return host_agent.ca.secret


def _ca() -> ModuleType:
    """host_agent.ca.authority, imported on first use: ``cryptography`` costs the agent about 13 MB
    of RSS, which an agent without authEncryption ensembles never pays."""
    import host_agent.ca.authority

    return host_agent.ca.authority


#: Where a Service-only ensemble publishes its CA's fingerprint (an ImexEnsemble: status).
CA_SHA256_ANNOTATION = "imex-ensemble.io/ca-sha256"

#: How often an authEncryption ensemble is looked at without any event (a hand edit
#: of its Secret is noticed within this; an overlap end is scheduled exactly).
RECHECK_SECONDS = 60.0


class SecretApi(Protocol):
    """GET/POST/PUT of one Secret by name (host_agent/kube/client.py ``SecretWriter``)."""

    async def get_secret(self, namespace: str, name: str) -> Obj | None: ...

    async def create_secret(self, body: Obj) -> Obj: ...

    async def replace_secret(self, body: Obj) -> Obj: ...


@dataclass(frozen=True, slots=True)
class CaOutcome:
    """One pass's view of an ensemble's CA."""

    published: CaPublished | None
    problems: tuple[str, ...] = ()
    #: seconds until the pass must run again (overlap end, periodic re-check).
    recheck_after: float | None = None


def ca_annotation_patch(service: Mapping[str, Any] | None, sha256: str) -> Obj | None:
    """The merge patch that puts ``sha256`` on a Service-only ensemble (None: already there)."""
    meta = (service or {}).get("metadata") or {}
    annotations = meta.get("annotations") or {}
    if annotations.get(CA_SHA256_ANNOTATION) == sha256:
        return None
    return {"metadata": {"annotations": {CA_SHA256_ANNOTATION: sha256}}}


def published(state: ca_mod.CaState) -> CaPublished:
    return CaPublished(state.sha256, state.bundle_sha256())


def secret_body(state: ca_mod.CaState, ens: EnsembleId, namespace: str,
                resource_version: str | None = None) -> Obj:
    meta: Obj = {
        "name": _secret().secret_name(ens),
        "namespace": namespace,
        "labels": {"app.kubernetes.io/managed-by": "imex-host-agent",
                   "imex-ensemble.io/ca": "true"},
        "annotations": _secret().secret_annotations(state, ens),
    }
    if resource_version is not None:
        meta["resourceVersion"] = resource_version
    return {"apiVersion": "v1", "kind": "Secret", "metadata": meta, "type": "Opaque",
            "data": _secret().secret_data(state)}


def _rv(obj: Obj) -> str | None:
    rv = obj.get("metadata", {}).get("resourceVersion")
    return rv if isinstance(rv, str) else None


class CaManager:
    """Creates, rotates and reads the per-ensemble CAs (see the module docstring)."""

    def __init__(
        self,
        api: SecretApi,
        namespace: str,
        gate: WriteGate,
        *,
        overlap: dt.timedelta = dt.timedelta(hours=1),
        cache_seconds: float = 2.0,
        clock: Callable[[], dt.datetime] = lambda: dt.datetime.now(dt.UTC),
        monotonic: Callable[[], float] = time.monotonic,
        patch_service: Callable[[str, str, Obj], Awaitable[object]] | None = None,
    ) -> None:
        #: merge-patches a Service (namespace, name, body): the fingerprint annotation
        self.patch_service = patch_service
        self.api = api
        self.namespace = namespace
        self.gate = gate
        self.overlap = overlap
        self.cache_seconds = cache_seconds
        self.clock = clock
        self.monotonic = monotonic
        self._cache: dict[EnsembleId, tuple[float, ca_mod.CaState]] = {}

    def _where(self, ens: EnsembleId) -> str:
        return f"Secret {self.namespace}/{_secret().secret_name(ens)}"

    async def _read(self, ens: EnsembleId) -> tuple[ca_mod.CaState | None, str | None]:
        obj = await self.api.get_secret(self.namespace, _secret().secret_name(ens))
        if obj is None:
            return None, None
        state: ca_mod.CaState = _secret().parse_secret(obj, self.clock())  # errors propagate
        self._cache[ens] = (self.monotonic(), state)
        return state, _rv(obj)

    async def load(self, ens: EnsembleId) -> ca_mod.CaState:
        """``CaSource`` for the registry: the CA as its Secret holds it (cached briefly)."""
        hit = self._cache.get(ens)
        if hit is not None and self.monotonic() - hit[0] < self.cache_seconds:
            return hit[1]
        try:
            state, _ = await self._read(ens)
        except _secret().CaSecretError as exc:
            raise CaUnavailable(str(exc)) from exc
        except Exception as exc:  # the API is unreachable: the caller retries
            raise CaUnavailable(f"cannot read {self._where(ens)}: {exc}") from exc
        if state is None:
            raise CaUnavailable(f"{self._where(ens)} does not exist yet (the leader creates it)")
        return state

    async def publish_on_service(self, spec: EnsembleSpec, service: Mapping[str, Any] | None,
                                 sha256: str) -> bool:
        """A Service-only ensemble: ``imex-ensemble.io/ca-sha256`` (leader; True: written)."""
        if spec.source != "service" or self.patch_service is None or \
                not self.gate.may_write():
            return False
        patch = ca_annotation_patch(service, sha256)
        if patch is None:
            return False
        self.gate.ensure()
        await self.patch_service(spec.ens.namespace, spec.ens.name, patch)
        log.info("%s: published the CA fingerprint %s on its Service", spec.ens.key,
                 sha256[:16], extra={"ensemble": spec.ens.key})
        return True

    def forget(self, ens: EnsembleId) -> None:
        self._cache.pop(ens, None)

    async def reconcile(self, spec: EnsembleSpec) -> CaOutcome:
        """Make the CA what ``spec`` asks for (leader), and say what guests should see."""
        ens = spec.ens
        where = self._where(ens)
        try:
            state, rv = await self._read(ens)
        except _secret().CaSecretError as exc:
            self.forget(ens)
            return CaOutcome(None, (
                f"{exc}; not minting a new CA (that would split the domain): fix the Secret, "
                "or delete it to start a new CA (guests then need user-data with the new "
                "caSHA256)",), RECHECK_SECONDS)
        now = self.clock()
        wanted = spec.ca_rotation or ""
        if state is None:
            if not self.gate.may_write():
                return CaOutcome(None, (f"{where} does not exist yet; the leader creates it",),
                                 RECHECK_SECONDS)
            state = _ca().first_state(ens, now, wanted)
            self.gate.ensure()
            created = await self.api.create_secret(secret_body(state, ens, self.namespace))
            self._cache[ens] = (self.monotonic(), state)
            log.info("%s: created CA %s in %s", ens.key, state.sha256[:16], where,
                     extra={"ensemble": ens.key, "ca_sha256": state.sha256})
            rv = _rv(created)
        elif wanted != state.rotation and self.gate.may_write():
            old = state.sha256
            state = _ca().rotate(state, ens, wanted, now, self.overlap)
            self.gate.ensure()
            await self.api.replace_secret(secret_body(state, ens, self.namespace, rv))
            self._cache[ens] = (self.monotonic(), state)
            log.info("%s: CA rotation %r: new CA %s cross-signed by %s; old CA trusted until %s",
                     ens.key, wanted, state.sha256[:16], old[:16],
                     f"{state.overlap_until:%Y-%m-%dT%H:%M:%SZ}",
                     extra={"ensemble": ens.key, "ca_sha256": state.sha256})
        elif (nxt := _ca().advance(state, now)) is not state and self.gate.may_write():
            self.gate.ensure()
            await self.api.replace_secret(secret_body(nxt, ens, self.namespace, rv))
            self._cache[ens] = (self.monotonic(), nxt)
            log.info("%s: CA rotation step %s -> %s%s", ens.key, state.step, nxt.step,
                     ": the new CA signs now" if nxt.step == "switch" else
                     ": the old CA is no longer trusted",
                     extra={"ensemble": ens.key, "ca_sha256": nxt.sha256})
            state = nxt
        recheck = RECHECK_SECONDS
        step_at = state.next_step_at()
        if step_at is not None:
            recheck = max(0.05, min(recheck, (step_at - now).total_seconds()))
        return CaOutcome(published(state), (), recheck)
