"""Which source holds an ensemble's (generation, GuestView) pair, and the step each pass takes.

Service-only ensembles keep the pair in the Service annotation, ImexEnsembles in
their status (pair.py has both encodings); ``spec.source`` decides, so a CR
that cannot take over (its labelled Service keeps working as a Service-only
ensemble) uses the annotation.

Each reconcile pass calls ``settle``: a follower serves the pair it observed; the
leader compares it with the view its own caches give and writes a new pair first
when they differ (``next_pair``), then serves what the API answered.

Never backwards, also when an ensemble switches between the two kinds of source:

- Service-only -> ImexEnsemble (adoption): the CR source observes the larger of its
  status pair and the annotation, and while the annotation exists the leader writes
  the pair into the status under the same generation (no guest wakes up) and then
  removes the annotation.
- ImexEnsemble -> Service-only (the CR refused in favour of its Service, or deleted
  with ``--cascade=orphan``): the annotation is gone by then, so the leader starts a
  new pair at max(wall clock in ms, the largest number this process served + 1).
- A replica never serves a pair below one it already served (a hand edit, a source
  that lags): it keeps its current snapshot until the leader has repaired the pair.

The sources (``PairSource``): ``ServiceAnnotationSource`` reads the annotation
from the Service informer's cache and writes it with a preconditioned merge
patch through the write gate (the Service's resourceVersion in the patch, so a
deposed leader's late write is refused with 409, never merged).
``StatusPairSource`` reads the CR status and has the status writer write it
(status/status_io.py's ``write_pair``: that writer is the one writer of the
status, so the pair goes with everything else in one write, under its budget
and with the CR's resourceVersion as precondition).

Observed, for an ImexEnsemble: the status as the CR informer shows it, or the
answer to our own write while the informer lags. An adopted Service may still
carry an annotation pair (from when it was Service-only, or from a time the CR
could not take over): the larger of the two is what replicas serve, and while
the annotation exists the pair is *misplaced*: the leader writes it into the
status (the same generation when the view is unchanged, so no guest wakes up)
and then removes the annotation. So a later ``--cascade=orphan`` starts the
Service-only numbering afresh from the wall clock instead of from an old
annotation below what guests hold.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from host_agent.kube.client import KubeError, api_call
from host_agent.kube.leadership import WriteGate
from host_agent.kube.objects import Key
from host_agent.metrics import HostMetrics
from host_agent.persist.pair import (
    FIELD_MANAGER,
    MEMBERSHIP_ANNOTATION,
    MembershipError,
    PersistedView,
    annotation_text,
    decode,
    encode,
    next_pair,
    pair_from_status,
    wall_ms,
)
from host_agent.state.snapshot import Absent, CaPublished, EnsembleSnapshot, EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import Member


class PairSource(Protocol):
    """Where one kind of ensemble keeps its pair (Service annotation, CR status)."""

    def observed(self, key: Key) -> PersistedView | None:
        """The pair to serve, as this replica observed it in the API (None: none yet)."""
        ...

    def misplaced(self, key: Key) -> bool:
        """The observed pair is not (only) where it must live: the leader writes it there."""
        ...

    async def write(self, key: Key, pair: PersistedView,
                    preview: EnsembleSnapshot) -> PersistedView:
        """Persist ``pair`` (``preview``: the snapshot it makes, for a writer that persists
        more than the pair); returns the pair as the API now holds it."""
        ...


class ServiceAnnotationSource:
    """The pair of a Service-only ensemble, read from the Service informer's cache and
    written with a preconditioned merge patch through the write gate."""

    def __init__(
        self,
        client: Any,
        services: Callable[[str, str], Mapping[str, Any] | None],
        gate: WriteGate,
    ) -> None:
        self._client = client
        self._services = services
        self._gate = gate
        #: our last write per Service: (rv observed before, rv returned, the pair it left;
        #: None: the annotation removed)
        self._last: dict[Key, tuple[str, str, PersistedView | None]] = {}
        #: a digest of the annotation text last decoded per Service, and what it decoded
        #: to: a pass over an unchanged ensemble (and the echo of our own write) compares
        #: digests instead of parsing JSON again, and no second copy of a text is kept
        self._decoded: dict[Key, tuple[bytes, PersistedView | None]] = {}
        self.writes = 0

    def _rv(self, key: Key) -> str | None:
        obj = self._services(*key)
        meta = obj.get("metadata") if obj is not None else None
        rv = meta.get("resourceVersion") if isinstance(meta, Mapping) else None
        return rv if isinstance(rv, str) else None

    def observed(self, key: Key) -> PersistedView | None:
        rv = self._rv(key)
        last = self._last.get(key)
        if last is not None and rv == last[0]:
            return last[2]  # our write is accepted, its echo not yet seen
        return self._decode(key, self._services(*key))

    def _decode(self, key: Key, service: Mapping[str, Any] | None) -> PersistedView | None:
        text = annotation_text(service)
        if text is None:
            return None
        digest = _digest(text)
        memo = self._decoded.get(key)
        if memo is not None and memo[0] == digest:
            return memo[1]
        pair: PersistedView | None
        try:
            pair = decode(text)
        except MembershipError:
            pair = None  # unreadable: as if absent; the leader writes a new generation
        self._decoded[key] = (digest, pair)
        return pair

    def is_echo(self, key: Key, service: Mapping[str, Any] | None) -> bool:
        last = self._last.get(key)
        if last is None or service is None:
            return False
        meta = service.get("metadata")
        return isinstance(meta, Mapping) and meta.get("resourceVersion") == last[1]

    def misplaced(self, key: Key) -> bool:
        return False

    async def write(self, key: Key, pair: PersistedView,
                    preview: EnsembleSnapshot | None = None) -> PersistedView:
        text = encode(pair)
        self._decoded[key] = (_digest(text), pair)  # its echo and the answer: no parsing
        written = await self._patch(key, {MEMBERSHIP_ANNOTATION: text})
        return written if written is not None else pair

    def holds(self, key: Key) -> bool:
        """The Service (as last observed, or as our last write left it) carries the
        annotation, readable or not."""
        last = self._last.get(key)
        if last is not None and self._rv(key) == last[0]:
            return last[2] is not None
        obj = self._services(*key)
        meta = obj.get("metadata") if obj is not None else None
        annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
        return isinstance(annotations, Mapping) and MEMBERSHIP_ANNOTATION in annotations

    async def clear(self, key: Key) -> None:
        """Remove the annotation (its pair moved into the ImexEnsemble's status), with the
        same precondition as a write."""
        await self._patch(key, {MEMBERSHIP_ANNOTATION: None})

    async def _patch(self, key: Key, annotations: Mapping[str, str | None]
                     ) -> PersistedView | None:
        """The preconditioned merge patch; returns the pair the answer holds (None: none)."""
        informer_rv = rv = self._rv(key)
        last = self._last.get(key)
        if last is not None and rv == last[0]:
            rv = last[1]
        if rv is None:
            raise MembershipError(f"Service {key[0]}/{key[1]} is not in the cache")
        self._gate.ensure()  # immediately before the write
        out = await api_call(
            self._client, "PATCH", f"/api/v1/namespaces/{key[0]}/services/{key[1]}",
            body={"metadata": {"resourceVersion": rv, "annotations": dict(annotations)}},
            content_type="application/merge-patch+json", params={"fieldManager": FIELD_MANAGER},
        )
        self.writes += 1
        new_rv = ((out or {}).get("metadata") or {}).get("resourceVersion")
        written = self._decode(key, out)
        if isinstance(new_rv, str):
            self._last[key] = (informer_rv or rv, new_rv, written)
        return written

    def forget(self, key: Key) -> None:
        self._last.pop(key, None)
        self._decoded.pop(key, None)


def _digest(text: str) -> bytes:
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


class StatusPairWriter(Protocol):
    """What this source needs of the status writer (status/status_io.py's StatusWriter)."""

    def observed_status(self, key: Key) -> Mapping[str, Any] | None: ...

    async def write_pair(self, key: Key, snap: EnsembleSnapshot) -> Mapping[str, Any]: ...

    def is_echo(self, key: Key, cr: Mapping[str, Any] | None) -> bool: ...


class StatusPairSource:
    """The pair of an ImexEnsemble (see the module docstring)."""

    def __init__(self, writer: StatusPairWriter, annotations: ServiceAnnotationSource) -> None:
        self._writer = writer
        self._annotations = annotations

    def in_status(self, key: Key) -> PersistedView | None:
        pair, _ = pair_from_status(self._writer.observed_status(key))
        return pair

    def problem(self, key: Key) -> str | None:
        _, problem = pair_from_status(self._writer.observed_status(key))
        return problem

    def observed(self, key: Key) -> PersistedView | None:
        status = self.in_status(key)
        annotation = self._annotations.observed(key)
        if annotation is not None and (status is None or
                                       annotation.generation > status.generation):
            return annotation
        return status

    def is_echo(self, key: Key, cr: Mapping[str, Any] | None) -> bool:
        return self._writer.is_echo(key, cr)

    def misplaced(self, key: Key) -> bool:
        return self._annotations.holds(key)

    async def write(self, key: Key, pair: PersistedView,
                    preview: EnsembleSnapshot) -> PersistedView:
        written, _ = pair_from_status(await self._writer.write_pair(key, preview))
        if self._annotations.holds(key):
            await self._annotations.clear(key)  # the status holds it now
        return written if written is not None else pair


class Pairs:
    def __init__(self, annotations: ServiceAnnotationSource, state: State, gate: WriteGate,
                 metrics: HostMetrics, crs: StatusPairSource | None = None) -> None:
        self._annotations = annotations
        self._crs = crs
        self._state = state
        self._gate = gate
        self._metrics = metrics

    def source(self, spec: EnsembleSpec) -> PairSource:
        if spec.source == "cr" and self._crs is not None:
            return self._crs
        return self._annotations

    def service_echo(self, key: Key, service: Mapping[str, Any] | None) -> bool:
        """Our own membership annotation write coming back: nothing to do."""
        return self._annotations.is_echo(key, service)

    def cr_pair_changed(self, old: Mapping[str, Any] | None,
                        new: Mapping[str, Any] | None) -> bool:
        """A CR event that changes the pair its status holds (a follower must serve it;
        the leader's own write coming back does not count)."""
        if self._crs is None or old is None or new is None:
            return False
        meta = new.get("metadata") or {}
        key = (str(meta.get("namespace")), str(meta.get("name")))
        if self._crs.is_echo(key, new):
            return False
        return pair_from_status(old.get("status"))[0] != pair_from_status(new.get("status"))[0]

    def forget(self, key: Key) -> None:
        self._annotations.forget(key)

    async def settle(
        self, key: Key, spec: EnsembleSpec, members: list[Member],
        addresses: Mapping[int, frozenset[str]], ca: CaPublished | None,
        problems: list[str], absent: tuple[Absent, ...],
    ) -> PersistedView | None:
        """The pair to serve now (None: nothing servable yet, keep what is served)."""
        source = self.source(spec)
        observed = source.observed(key)
        floor = self._state.served_floor(spec.ens)
        if not self._gate.may_write():
            if observed is not None and observed.generation < floor:
                return None  # below what we served: wait for the leader's repair
            return observed
        view, since = self._state.desired_view(spec, members, addresses, ca)
        want = next_pair(observed, view, since, floor=floor, now_ms=wall_ms(),
                         relocate=source.misplaced(key))
        if want is None:
            return observed
        preview = self._state.preview_observed(
            spec, members, problems, addresses, want.generation, want.view, want.since_map(),
            ca=ca, absent=absent)
        try:
            written = await source.write(key, want, preview)
        except KubeError as exc:
            self._metrics.membership_writes.labels(
                "conflict" if exc.status == 409 else "error").inc()
            raise
        self._metrics.membership_writes.labels("ok").inc()
        return written
