"""An ImexEnsemble's persisted membership: the (generation, GuestView) pair in its status.

Issue 16 puts a CR ensemble's generation, with the membership it describes, in
the CR's status. The fields (host_agent/crd/imexensemble.py):

- ``membershipGeneration``;
- ``members[]``: ``index`` and ``ip`` are the pins, ``since`` (RFC 3339 with
  milliseconds, the leader's clock) when the slot got its IP;
- ``caBundleSHA256``: the CA bundle digest guests follow (authEncryption);
- ``cliquesSplit``: when true, ``members[].clique`` is the split guests pin by
  (``GuestView.cliques``); when false, any ``clique`` there is only what reports say.

status.py renders them from the snapshot; ``pair_from_status`` reads them back.
A field added to ``GuestView`` needs a status field and a line in both
(tests/unit/host/persist/test_pair.py round-trips every GuestView field).

Writes go through the status writer (``StatusWriter.write_pair``): one status
write carries the new pair and everything else the status says, under the
writer's budget (at most one write a second per ensemble) and with the CR's
resourceVersion as precondition, so a deposed leader's late write is refused.

Observed: the status as the CR informer shows it, or the answer to our own
write while the informer lags. An adopted Service may still carry an
annotation pair (from when it was Service-only, or from a time the CR could
not take over): the larger of the two is what replicas serve, and while the
annotation exists the pair is *misplaced*: the leader writes it into the
status (the same generation when the view is unchanged, so no guest wakes
up) and then removes the annotation. So a later ``--cascade=orphan`` starts
the Service-only numbering afresh from the wall clock instead of from an old
annotation below what guests hold.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Mapping
from typing import Any, Protocol

from host_agent.kube.objects import Key
from host_agent.persist.pair import PersistedView, ServiceAnnotationSource
from host_agent.state.store import EnsembleSnapshot, GuestView


class StatusPairWriter(Protocol):
    """What this source needs of the status writer (``status_writer.StatusWriter``)."""

    def observed_status(self, key: Key) -> Mapping[str, Any] | None: ...

    async def write_pair(self, key: Key, snap: EnsembleSnapshot) -> Mapping[str, Any]: ...

    def is_echo(self, key: Key, cr: Mapping[str, Any] | None) -> bool: ...


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
    if not isinstance(status, Mapping) or "membershipGeneration" not in status:
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
        index = m.get("index") if isinstance(m, Mapping) else None
        ip = m.get("ip") if isinstance(m, Mapping) else None
        if isinstance(index, bool) or not isinstance(index, int) or not isinstance(ip, str):
            return None, ("status.members holds an entry without an integer index and an ip; "
                          "the leader writes a new generation")
        assert isinstance(m, Mapping)
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
