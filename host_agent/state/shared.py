"""Two ensembles in one NVLink clique (pure): the index, and what the problem says.

IMEX domains of two ensembles cannot share one NVLink partition: ``cuMemSetAccess``
fails with NOT_SUPPORTED (the DRA driver's issue 892; FACTS.md "The workload's side").
When published members of two different ensembles report the same
``<cluster_uuid>.<clique_id>``, each ensemble's snapshot carries ``shared``: per clique,
the other ensembles that report it. Members with no clique reported never count
(``snapshot.member_cliques``: only a report that speaks for the member now).

A clique id comes from the guest, so a tenant could forge one to flag someone else's
ensemble: the finding is informational (``CliqueShared``, an Event, a registry
problem), never Degraded or not Ready, and it names the other ensemble only when both
are in the same namespace.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from host_agent.state.snapshot import EnsembleSnapshot, member_cliques
from imex_shared.model import EnsembleId

#: per clique key: the other ensembles that report it
Shared = tuple[tuple[str, tuple[EnsembleId, ...]], ...]

PROBLEM_PREFIX = "NVLink clique "


def clique_members(snap: EnsembleSnapshot) -> dict[str, tuple[int, ...]]:
    """clique key -> the published members that report it."""
    out: dict[str, list[int]] = {}
    for index, key in sorted(member_cliques(snap.members, snap.reports).items()):
        out.setdefault(key, []).append(index)
    return {k: tuple(v) for k, v in out.items()}


def shared_of(ens: EnsembleId, cliques: Iterable[str],
              index: Mapping[str, set[EnsembleId]]) -> Shared:
    """What ``ens`` shares: its cliques that other ensembles report too, sorted."""
    out = []
    for key in sorted(set(cliques)):
        others = tuple(sorted((e for e in index.get(key, ()) if e != ens),
                              key=lambda e: e.key))
        if others:
            out.append((key, others))
    return tuple(out)


def other_name(ens: EnsembleId, other: EnsembleId) -> str:
    """The other ensemble as this one may see it: by name in the same namespace only."""
    return f"ImexEnsemble {other.name}" if other.namespace == ens.namespace else \
        "an ensemble in another namespace"


def shared_messages(snap: EnsembleSnapshot) -> list[str]:
    """One line per shared clique (the registry problem and the condition's message)."""
    members = clique_members(snap)
    out = []
    for key, others in snap.shared:
        names = sorted({other_name(snap.ens, o) for o in others})
        idx = ", ".join(map(str, members.get(key, ())))
        out.append(f"{PROBLEM_PREFIX}{key} (members {idx or 'none'}) is also reported by "
                   f"{' and '.join(names)}: IMEX domains of two ensembles cannot share one "
                   "NVLink partition (cuMemSetAccess fails with NOT_SUPPORTED); the clique id "
                   "comes from the guests, so this is informational")
    return out


def is_shared_problem(text: str) -> bool:
    return text.startswith(PROBLEM_PREFIX)
