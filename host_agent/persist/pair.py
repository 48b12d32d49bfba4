"""One generation across replicas: the (generation, GuestView) pair the leader persists.

Every replica serves only pairs it observed in the API (an informer event, or
the API's answer to the leader's own write), so two replicas never hand out
two numbers for one membership, and a guest moving between replicas never
sees the number go backwards.

Where the pair lives:

- a Service-only ensemble: the annotation ``imex-ensemble.io/membership`` on
  its Service (it lives exactly as long as the ensemble; an EndpointSlice is
  deleted when empty and split per address family, so it cannot hold it);
- an ImexEnsemble: its status (``membershipGeneration`` with ``members[]``
  and the rest of the GuestView), written by the status writer in the same
  write as the rest of the status (``membership_cr.py``). When a CR adopts a
  Service that carries an annotation pair, the pair moves into the status
  under the same generation and the annotation is then removed, so neither
  kind of source can later hand out an older number (``pairs.py``).

The annotation's value is compact JSON, versioned::

    {"v":1,"generation":1795973999097,"view":{"pins":[[0,"10.0.0.1"],...]},
     "since":[[0,1795973999097],...]}

``view`` holds every field of ``GuestView`` (tuples as lists), so fields added
to GuestView are persisted with no change here; a reader that does not know
a field ignores it. ``since`` (when each slot got its IP, epoch ms, the
leader's clock) is persisted too, so every replica serves the same ``since``.

Rules (``next_pair``, pure): the leader writes a new pair when the desired
view differs from the observed one, or when the observed generation is below
what this process already served (an annotation edited by hand). The new
generation is the observed one plus one; with nothing observed (a new
ensemble, the first upgrade from the non-electing version, an annotation
deleted by hand) it is the leader's wall clock in milliseconds, and never
below anything this process served plus one. Guests holding numbers from a
start-time-based agent therefore always see a larger number.

Writes carry the Service's resourceVersion (a JSON merge patch with
``metadata.resourceVersion``), so a deposed leader's late write is refused
with 409, never merged.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final, Protocol

from host_agent.kube.leadership import WriteGate
from host_agent.kube.objects import Key
from host_agent.state.store import EnsembleSnapshot, GuestView

log = logging.getLogger("imex.host.membership")

MEMBERSHIP_ANNOTATION: Final = "imex-ensemble.io/membership"
#: Its own field manager: the owned Service's server-side apply (``imex-host-agent``)
#: must never drop the annotation as a field it stopped applying.
FIELD_MANAGER: Final = "imex-host-agent-membership"
FORMAT_VERSION: Final = 1



class MembershipError(ValueError):
    """A persisted pair that cannot be read (the message says what is wrong)."""


@dataclass(frozen=True, slots=True)
class PersistedView:
    """A generation and the membership it describes, as persisted in the API."""

    generation: int
    view: GuestView
    #: index -> epoch ms at which the slot got its current IP (the leader's clock)
    since: tuple[tuple[int, int], ...] = ()

    def since_map(self) -> dict[int, float]:
        return {i: ms / 1000.0 for i, ms in self.since}


def _plain(value: object) -> object:
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    return value


def _frozen(value: object) -> object:
    if isinstance(value, list):
        return tuple(_frozen(v) for v in value)
    return value


def view_to_json(view: GuestView) -> dict[str, object]:
    return {f.name: _plain(getattr(view, f.name)) for f in fields(view)}


def view_from_json(doc: object) -> GuestView:
    if not isinstance(doc, Mapping):
        raise MembershipError("'view' is not an object")
    known = {f.name for f in fields(GuestView)}
    kwargs = {k: _frozen(v) for k, v in doc.items() if k in known}
    try:
        view = GuestView(**kwargs)  # type: ignore[arg-type]
    except TypeError as exc:
        raise MembershipError(f"'view' does not fit GuestView: {exc}") from exc
    pins = view.pins
    if not isinstance(pins, tuple) or not all(
        isinstance(p, tuple) and len(p) == 2 and isinstance(p[0], int) and isinstance(p[1], str)
        for p in pins
    ):
        raise MembershipError("'view.pins' is not a list of [index, ip]")
    return view


def encode(pair: PersistedView) -> str:
    doc = {"v": FORMAT_VERSION, "generation": pair.generation, "view": view_to_json(pair.view),
           "since": [list(s) for s in pair.since]}
    return json.dumps(doc, separators=(",", ":"))


def decode(text: str) -> PersistedView:
    try:
        doc = json.loads(text)
    except ValueError as exc:
        raise MembershipError(f"not JSON: {exc}") from exc
    if not isinstance(doc, Mapping):
        raise MembershipError("not a JSON object")
    generation = doc.get("generation")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        raise MembershipError(f"'generation' {generation!r} is not a non-negative integer")
    raw_since = doc.get("since", [])
    since: list[tuple[int, int]] = []
    if isinstance(raw_since, list):
        for item in raw_since:
            if (isinstance(item, list) and len(item) == 2
                    and all(isinstance(x, int) and not isinstance(x, bool) for x in item)):
                since.append((item[0], item[1]))
    return PersistedView(generation, view_from_json(doc.get("view")), tuple(since))


def from_service(service: Mapping[str, Any] | None) -> tuple[PersistedView | None, str | None]:
    """The pair on a Service, and a problem when the annotation is unreadable."""
    if service is None:
        return None, None
    meta = service.get("metadata")
    annotations = meta.get("annotations") if isinstance(meta, Mapping) else None
    text = annotations.get(MEMBERSHIP_ANNOTATION) if isinstance(annotations, Mapping) else None
    if not isinstance(text, str):
        return None, None
    try:
        return decode(text), None
    except MembershipError as exc:
        return None, (f"annotation {MEMBERSHIP_ANNOTATION} is unreadable ({exc}); the "
                      "leader writes a new generation")


def next_pair(
    observed: PersistedView | None,
    view: GuestView,
    since: Mapping[int, float],
    *,
    floor: int,
    now_ms: int,
    relocate: bool = False,
) -> PersistedView | None:
    """The pair the leader must write, or None when the observed one is right.

    ``relocate``: the observed pair is not where it must live (an ImexEnsemble whose
    status does not hold it yet, only its adopted Service's annotation): write it even
    when it is right, under the same generation, so no guest wakes up for a move.
    """
    if observed is not None and observed.view == view and observed.generation >= floor:
        if not relocate:
            return None
        return PersistedView(observed.generation, view, _since(view, since))
    if observed is not None and observed.generation >= floor:
        generation = observed.generation + 1
    else:
        generation = max(now_ms, floor + 1 if floor else 0,
                         observed.generation + 1 if observed is not None else 0)
    return PersistedView(generation, view, _since(view, since))


def _since(view: GuestView, since: Mapping[int, float]) -> tuple[tuple[int, int], ...]:
    return tuple((i, int(since[i] * 1000)) for i, _ in view.pins if i in since)


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
        pair, _ = from_service(self._services(*key))
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
        written = await self._patch(key, {MEMBERSHIP_ANNOTATION: encode(pair)})
        pair_back, _ = from_service(written)
        return pair_back if pair_back is not None else pair

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
                     ) -> Mapping[str, Any] | None:
        from host_agent.kube.client import api_call

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
        written, _ = from_service(out)
        if isinstance(new_rv, str):
            self._last[key] = (informer_rv or rv, new_rv, written)
        return out

    def forget(self, key: Key) -> None:
        self._last.pop(key, None)


def wall_ms(clock: Callable[[], float] = time.time) -> int:
    return int(clock() * 1000)
