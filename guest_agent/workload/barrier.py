"""When a job may start: ``wait --for local|domain`` and ``members`` (pure).

ComputeDomain gates a pod until its node's IMEX daemon is READY, and with DNS names
leaves the domain-wide barrier to the workload (FACTS.md "The workload's side"). In a VM
nothing gates at all, so the agent offers both:

- ``local``: this VM's IMEX says READY (``nvidia-imex-ctl -q``) and every configured
  channel node exists;
- ``domain``: at least N members are published (N: ``--min-members``, else
  ``expected_members``, else ``max_members``: at boot a VM that sees only itself is not a
  domain), every published member of this VM's own clique reports READY, and every link
  among them is CONNECTED.

The domain facts come from the registry's domain view (``GET .../domain``: every
member's own report) or, when the registry cannot be reached, from this VM's
``nvidia-imex-ctl -N -j`` with the members the agent last applied (its status file).
Members whose clique is unknown are in every clique (``imex_shared.cliques``).

``members`` prints the published members of this VM's clique from the agent's status
file: the members the agent wrote into the nodes file and /etc/hosts, so a launcher's
peer list comes from the same source as IMEX's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from imex_shared.cliques import same_group, split

READY: Final = "READY"
CONNECTED: Final = "CONNECTED"
#: ``nvidia-imex-ctl -q`` states (FACTS.md): anything else is garbage, not a state
STATES: Final = frozenset({"INITIALIZING", "STARTING_AUTH_SERVER", "WAITING_FOR_PEERS",
                           "WAITING_FOR_RECOVERY", "INIT_GPU", "READY", "SHUTTING_DOWN",
                           "UNAVAILABLE"})
_LIST_MAX = 12

#: exit codes of ``wait`` (docs/guest-agent.md "Exit codes")
EXIT_READY: Final = 0
EXIT_ERROR: Final = 1
EXIT_USAGE: Final = 2
EXIT_TIMEOUT: Final = 3
EXIT_NOT_APPLICABLE: Final = 4


class BarrierError(ValueError):
    """Input that waiting cannot fix (a ctl printing garbage); exit 1."""


@dataclass(frozen=True, slots=True)
class MemberFact:
    index: int
    name: str
    ip: str | None = None
    clique: str | None = None
    #: the member's IMEX state as its own report (or the local ctl) says; None: unknown
    state: str | None = None


@dataclass
class DomainFacts:
    source: Literal["registry", "local"]
    members: dict[int, MemberFact] = field(default_factory=dict)
    #: (from, to) -> state, from the ``from`` member's own row
    links: dict[tuple[int, int], str] = field(default_factory=dict)
    #: members whose link row is known
    rows: set[int] = field(default_factory=set)
    own: int | None = None
    own_clique: str | None = None


@dataclass(frozen=True, slots=True)
class Verdict:
    ready: bool
    missing: tuple[str, ...] = ()

    def text(self) -> str:
        return "ready" if self.ready else "; ".join(self.missing)


def _named(items: Sequence[str]) -> str:
    more = len(items) - _LIST_MAX
    return ", ".join(items[:_LIST_MAX]) + (f" and {more} more" if more > 0 else "")


def own_group(facts: DomainFacts) -> list[int]:
    """The published members of this VM's clique (all of them when it is unknown)."""
    cliques = {i: m.clique for i, m in facts.members.items() if m.clique}
    own = facts.own
    if own is not None and own not in cliques and facts.own_clique:
        cliques[own] = facts.own_clique
    groups = split(cliques)
    if own is None or own not in groups:
        if facts.own_clique and groups:  # own slot unknown, own clique known
            return sorted(i for i in facts.members
                          if groups.get(i) in (None, facts.own_clique))
        return sorted(facts.members)
    return sorted(i for i in facts.members if same_group(groups, own, i))


def judge_domain(facts: DomainFacts, min_members: int) -> Verdict:
    """The ``domain`` barrier (module docstring); what is missing, by member and link."""
    missing: list[str] = []
    published = len(facts.members)
    if published < min_members:
        missing.append(f"{published} of {min_members} members published")
    group = own_group(facts)
    not_ready = [f"{i} ({facts.members[i].state or 'no report'})" for i in group
                 if facts.members[i].state != READY]
    if not_ready:
        missing.append(f"not READY: member {_named(not_ready)}")
    links = [f"{a}->{b} ({facts.links.get((a, b), 'unknown') if a in facts.rows else 'no row'})"
             for a in group for b in group
             if a != b and (a not in facts.rows or facts.links.get((a, b)) != CONNECTED)]
    if links:
        missing.append(f"links not CONNECTED: {_named(links)}")
    return Verdict(not missing, tuple(missing))


def judge_local(state: str, channels: Sequence[int], present: Sequence[int]) -> Verdict:
    """The ``local`` barrier; BarrierError when ``state`` is not an IMEX state."""
    word = state.strip()
    if word not in STATES:
        raise BarrierError(f"nvidia-imex-ctl -q printed {word[:40]!r}, not an IMEX state")
    missing = []
    if word != READY:
        missing.append(f"IMEX is {word}, not READY")
    absent = [n for n in channels if n not in present]
    if absent:
        missing.append(f"channel(s) {', '.join(map(str, absent))} missing")
    return Verdict(not missing, tuple(missing))


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def from_registry(doc: object, own: int | None, own_clique: str | None) -> DomainFacts:
    """``GET .../domain`` (host_agent/registry/domain_view.domain_json) into facts;
    BarrierError when it is not that document."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("members"), list):
        raise BarrierError("the registry's domain view has no members list")
    facts = DomainFacts("registry", own=own, own_clique=own_clique)
    silent = {i for i in doc.get("silent") or () if isinstance(i, int)}
    for m in doc["members"]:
        i = _int(m.get("index")) if isinstance(m, Mapping) else None
        if i is None:
            raise BarrierError("the registry's domain view has a member without an index")
        state = m.get("imex_state")
        clique = m.get("clique")
        facts.members[i] = MemberFact(
            i, str(m.get("slot") or i), clique=clique if isinstance(clique, str) else None,
            state=None if i in silent or not isinstance(state, str) else state)
    for link in doc.get("links") or ():
        if not isinstance(link, Mapping):
            continue
        a, b, s = _int(link.get("from")), _int(link.get("to")), link.get("state")
        if a is not None and b is not None and isinstance(s, str):
            facts.links[(a, b)] = s
            facts.rows.add(a)
    return facts


def from_local(doc: object, members: Sequence[Mapping[str, Any]], own: int | None,
               own_clique: str | None) -> DomainFacts:
    """``nvidia-imex-ctl -N -j`` and the status file's members into facts; BarrierError
    when ``doc`` is not ``-N -j`` output."""
    if not isinstance(doc, Mapping) or not isinstance(doc.get("nodes"), Mapping):
        raise BarrierError("nvidia-imex-ctl -N -j printed JSON without a nodes object")
    nodes: Mapping[str, Any] = doc["nodes"]
    facts = DomainFacts("local", own=own, own_clique=own_clique)
    for m in members:
        i = _int(m.get("index"))
        if i is None:
            continue
        node = nodes.get(str(i))
        state = node.get("status") if isinstance(node, Mapping) else None
        clique = m.get("clique")
        facts.members[i] = MemberFact(i, str(m.get("slot") or i), ip=m.get("ip"),
                                      clique=clique if isinstance(clique, str) else None,
                                      state=state if isinstance(state, str) else None)
        conns = node.get("connections") if isinstance(node, Mapping) else None
        if isinstance(conns, Mapping) and isinstance(state, str) and state != "UNAVAILABLE":
            facts.rows.add(i)
            for j, c in conns.items():
                s = c.get("status") if isinstance(c, Mapping) else None
                if str(j).isdigit() and isinstance(s, str):
                    facts.links[(i, int(j))] = s
    return facts


def member_facts(members: Sequence[Mapping[str, Any]]) -> DomainFacts:
    facts = DomainFacts("local")
    for m in members:
        i = _int(m.get("index"))
        if i is None:
            continue
        clique = m.get("clique")
        ip = m.get("ip")
        facts.members[i] = MemberFact(i, str(m.get("slot") or i),
                                      ip=ip if isinstance(ip, str) else None,
                                      clique=clique if isinstance(clique, str) else None)
    return facts


Format = Literal["hostfile", "json", "names"]


def render_members(facts: DomainFacts, fmt: Format, addresses: bool, slots: int) -> str:
    """``members``: this VM's clique, one line per member (or a JSON list)."""
    group = [facts.members[i] for i in own_group(facts)]
    if fmt == "json":
        return json.dumps([{"index": m.index, "name": m.name, "ip": m.ip, "clique": m.clique}
                           for m in group], indent=2) + "\n"
    keys = [(m.ip or m.name) if addresses else m.name for m in group]
    if fmt == "names":
        return "".join(f"{k}\n" for k in keys)
    return "".join(f"{k} slots={slots}\n" for k in keys)
