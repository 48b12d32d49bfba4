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
  write as the rest of the status (``pair_from_status`` reads it back). When a
  CR adopts a Service that carries an annotation pair, the pair moves into the
  status under the same generation and the annotation is then removed, so
  neither kind of source can later hand out an older number (pair_io.py).

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

The ImexEnsemble's status fields (host_agent/crd/imexensemble.py):
``membershipGeneration``; ``members[]``, whose ``index`` and ``ip`` are the pins
and ``since`` (RFC 3339 with milliseconds, the leader's clock) when the slot got
its IP; ``caBundleSHA256``, the CA bundle digest guests follow (authEncryption);
``cliquesSplit``: when true, ``members[].clique`` is the split guests pin by
(``GuestView.cliques``), when false any ``clique`` there is only what reports
say. status/status.py renders them from the snapshot. A field added to
``GuestView`` needs a status field and a line in both
(tests/unit/host/persist/test_pair.py round-trips every GuestView field).

The sources that read and write the pair are pair_io.py's.
"""

from __future__ import annotations

import datetime as dt
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields
from typing import Any, Final

from host_agent.state.snapshot import GuestView

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
    if not isinstance(doc, (dict, Mapping)):
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
    if not isinstance(doc, (dict, Mapping)):
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


def annotation_text(service: Mapping[str, Any] | None) -> str | None:
    """The membership annotation's text on a Service (None: absent or not a string)."""
    meta = service.get("metadata") if service is not None else None
    annotations = meta.get("annotations") if isinstance(meta, (dict, Mapping)) else None
    text = annotations.get(MEMBERSHIP_ANNOTATION) \
        if isinstance(annotations, (dict, Mapping)) else None
    return text if isinstance(text, str) else None


def from_service(service: Mapping[str, Any] | None) -> tuple[PersistedView | None, str | None]:
    """The pair on a Service, and a problem when the annotation is unreadable."""
    text = annotation_text(service)
    if text is None:
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


def wall_ms(clock: Callable[[], float] = time.time) -> int:
    return int(clock() * 1000)


def _epoch_ms(text: object) -> int | None:
    if not isinstance(text, str):
        return None
    try:
        moment = dt.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        return None
    if moment.tzinfo is None:
        return None
    return round(moment.timestamp() * 1000)


def pair_from_status(status: Mapping[str, Any] | None
                     ) -> tuple[PersistedView | None, str | None]:
    """The pair an ImexEnsemble's status holds, and a problem when it is unreadable.

    (None, None): the status holds no pair (a new CR, or one never published).
    """
    if not isinstance(status, (dict, Mapping)) or "membershipGeneration" not in status:
        return None, None
    generation = status.get("membershipGeneration")
    if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
        return None, (f"status.membershipGeneration {generation!r} is not a non-negative "
                      "integer; the leader writes a new generation")
    members = status.get("members") or []
    if not isinstance(members, list):
        return None, "status.members is not a list; the leader writes a new generation"
    pins: list[tuple[int, str]] = []
    since: list[tuple[int, int]] = []
    cliques: list[tuple[int, str]] = []
    split = status.get("cliquesSplit") is True
    for m in members:
        index = m.get("index") if isinstance(m, (dict, Mapping)) else None
        ip = m.get("ip") if isinstance(m, (dict, Mapping)) else None
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(ip, str):
            return None, ("status.members holds an entry without an integer index and an ip; "
                          "the leader writes a new generation")
        assert isinstance(m, (dict, Mapping))
        pins.append((index, ip))
        at = _epoch_ms(m.get("since"))
        if at is not None:
            since.append((index, at))
        clique = m.get("clique")
        if split and isinstance(clique, str) and clique:
            cliques.append((index, clique))
    bundle = status.get("caBundleSHA256")
    view = GuestView(pins=tuple(sorted(pins)),
                     ca_bundle_sha256=bundle if isinstance(bundle, str) and bundle else None,
                     cliques=tuple(sorted(cliques)))
    return PersistedView(generation, view, tuple(sorted(since))), None
