"""Pins merge (registry replaces, DNS updates what it asserts), own-slot override, what a
pass writes and tells IMEX (names vs ips, NVLink cliques)."""

from __future__ import annotations

from typing import Literal

from guest_agent.config import Settings
from guest_agent.peers.discovery import View
from guest_agent.pins.merge import Known, learn, local_pins, merge_view, plan_pins
from imex_shared.model import Member

CLIQUE_A = "6a8a4a7e-1c5e-4b5a-9d0e-0b9b6c1d2e3f.1"
CLIQUE_B = "6a8a4a7e-1c5e-4b5a-9d0e-0b9b6c1d2e3f.2"


def V(source: Literal["registry", "dns"], pins: dict[int, str],
      absent: frozenset[int] = frozenset(), generation: int | None = None,
      members: tuple[Member, ...] = ()) -> View:
    return View(source, pins, absent, generation, members)


def test_registry_view_replaces_all_pins() -> None:
    current = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}
    assert merge_view(current, V("registry", {1: "10.0.0.7"})) == {1: "10.0.0.7"}


def test_dns_view_updates_only_what_it_asserts() -> None:
    current = {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}
    view = V("dns", {1: "10.0.0.7", 4: "10.0.0.5"}, frozenset({2}))
    assert merge_view(current, view) == {0: "10.0.0.1", 1: "10.0.0.7", 4: "10.0.0.5"}
    assert current == {0: "10.0.0.1", 1: "10.0.0.2", 2: "10.0.0.3"}  # not mutated


def test_local_pins_override_own_slot_only_when_known() -> None:
    pub = {0: "10.244.0.5", 1: "10.244.0.6"}
    assert local_pins(pub, 0, "10.0.2.2") == {0: "10.0.2.2", 1: "10.244.0.6"}
    assert local_pins(pub, None, "10.0.2.2") == pub
    assert local_pins(pub, 0, None) == pub


def test_learn_from_nothing_then_a_dns_view_keeps_what_only_the_registry_says() -> None:
    reg = V("registry", {0: "10.0.0.1", 1: "10.0.0.2"}, frozenset({2, 3}), 7,
            (Member(0, "10.0.0.1", vmi="rack1-0", clique=CLIQUE_A),
             Member(1, "10.0.0.2", clique=CLIQUE_B)))
    known = learn(None, reg)
    assert known == Known({0: "10.0.0.1", 1: "10.0.0.2"}, {0: "rack1-0"},
                          {0: CLIQUE_A, 1: CLIQUE_B}, "registry", 7)
    assert known.members() == [Member(0, "10.0.0.1", vmi="rack1-0"), Member(1, "10.0.0.2")]
    dns = learn(known, V("dns", {1: "10.0.0.9"}, frozenset({0}),
                         members=(Member(1, "10.0.0.9"),)))
    # DNS speaks for the slots it asserts; VMI names, cliques and the generation stay
    assert dns == Known({1: "10.0.0.9"}, {0: "rack1-0"}, {0: CLIQUE_A, 1: CLIQUE_B}, "dns", 7)
    # a registry View replaces them all, an empty one too
    assert learn(dns, V("registry", {}, frozenset(range(4)), 8)) == Known(
        {}, {}, {}, "registry", 8)


def test_plan_pins_own_slot_local_and_what_imex_is_told() -> None:
    names = Settings(ensemble="rack1", namespace="team-a", max_members=4)
    known = Known({0: "10.244.0.10", 1: "10.244.0.11", 2: "10.244.0.12"},
                  {0: "rack1-0"}, {0: CLIQUE_A, 1: CLIQUE_A, 2: CLIQUE_B}, "registry", 3)
    # masquerade: the own slot is pinned to the default-route address
    plan = plan_pins(names, known, {"10.0.2.2", "127.0.0.1"}, "rack1-0", "10.0.2.2")
    assert plan.own.index == 0 and plan.own.pin_ip == "10.0.2.2"
    assert plan.pins == {0: "10.0.2.2", 1: "10.244.0.11", 2: "10.244.0.12"}
    # the other clique is pinned away in the hosts block only; names mode tells IMEX that
    assert plan.hosts_pins == {0: "10.0.2.2", 1: "10.244.0.11"}
    assert plan.told == plan.hosts_pins
    ips = Settings(ensemble="rack1", namespace="team-a", max_members=4, mode="ips")
    plan = plan_pins(ips, known, {"10.0.2.2"}, "rack1-0", "10.0.2.2")
    assert plan.hosts_pins == {0: "10.0.2.2", 1: "10.244.0.11"}
    assert plan.told == plan.pins == {0: "10.0.2.2", 1: "10.244.0.11", 2: "10.244.0.12"}
    # own slot unknown: the published pins as they are, every clique kept
    plan = plan_pins(names, known, {"10.9.9.9"}, "elsewhere", None)
    assert plan.own.index is None
    assert plan.pins == plan.hosts_pins == plan.told == dict(known.published)
