"""imex_shared.cliques: who pins whom when an ensemble spans NVLink cliques."""

from __future__ import annotations

from imex_shared.cliques import pins_for, same_group, split

PINS = {i: f"10.0.0.{10 + i}" for i in range(6)}
A, B = "u.1", "u.2"


def test_one_clique_or_none_known_pins_everyone() -> None:
    assert split({}) == {} and split({0: A, 3: A}) == {}
    assert pins_for(PINS, {}, 0) == PINS
    assert pins_for(PINS, {i: A for i in range(6)}, 2) == PINS
    assert pins_for(PINS, {0: A, 1: B}, None) == PINS  # own slot unknown: change nothing


def test_a_split_pins_only_the_own_clique_and_the_unknown() -> None:
    cliques = {0: A, 1: A, 2: A, 3: B, 4: B}  # 5 has no fabric: in every group
    assert pins_for(PINS, cliques, 0) == {i: PINS[i] for i in (0, 1, 2, 5)}
    assert pins_for(PINS, cliques, 4) == {i: PINS[i] for i in (3, 4, 5)}
    assert pins_for(PINS, cliques, 5) == PINS  # unknown itself: pins everyone
    assert same_group(cliques, 0, 5) and not same_group(cliques, 0, 3)


def test_the_own_slot_is_never_unpinned() -> None:
    # the registry has not seen our own report yet, but knows two other cliques
    assert pins_for({0: "10.0.0.10", 1: "10.0.0.11"}, {0: A, 1: B}, 0) == {0: "10.0.0.10"}
