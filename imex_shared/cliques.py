"""Which peers a member pins when an ensemble spans NVLink cliques (shared by both agents).

IMEX and multi-node NVLink work only among GPUs of one clique (FACTS.md "IMEX: the domain
view, cliques, channels"). When the members of one ensemble report two or more cliques,
each guest pins only the members of its own clique; the others are pinned to 127.0.0.2,
so IMEX never tries a link that cannot work. The nodes file stays as it is, so this costs
a SIGUSR1, never a restart.

Members without fabric information (no GPU fabric, no report yet, or a report from before
the slot's current address) are in every group: pinned by all and pinning all. That is
today's behaviour for an ensemble where nobody reported a fabric, and it keeps a booting
member from being cut off (and the generation from churning) before its first report.

Pure functions; the registry renders ``/hosts?member=i`` with them and the guest applies
the same rule to what the registry tells it, so both give the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping


def split(cliques: Mapping[int, str]) -> dict[int, str]:
    """The known cliques when there are two or more of them, else {} (nothing to split)."""
    return dict(cliques) if len(set(cliques.values())) > 1 else {}


def same_group(cliques: Mapping[int, str], a: int, b: int) -> bool:
    """Whether ``a`` and ``b`` should reach each other (either one's clique unknown: yes)."""
    ca, cb = cliques.get(a), cliques.get(b)
    return ca is None or cb is None or ca == cb


def pins_for(pins: Mapping[int, str], cliques: Mapping[int, str], own: int | None
             ) -> dict[int, str]:
    """What member ``own`` pins: ``pins`` without the members of other cliques.

    ``cliques`` is index -> clique key of the members whose clique is known; only a split
    (two or more keys) removes anything, and never ``own`` itself.
    """
    groups = split(cliques)
    if own is None or not groups or groups.get(own) is None:
        return dict(pins)
    return {i: ip for i, ip in pins.items() if i == own or same_group(groups, own, i)}
