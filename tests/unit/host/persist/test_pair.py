"""The persisted (generation, GuestView) pair: its two homes, and the leader's rules (pure)."""

from __future__ import annotations

import dataclasses
from dataclasses import replace
from typing import Any

import pytest

from host_agent.ensembles.cr_spec import Declaration, parse_ensemble_cr
from host_agent.kube.leadership import ALWAYS
from host_agent.persist.pair import (
    MEMBERSHIP_ANNOTATION,
    PersistedView,
    decode,
    encode,
    next_pair,
    pair_from_status,
)
from host_agent.persist.pair_io import ServiceAnnotationSource, StatusPairSource
from host_agent.state.snapshot import CaPublished, EnsembleSnapshot, GuestView
from host_agent.state.store import State
from host_agent.status.status import desired_status
from imex_shared.model import EnsembleId, Member
from tests.host_support.ensembles import CR_UID, imex_ensemble

ENS = EnsembleId("rack1", "gb200")
KEY = ("rack1", "gb200")
T0 = 1_796_000_000.0
UUID = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10"

#: a view in which every GuestView field differs from its default
FULL = GuestView(pins=((0, "10.0.0.1"), (1, "10.0.0.2"), (3, "10.0.0.4")),
                 ca_bundle_sha256="ab" * 32,
                 cliques=((0, f"{UUID}.1"), (1, f"{UUID}.1"), (3, f"{UUID}.2")))
SINCE = {0: T0 - 30.125, 1: T0 - 2.5, 3: T0}


def cr_spec() -> Any:
    spec = parse_ensemble_cr(imex_ensemble(maxMembers=4)).spec
    assert spec is not None
    return replace(spec, uid="svc-uid")


def served(view: GuestView, generation: int) -> EnsembleSnapshot:
    state = State(clock=lambda: T0)
    ca = CaPublished("cd" * 32, view.ca_bundle_sha256) if view.ca_bundle_sha256 else None
    members = [Member(i, ip, vmi=f"gb200-{i}", phase="Running", ready=True)
               for i, ip in view.pins]
    snap, _ = state.set_observed(cr_spec(), members, [], None, generation, view, SINCE, ca=ca)
    return snap


def test_every_guest_view_field_is_exercised_here() -> None:
    """A field added to GuestView must be persisted in both homes: this test's view
    must then set it, or the round trips below prove nothing about it."""
    for f in dataclasses.fields(GuestView):
        assert getattr(FULL, f.name) != f.default, f"set {f.name} in FULL"


def test_the_pair_round_trips_through_an_imexensemble_status() -> None:
    snap = served(FULL, 1_796_000_000_123)
    decl = Declaration("rack1", "gb200", CR_UID, 2, snap.spec)
    status = desired_status(decl, snap, T0 + 1, 120.0)
    pair, problem = pair_from_status(status)
    assert problem is None
    assert pair == PersistedView(1_796_000_000_123, FULL,
                                 tuple((i, round(t * 1000)) for i, t in sorted(SINCE.items())))
    assert status["cliquesSplit"] is True
    assert [m["since"] for m in status["members"]] == [
        "2026-11-30T00:52:49.875Z", "2026-11-30T00:53:17.500Z", "2026-11-30T00:53:20.000Z"]


def test_the_pair_round_trips_through_the_annotation() -> None:
    pair = PersistedView(7, FULL, ((0, 1), (1, 2), (3, 3)))
    assert decode(encode(pair)) == pair


def test_one_clique_is_no_split_whatever_members_say() -> None:
    """Without a split, members[].clique is what reports say: not part of the pair."""
    status = {"membershipGeneration": 5, "cliquesSplit": False,
              "members": [{"index": 0, "ip": "10.0.0.1", "clique": f"{UUID}.1"},
                          {"index": 1, "ip": "10.0.0.2", "clique": f"{UUID}.2"}]}
    pair, _ = pair_from_status(status)
    assert pair is not None and pair.view.cliques == ()
    assert pair.view.pins == ((0, "10.0.0.1"), (1, "10.0.0.2"))


@pytest.mark.parametrize(("status", "words"), [
    ({"membershipGeneration": "7"}, "membershipGeneration '7'"),
    ({"membershipGeneration": -1}, "non-negative"),
    ({"membershipGeneration": 3, "members": {"0": "x"}}, "not a list"),
    ({"membershipGeneration": 3, "members": [{"index": "0", "ip": "10.0.0.1"}]},
     "integer index"),
])
def test_an_unreadable_status_pair_is_named(status: dict[str, Any], words: str) -> None:
    pair, problem = pair_from_status(status)
    assert pair is None and problem is not None and words in problem


def test_no_pair_before_the_first_write() -> None:
    assert pair_from_status(None) == (None, None)
    assert pair_from_status({"observedGeneration": 1, "conditions": []}) == (None, None)


def test_next_pair_rules() -> None:
    view = GuestView(pins=((0, "10.0.0.1"),))
    moved = GuestView(pins=((0, "10.0.0.9"),))
    since = {0: 100.0}
    seen = PersistedView(50, view, ((0, 100_000),))
    assert next_pair(seen, view, since, floor=50, now_ms=9) is None
    assert next_pair(seen, moved, since, floor=50, now_ms=9) == PersistedView(
        51, moved, ((0, 100_000),))
    # below what this process served (a hand edit): never backwards
    assert next_pair(seen, view, since, floor=60, now_ms=9).generation == 61  # type: ignore[union-attr]
    # nothing observed: the wall clock, and never below the floor
    assert next_pair(None, view, since, floor=0, now_ms=1000).generation == 1000  # type: ignore[union-attr]
    assert next_pair(None, view, since, floor=5000, now_ms=1000).generation == 5001  # type: ignore[union-attr]


def test_relocating_a_pair_keeps_its_generation_unless_the_view_moved() -> None:
    view = GuestView(pins=((0, "10.0.0.1"),))
    seen = PersistedView(50, view, ((0, 100_000),))
    assert next_pair(seen, view, {0: 100.0}, floor=50, now_ms=9, relocate=True) == seen
    moved = next_pair(seen, GuestView(pins=((0, "10.0.0.2"),)), {0: 101.0}, floor=50,
                      now_ms=9, relocate=True)
    assert moved is not None and moved.generation == 51


class _Writer:
    """The status writer as StatusPairSource sees it (observed status only)."""

    def __init__(self, status: dict[str, Any] | None) -> None:
        self.status = status

    def observed_status(self, key: tuple[str, str]) -> dict[str, Any] | None:
        return self.status

    async def write_pair(self, key: tuple[str, str], snap: EnsembleSnapshot) -> dict[str, Any]:
        raise AssertionError("not written here")

    def is_echo(self, key: tuple[str, str], cr: object) -> bool:
        return False


def annotated(pair: PersistedView | None) -> ServiceAnnotationSource:
    meta: dict[str, Any] = {"name": "gb200", "namespace": "rack1", "resourceVersion": "5"}
    if pair is not None:
        meta["annotations"] = {MEMBERSHIP_ANNOTATION: encode(pair)}
    svc = {"metadata": meta}
    return ServiceAnnotationSource(None, lambda ns, name: svc, ALWAYS)


def status_of(generation: int) -> dict[str, Any]:
    return {"membershipGeneration": generation, "members": [{"index": 0, "ip": "10.0.0.1"}]}


def test_a_cr_serves_the_larger_of_its_status_and_an_adopted_annotation() -> None:
    view = GuestView(pins=((0, "10.0.0.1"),))
    old = PersistedView(40, view)
    # adopted: nothing in status yet, the Service's pair is served, and must move
    src = StatusPairSource(_Writer(None), annotated(old))
    assert src.observed(KEY) == old and src.misplaced(KEY)
    # the status holds a newer one: it wins; the annotation is still to be removed
    src = StatusPairSource(_Writer(status_of(41)), annotated(old))
    assert src.observed(KEY).generation == 41 and src.misplaced(KEY)  # type: ignore[union-attr]
    # the annotation is newer (the Service worked alone for a while): it wins
    src = StatusPairSource(_Writer(status_of(39)), annotated(old))
    assert src.observed(KEY) == old
    # only the status: nothing misplaced
    src = StatusPairSource(_Writer(status_of(41)), annotated(None))
    assert src.observed(KEY).generation == 41 and not src.misplaced(KEY)  # type: ignore[union-attr]


def test_the_annotation_is_parsed_again_only_when_its_text_changes() -> None:
    """A pass over an unchanged ensemble compares a digest of the text with the last one
    (the steady phase's profile had decode as a tenth of the agent's CPU); a new text, a
    removed annotation or an unreadable one is read as it is now."""
    svc: dict[str, Any] = {"metadata": {"name": "gb200", "namespace": "rack1",
                                        "resourceVersion": "5"}}
    src = ServiceAnnotationSource(None, lambda ns, name: svc, ALWAYS)
    one, two = PersistedView(7, FULL), PersistedView(8, FULL)
    svc["metadata"]["annotations"] = {MEMBERSHIP_ANNOTATION: encode(one)}
    first = src.observed(KEY)
    assert first == one
    # an equal text (a new Service object from the informer) is not decoded again
    svc["metadata"] = {**svc["metadata"],
                       "annotations": {MEMBERSHIP_ANNOTATION: "".join(encode(one))}}
    assert src.observed(KEY) is first
    svc["metadata"]["annotations"] = {MEMBERSHIP_ANNOTATION: encode(two)}
    assert src.observed(KEY) == two
    svc["metadata"]["annotations"] = {MEMBERSHIP_ANNOTATION: "{not json"}
    assert src.observed(KEY) is None
    del svc["metadata"]["annotations"]
    assert src.observed(KEY) is None
    svc["metadata"]["annotations"] = {MEMBERSHIP_ANNOTATION: encode(one)}
    assert src.observed(KEY) == one
    src.forget(KEY)
    assert src.observed(KEY) == one
