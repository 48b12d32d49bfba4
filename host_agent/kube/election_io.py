"""Leader election against a real ``coordination.k8s.io/v1`` Lease: the I/O loop.

``election.Elector`` decides; this module reads and writes the Lease and
keeps time. One task (``LeaseElection.run``) does, forever:

  read the Lease (GET) -> ``observe`` -> ``plan`` -> write it (POST to create,
  PUT with the observed resourceVersion to take or renew) -> sleep.

A leader sleeps ``retry_period`` between renewals; a candidate sleeps a
jittered retry period (client-go's factor 1.2). The Lease watch (``lease_changed``,
wired in main.py) cuts a sleep short when it shows the lease released, deleted or,
while we lead, held by someone else: a released lease is then taken within one GET
and one PUT instead of at the next jittered read. Routine renews by another holder
wake nobody, so a follower reads no more often than it polls. Without list/watch
rights the loop simply polls, as client-go does. Every request of a leader is
bounded by what is left of its renew deadline, so a hung apiserver cannot
keep it "leading" past the deadline; ``may_write`` reads the deadline on the
monotonic clock anyway, so the gate closes on time even while a request hangs.

Writes are optimistic: a PUT carries the resourceVersion it was planned from,
so two candidates racing for an expired lease get one 200 and one 409, and the
loser simply reads again. A read whose answer arrives after its own timeout
(the process was paused with the reply queued) is dropped unplanned and read
again, so a leader woken from SIGSTOP does not even try a renew that the API
would refuse.

Failures never stop the agent: a refused verb (403: RBAC missing) is logged
once per verb with what to grant, and the replica keeps serving reads and
writes nothing; any other error is logged and retried at the next period.

``release`` (graceful stop): the gate closes first, then the lease is written
with no holder and a 1 s duration, so a candidate takes it as soon as its watch
shows the release (else at its next read) instead of waiting out 15 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import math
import secrets
import time
from collections.abc import Callable, Mapping
from typing import Any, Final, Protocol

from host_agent.kube.client import KubeError
from host_agent.kube.election import Desired, ElectionConfig, Elector, LeaseRecord, jittered

log = logging.getLogger("imex.host.election")

INSTANCE_ANNOTATION: Final = "imex-ensemble.io/holder-instance"
LEASES: Final = "leases.coordination.k8s.io"


def microtime(ts: float) -> str:
    """A metav1.MicroTime: RFC 3339 with microseconds, UTC."""
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def record_of(obj: Mapping[str, Any]) -> LeaseRecord:
    """The Lease as the elector reads it; tolerant of hand edits (wrong types count as unset)."""
    meta = obj.get("metadata") if isinstance(obj.get("metadata"), Mapping) else {}
    assert isinstance(meta, Mapping)
    spec = obj.get("spec") if isinstance(obj.get("spec"), Mapping) else {}
    assert isinstance(spec, Mapping)
    annotations = meta.get("annotations") if isinstance(meta.get("annotations"), Mapping) else {}
    assert isinstance(annotations, Mapping)
    holder = spec.get("holderIdentity")
    duration = spec.get("leaseDurationSeconds")
    transitions = spec.get("leaseTransitions")
    instance = annotations.get(INSTANCE_ANNOTATION)

    def text(value: object) -> str | None:
        return value if isinstance(value, str) else None

    return LeaseRecord(
        holder=holder if isinstance(holder, str) else "",
        instance=instance if isinstance(instance, str) else None,
        duration=float(duration) if isinstance(duration, int) and duration > 0 else None,
        acquire_time=text(spec.get("acquireTime")),
        renew_time=text(spec.get("renewTime")),
        transitions=transitions if isinstance(transitions, int) and transitions >= 0 else 0,
        resource_version=str(meta.get("resourceVersion") or ""),
    )


def lease_body(
    namespace: str, name: str, want: Desired, old: Mapping[str, Any] | None, wall: float
) -> dict[str, Any]:
    """The Lease to write: ``old`` (labels, other annotations) kept, our fields set."""
    base: dict[str, Any] = dict(old) if old is not None else {}
    meta = dict(base.get("metadata") or {})
    meta.pop("managedFields", None)
    meta.update(name=name, namespace=namespace)
    annotations = dict(meta.get("annotations") or {})
    annotations[INSTANCE_ANNOTATION] = want.instance
    meta["annotations"] = annotations
    if want.resource_version is not None:
        meta["resourceVersion"] = want.resource_version
    else:
        meta.pop("resourceVersion", None)
    old_spec = base.get("spec") if isinstance(base.get("spec"), Mapping) else {}
    assert isinstance(old_spec, Mapping)
    now = microtime(wall)
    acquire = old_spec.get("acquireTime") if not want.acquire_now else None
    spec = {
        "holderIdentity": want.holder,
        "leaseDurationSeconds": max(1, math.ceil(want.duration)),
        "acquireTime": acquire if isinstance(acquire, str) else now,
        "renewTime": now,
        "leaseTransitions": want.transitions,
    }
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": spec}


class LeaseApi(Protocol):
    async def get(self, timeout: float) -> dict[str, Any] | None: ...

    async def create(self, body: dict[str, Any], timeout: float) -> dict[str, Any]: ...

    async def update(self, body: dict[str, Any], timeout: float) -> dict[str, Any]: ...


class KubeLeaseApi:
    """The three calls on one Lease, over the agent's own API client."""

    def __init__(self, client: Any, namespace: str, name: str) -> None:
        from host_agent.kube.client import api_call

        self._call = api_call
        self._client = client
        self.namespace = namespace
        self.name = name
        self._collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"

    async def get(self, timeout: float) -> dict[str, Any] | None:
        return await self._call(self._client, "GET", f"{self._collection}/{self.name}",
                                timeout=timeout)

    async def create(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await self._call(self._client, "POST", self._collection, body=body,
                                timeout=timeout) or {}

    async def update(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        return await self._call(self._client, "PUT", f"{self._collection}/{self.name}",
                                body=body, timeout=timeout) or {}


class ElectionMetrics(Protocol):
    def set_leader(self, leading: bool) -> None: ...

    def set_transitions(self, total: int) -> None: ...


class LeaseElection:
    """Drives an ``Elector`` against a Lease; see the module docstring."""

    def __init__(
        self,
        api: LeaseApi,
        identity: str,
        config: ElectionConfig,
        *,
        metrics: ElectionMetrics | None = None,
        on_started_leading: Callable[[], None] = lambda: None,
        on_stopped_leading: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        wall: Callable[[], float] = time.time,
        rng: Callable[[], float] | None = None,
        instance: str | None = None,
    ) -> None:
        self.api = api
        self.elector = Elector(identity, instance or secrets.token_hex(8), config)
        self.config = config
        self._metrics = metrics
        self._started = on_started_leading
        self._stopped = on_stopped_leading
        self._clock = clock
        self._wall = wall
        self._rng = rng
        self._last: dict[str, Any] | None = None  # the Lease as last read or written
        self._said: set[str] = set()
        self._was_leading = False
        self._stopping = False
        self._wake = asyncio.Event()
        self._again = False  # step again without sleeping (a stale read was dropped)
        self.steps = 0

    @property
    def where(self) -> str:
        ns = getattr(self.api, "namespace", "?")
        name = getattr(self.api, "name", "?")
        return f"{LEASES} {ns}/{name}"

    # -- the gate's view -----------------------------------------------------------

    def may_write(self) -> bool:
        return not self._stopping and self.elector.may_write(self._clock())

    @property
    def leading(self) -> bool:
        return self.elector.leading

    # -- loop ------------------------------------------------------------------------

    async def run(self) -> None:
        log.info("leader election: candidate %r (instance %s) for %s; lease %g s, renew "
                 "deadline %g s, retry %g s", self.elector.identity, self.elector.instance,
                 self.where, self.config.lease_duration, self.config.renew_deadline,
                 self.config.retry_period)
        while not self._stopping:
            # cleared before the step, not after: a nudge that arrives while the step's
            # GET is in flight may show a change that GET missed, so it must end the sleep
            self._wake.clear()
            await self.step()
            period = self.config.retry_period
            delay = period if self.elector.leading else jittered(
                period, *([self._rng] if self._rng is not None else []))
            if self.elector.leading:
                # never sleep past the deadline: renew in time to keep the gate open
                left = self.elector.renewed_at + self.config.renew_deadline - self._clock()
                delay = max(0.0, min(delay, left - 0.05))
            if self._again:
                self._again = False
                continue
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(delay):
                    await self._wake.wait()

    def nudge(self) -> None:
        """Step now rather than at the end of the current sleep."""
        self._wake.set()

    def lease_changed(self, old: Mapping[str, Any] | None, new: Mapping[str, Any] | None) -> None:
        """The Lease watch's handler: wake the loop when the event may change what we do.

        That is a lease released (no holder) or deleted, or, while we lead, held by
        anyone but this process. The event itself is not folded into the elector: it
        may be older than a read the loop already observed, and resourceVersions
        cannot be ordered, so the woken step reads the Lease afresh.
        """
        if self._stopping:
            return
        if new is None:
            self.nudge()
            return
        record = record_of(new)
        if record.holder == "" or (self.elector.leading and not self.elector.is_ours(record)):
            self.nudge()

    def _timeout(self) -> float:
        if self.elector.leading:
            left = self.elector.renewed_at + self.config.renew_deadline - self._clock()
            return max(0.05, left)
        return self.config.renew_deadline

    async def step(self) -> None:
        """One read-decide-write round."""
        self.steps += 1
        try:
            budget = self._timeout()
            asked = self._clock()
            try:
                obj = await self.api.get(budget)
            except (KubeError, TimeoutError) as exc:
                self._failed("get", exc)
                return
            now = self._clock()
            if now - asked > budget:
                # The answer came back after its own timeout: the process was paused
                # (SIGSTOP, a frozen VM) with the reply queued. What it says may be long
                # out of date, so nothing is planned from it: read again at once.
                log.info("leader election: a read of %s came back %.1f s after it was sent "
                         "(budget %.1f s); reading again", self.where, now - asked, budget)
                self._again = True
                return
            self._last = obj
            self.elector.observe(now, record_of(obj) if obj is not None else None)
            want = self.elector.plan(self._clock())
            if want is None:
                self._waiting()
                return
            body = lease_body(getattr(self.api, "namespace", ""), getattr(self.api, "name", ""),
                              want, obj, self._wall())
            verb = "create" if want.resource_version is None else "update"
            sent = self._clock()
            try:
                if verb == "create":
                    written = await self.api.create(body, self._timeout())
                else:
                    written = await self.api.update(body, self._timeout())
            except (KubeError, TimeoutError) as exc:
                if isinstance(exc, KubeError) and exc.status == 409:
                    self.elector.refused()  # lost a race; the next read decides
                    log.debug("leader election: %s of %s lost a race (409)", verb, self.where)
                    return
                self._failed(verb, exc)
                return
            self._last = written
            self._said.discard("get")
            self._said.discard(verb)
            if self._stopping:
                return  # released meanwhile: do not count this as leading
            became = self.elector.wrote(sent, self._clock(), record_of(written))
            if became:
                log.info("leader election: %r became the leader (%s, %d transitions)",
                         self.elector.identity, self.where, record_of(written).transitions)
        finally:
            self.elector.check_deadline(self._clock())
            self._publish()

    def _waiting(self) -> None:
        e = self.elector
        if e.last_reason == "twin" and "twin" not in self._said:
            self._said.add("twin")
            log.error(
                "leader election: another live process holds %s under this replica's own "
                "identity %r (its instance %s, ours %s); refusing to lead while it renews. "
                "Give every replica its own --identity (the manifests use POD_NAME)",
                self.where, e.identity, e.twin, e.instance)
        elif e.last_reason != "twin":
            self._said.discard("twin")

    def _failed(self, verb: str, exc: BaseException) -> None:
        status = exc.status if isinstance(exc, KubeError) else 0
        if status in (401, 403):
            if verb not in self._said:
                self._said.add(verb)
                log.error(
                    "leader election: the API refuses %r on %s (%s): this service account "
                    "lacks the verb %s on leases in namespace %s. Grant get, create and "
                    "update (and list and watch, for a handover within a second) on leases "
                    "there (a Role; manifests/base/role-leader-election.yaml)."
                    " This replica keeps serving the registry and writes nothing.",
                    verb, self.where, status, verb, getattr(self.api, "namespace", "?"))
            return
        log.warning("leader election: %s of %s failed: %s", verb, self.where, exc)

    def _publish(self) -> None:
        leading = self.elector.leading
        if leading != self._was_leading:
            self._was_leading = leading
            if leading:
                self._started()
            else:
                if not self._stopping:
                    log.warning("leader election: %r stopped leading (%s)",
                                self.elector.identity,
                                "lease taken by " + repr(self.elector.observed.holder)
                                if self.elector.observed is not None
                                and self.elector.observed.holder not in ("", self.elector.identity)
                                else "renew deadline passed")
                self._stopped()
        if self._metrics is not None:
            self._metrics.set_leader(leading and not self._stopping)
            self._metrics.set_transitions(self.elector.transitions_seen)

    # -- stopping ----------------------------------------------------------------------

    async def release(self, timeout: float = 2.0) -> bool:
        """Close the gate, then give the lease up if we hold it; True when released.

        A renewal the loop sent just before the stop may land first and move the
        resourceVersion, so the release's update is refused (409) though the lease is
        still ours; then the lease is read again and, while it is still ours, released
        from what was read (once more, inside ``timeout``). Giving up instead made the
        others wait out the lease (a handover of 3.5 s instead of 0.1 s, seen in CI)."""
        self._stopping = True
        held = self.elector.leading
        self.elector.stop_leading()
        self._wake.set()
        self._publish()
        last = self._last
        if not held or last is None:
            return False
        body = self._release_body(last)
        if body is None:
            return False
        deadline = self._clock() + timeout
        try:
            try:
                written = await self.api.update(body, max(0.05, deadline - self._clock()))
            except KubeError as exc:
                if exc.status != 409:
                    raise
                got = await self.api.get(max(0.05, deadline - self._clock()))
                body = self._release_body(got) if got is not None else None
                if body is None:
                    return False  # deleted, or someone else's by now
                written = await self.api.update(body, max(0.05, deadline - self._clock()))
        except (KubeError, TimeoutError) as exc:
            log.warning("leader election: could not release %s: %s (the others wait for "
                        "it to expire)", self.where, exc)
            return False
        self.elector.released(self._clock(), record_of(written))
        log.info("leader election: released %s", self.where)
        return True

    def _release_body(self, lease: Mapping[str, Any]) -> dict[str, Any] | None:
        """The update that gives ``lease`` up, from its resourceVersion; None when it is
        not this process's to give up."""
        record = record_of(lease)
        if not self.elector.is_ours(record):
            return None
        body = lease_body(getattr(self.api, "namespace", ""), getattr(self.api, "name", ""),
                          Desired("", self.elector.instance, 1.0, False, record.transitions,
                                  record.resource_version), lease, self._wall())
        body["spec"]["holderIdentity"] = ""
        return body
