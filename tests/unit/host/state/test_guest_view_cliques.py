"""GuestView and the generation: cliques wake the guests exactly when what they write changes."""

from __future__ import annotations

from host_agent.registry import views
from host_agent.state.snapshot import EnsembleSpec, GuestReport
from host_agent.state.store import State
from imex_shared.hostsfile import read_block
from imex_shared.model import EnsembleId, Member

ENS = EnsembleId("rack-a", "gb200")
SPEC = EnsembleSpec(ENS, 18, 50000)
UUID = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10"


class Clock:
    def __init__(self) -> None:
        self.t = 1_800_000_000.0

    def __call__(self) -> float:
        return self.t


def members(n: int) -> list[Member]:
    return [Member(i, f"10.0.0.{10 + i}") for i in range(n)]


def rep(clock: Clock, clique: int | None) -> GuestReport:
    fabric = {"cluster_uuid": UUID, "clique_id": clique} if clique is not None else None
    return GuestReport(clock(), "10.0.0.1", {"imex_state": "READY", "fabric": fabric})


def test_one_clique_reported_member_by_member_never_moves_the_generation() -> None:
    clock = Clock()
    state = State(clock=clock)
    snap, _ = state.set(SPEC, members(18), [])
    g = snap.generation
    for i in range(18):
        clock.t += 1
        state.report(ENS, i, rep(clock, 1))
    after = state.get(ENS)
    assert after is not None and after.generation == g  # nobody writes anything new
    assert views.hosts(after, 5) == views.hosts(after)


def test_a_second_clique_moves_it_once_per_change_of_what_guests_write() -> None:
    clock = Clock()
    state = State(clock=clock)
    g = state.set(SPEC, members(18), [])[0].generation
    clock.t += 1
    for i in range(12):
        state.report(ENS, i, rep(clock, 1))
    assert state.get(ENS).generation == g  # type: ignore[union-attr]
    state.report(ENS, 12, rep(clock, 2))  # the split appears: 0-11 unpin 12
    assert state.get(ENS).generation == g + 1  # type: ignore[union-attr]
    state.report(ENS, 12, rep(clock, 2))  # the same again: nothing new
    assert state.get(ENS).generation == g + 1  # type: ignore[union-attr]
    for i in range(13, 18):
        state.report(ENS, i, rep(clock, 2))  # each one is unpinned by 0-11
    snap = state.get(ENS)
    assert snap is not None and snap.generation == g + 6
    mine = read_block(views.hosts(snap, 3), ENS)
    theirs = read_block(views.hosts(snap, 15), ENS)
    assert mine == {i: f"10.0.0.{10 + i}" if i < 12 else "127.0.0.2" for i in range(18)}
    assert theirs == {i: f"10.0.0.{10 + i}" if i >= 12 else "127.0.0.2" for i in range(18)}
    # heartbeats of a split ensemble change nothing
    clock.t += 10
    for i in range(18):
        state.report(ENS, i, rep(clock, 1 if i < 12 else 2))
    assert state.get(ENS).generation == g + 6  # type: ignore[union-attr]


def test_a_new_address_forgets_the_clique_until_the_new_vm_reports() -> None:
    clock = Clock()
    state = State(clock=clock)
    state.set(SPEC, members(3), [])
    clock.t += 1
    for i, c in ((0, 1), (1, 1), (2, 2)):
        state.report(ENS, i, rep(clock, c))
    g = state.get(ENS).generation  # type: ignore[union-attr]
    clock.t += 1
    moved = [*members(2), Member(2, "10.0.0.99")]  # slot 2's VM came back elsewhere
    snap, changed = state.set(SPEC, moved, [])
    assert changed and snap.generation == g + 1
    assert read_block(views.hosts(snap, 0), ENS)[2] == "10.0.0.99"  # type: ignore[index]
    clock.t += 1
    snap = state.report(ENS, 2, rep(clock, 2))  # type: ignore[assignment]
    assert snap.generation == g + 2
    assert read_block(views.hosts(snap, 0), ENS)[2] == "127.0.0.2"  # type: ignore[index]


def test_with_observed_pairs_a_split_is_the_leaders_to_persist_not_counted_here() -> None:
    clock = Clock()
    state = State(clock=clock)
    news: list[EnsembleId] = []
    state.on_view_news = news.append
    view, since = state.desired_view(SPEC, members(3))
    state.set_observed(SPEC, members(3), [], None, 500, view, since)
    clock.t += 1
    state.report(ENS, 0, rep(clock, 1))
    state.report(ENS, 1, rep(clock, 1))
    assert news == []
    state.report(ENS, 2, rep(clock, 2))
    assert news == [ENS]  # the reconciler queues a pass ...
    after = state.get(ENS)
    assert after is not None and after.generation == 500 and after.cliques == ()
    wanted, since = state.desired_view(SPEC, members(3))  # ... where the leader sees it
    a, b = f"{UUID}.1", f"{UUID}.2"
    assert wanted.cliques == ((0, a), (1, a), (2, b))
    served, changed = state.set_observed(SPEC, members(3), [], None, 501, wanted, since)
    assert changed and served.cliques == wanted.cliques
    assert read_block(views.hosts(served, 2), ENS)[0] == "127.0.0.2"  # type: ignore[index]
