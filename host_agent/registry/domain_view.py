"""The IMEX domain of one ensemble, aggregated from its members' own reports (pure).

``aggregate(snapshot, now, stale_after)`` is a function of its arguments only, so the
``/domain`` JSON, the ``?format=matrix`` text, the page and the metrics are tested byte for
byte without a server. The rules (issue 17, docs/host-agent.md "The IMEX domain"):

- A member *reports* when its last report is not older than ``stale_after`` and came
  after the slot got its current address. Link i->j is taken only from member i's own
  report (the registry keeps nothing else of the ``-N -j`` view).
- Pairs are *expected* when both are published and in the same clique; a member
  whose clique is unknown is in every clique (``imex_shared.cliques``).
- ``UNKNOWN``: no published member reports; ``DOWN``: none of the reporting members is
  READY (or the members disagree on the nodes file with no majority); ``DEGRADED``: a
  member not READY, an expected link not CONNECTED, or a member whose nodes file
  differs from the majority's (IMEX members with different node maps cannot form one
  domain); ``UNKNOWN`` also when nothing is known to be wrong but some member's row is
  missing (silent, stale, or no ``-N -j`` view); else ``UP``.
- Partitions: connected components over links CONNECTED both ways between members of
  one clique (a link across cliques is no NVLink domain, even with its TCP connection
  up). Asymmetric: i sees j CONNECTED while j's own report says it does not see i.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from host_agent.state.snapshot import EnsembleSnapshot, GuestReport, report_counts, served_cliques
from imex_shared.cliques import same_group, split
from imex_shared.imex_domain import (
    CONNECTED,
    OTHER_CLIQUE_CELL,
    SELF_CELL,
    STATE_LETTERS,
    UNKNOWN_CELL,
    letter,
    matrix_lines,
)

READY: Final = "READY"
STATUSES: Final = ("UP", "DEGRADED", "DOWN", "UNKNOWN")
#: ``imex_ensemble_links`` label values: the legend's words, any other word, no row.
LINK_STATES: Final = (*STATE_LETTERS, "OTHER", "UNKNOWN")
_LIST_MAX = 12  # members or links named in one problem line before "and N more"


@dataclass(frozen=True, slots=True)
class MemberDomain:
    index: int
    slot: str
    imex_state: str | None
    clique: str | None
    channel0: bool | None
    reported_at: float | None
    #: the report speaks for the member now (fresh, and after its current address)
    reporting: bool
    #: its own link row, when it reports with a ``-N -j`` view
    row: tuple[str | None, ...] | None


@dataclass(frozen=True, slots=True)
class DomainView:
    status: str
    generation: int
    members: tuple[MemberDomain, ...]
    #: (from, to, state) from the ``from`` member's own fresh row, published peers only
    links: tuple[tuple[int, int, str], ...]
    missing: tuple[tuple[int, int], ...]
    partitions: tuple[tuple[int, ...], ...]
    asymmetric: tuple[tuple[int, int], ...]
    #: published members without a fresh report
    silent: tuple[int, ...]
    cliques: Mapping[str, tuple[int, ...]]
    problems: tuple[str, ...]
    #: expected pairs by state (``imex_ensemble_links``): UNKNOWN when the row is missing
    link_counts: Mapping[str, int]
    #: index -> clique of the members when the cliques split the ensemble, else empty
    groups: Mapping[int, str]
    #: index -> own link row of the members that report one
    rows: Mapping[int, tuple[str | None, ...]]

    def cell(self, src: int, dst: int) -> str:
        """The matrix letter of link src->dst (see docs/host-agent.md "The link matrix")."""
        if src == dst:
            return SELF_CELL
        if not same_group(self.groups, src, dst):
            return OTHER_CLIQUE_CELL
        row = self.rows.get(src)
        if row is None:
            return UNKNOWN_CELL
        return letter(row[dst] if dst < len(row) else None)


def _ranges(indices: Sequence[int]) -> str:
    """``0-11, 14, 16-17``: indices as compact ranges."""
    out: list[str] = []
    run: list[int] = []
    for i in sorted(indices):
        if run and i == run[-1] + 1:
            run.append(i)
            continue
        if run:
            out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [i]
    if run:
        out.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ", ".join(out)


def _pairs(pairs: Sequence[tuple[int, int]]) -> str:
    named = ", ".join(f"{a}->{b}" for a, b in pairs[:_LIST_MAX])
    more = len(pairs) - _LIST_MAX
    return named + (f" and {more} more" if more > 0 else "")


def _components(nodes: Iterable[int], edges: Iterable[tuple[int, int]]) -> list[tuple[int, ...]]:
    parent = {n: n for n in nodes}

    def find(n: int) -> int:
        while parent[n] != n:
            parent[n] = parent[parent[n]]
            n = parent[n]
        return n

    for a, b in edges:
        ra, rb = find(a), find(b)
        if ra != rb:
            parent[max(ra, rb)] = min(ra, rb)
    groups: dict[int, list[int]] = {}
    for n in parent:
        groups.setdefault(find(n), []).append(n)
    return sorted((tuple(sorted(g)) for g in groups.values()), key=lambda g: g[0])


def _drift(reporting: Mapping[int, GuestReport]) -> tuple[list[int], str | None, bool]:
    """(members whose nodes file differs from the majority's, that digest, no majority)."""
    shas = {i: r.fields.get("nodes_config_sha256") for i, r in reporting.items()}
    known = {i: s for i, s in shas.items() if isinstance(s, str)}
    counts = Counter(known.values())
    if len(counts) < 2:
        return [], None, False
    (top, n), (_, second) = counts.most_common(2)
    if n == second:
        return sorted(known), None, True
    return sorted(i for i, s in known.items() if s != top), top, False


def aggregate(snap: EnsembleSnapshot, now: float, stale_after: float) -> DomainView:
    """The domain view of ``snap`` at ``now``; see the module docstring for the rules."""
    cliques = served_cliques(snap)
    groups = split(cliques)
    published = [p.index for p in snap.members]
    members: list[MemberDomain] = []
    reporting: dict[int, GuestReport] = {}
    for pub in snap.members:
        r = snap.reports.get(pub.index)
        fresh = r is not None and report_counts(pub, r) and now - r.received_at <= stale_after
        if fresh:
            assert r is not None
            reporting[pub.index] = r
        state = r.fields.get("imex_state") if r is not None else None
        channel = r.fields.get("imex_channel0") if r is not None else None
        members.append(MemberDomain(
            index=pub.index, slot=snap.ens.slot(pub.index),
            imex_state=state if isinstance(state, str) else None,
            clique=cliques.get(pub.index),
            channel0=channel if isinstance(channel, bool) else None,
            reported_at=r.received_at if r is not None else None,
            reporting=fresh, row=r.links if fresh and r is not None else None))
    rows = {m.index: m.row for m in members if m.row is not None}

    def state_of(src: int, dst: int) -> str | None:
        row = rows.get(src)
        return row[dst] if row is not None and dst < len(row) else None

    links = tuple((a, b, s) for a in published if a in rows for b in published
                  if b != a and (s := state_of(a, b)) is not None)
    counts: Counter[str] = Counter()
    missing: list[tuple[int, int]] = []
    for a in published:
        for b in published:
            if a == b or not same_group(groups, a, b):
                continue
            if a not in rows:
                counts["UNKNOWN"] += 1
                continue
            s = state_of(a, b)
            counts[s if s is not None and s in STATE_LETTERS else "OTHER"] += 1
            if s != CONNECTED:
                missing.append((a, b))
    # a partition is a domain IMEX can form: a link across cliques joins none, even when its
    # TCP connection is up (one made while a new member's clique was not yet known)
    both = [(a, b) for a, b, s in links if a < b and s == CONNECTED
            and state_of(b, a) == CONNECTED and same_group(groups, a, b)]
    asym = tuple((a, b) for a, b, s in links
                 if s == CONNECTED and b in rows and state_of(b, a) != CONNECTED)
    silent = tuple(i for i in published if i not in reporting)
    not_ready = [i for i, r in reporting.items() if r.fields.get("imex_state") != READY]
    drifted, majority, no_majority = _drift(reporting)

    problems: list[str] = []
    if groups:
        by_clique: dict[str, list[int]] = {}
        for i, key in sorted(groups.items()):
            by_clique.setdefault(key, []).append(i)
        named = "; ".join(f"{k}: members {_ranges(v)}" for k, v in sorted(
            by_clique.items(), key=lambda kv: kv[1][0]))
        unknown = [i for i in published if i not in groups]
        problems.append(
            f"the members span {len(by_clique)} NVLink cliques ({named}); IMEX works only "
            f"within a clique, so each member pins only its own clique's peers"
            + (f" (members {_ranges(unknown)} report no fabric and are pinned by all)"
               if unknown else ""))
    if drifted:
        if no_majority:
            problems.append(
                f"configuration drift: members {_ranges(drifted)} report different "
                f"nodes_config.cfg digests and none has a majority; IMEX members with "
                f"different node maps cannot form one domain")
        else:
            problems.append(
                f"configuration drift: members {_ranges(drifted)} report a nodes_config.cfg "
                f"that differs from the other members' ({(majority or '')[:12]}...); IMEX "
                f"members with different node maps cannot form one domain")
    if not_ready:
        problems.append(f"IMEX not READY on members {_ranges(sorted(not_ready))}")
    if missing:
        problems.append(f"{len(missing)} links not CONNECTED: {_pairs(missing)}")
    if asym:
        problems.append(f"asymmetric links (the first sees the second, not back): "
                        f"{_pairs(list(asym))}")
    if silent:
        problems.append(f"no fresh report (none, or older than {stale_after:g}s) from members "
                        f"{_ranges(list(silent))}")
    no_row = [i for i in reporting if i not in rows]
    if no_row:
        problems.append(f"members {_ranges(sorted(no_row))} report no nvidia-imex-ctl -N -j view")

    if not reporting:
        status = "UNKNOWN"
    elif not any(r.fields.get("imex_state") == READY for r in reporting.values()) or no_majority:
        status = "DOWN"
    elif not_ready or missing or drifted:
        status = "DEGRADED"
    elif silent or no_row:
        status = "UNKNOWN"
    else:
        status = "UP"
    clique_groups: dict[str, list[int]] = {}
    for i, key in sorted(cliques.items()):
        clique_groups.setdefault(key, []).append(i)
    return DomainView(
        status=status, generation=snap.generation, members=tuple(members), links=links,
        missing=tuple(missing), partitions=tuple(_components(published, both)),
        asymmetric=asym, silent=silent,
        cliques={k: tuple(v) for k, v in sorted(clique_groups.items())},
        problems=tuple(problems), link_counts=dict(counts), groups=groups, rows=rows)


def membership_problems(view: DomainView) -> list[str]:
    """The domain problems the ensemble document lists too: a clique split, config drift."""
    return [p for p in view.problems
            if p.startswith(("the members span", "configuration drift"))]


# --- renderings -----------------------------------------------------------------------


def domain_json(view: DomainView, rfc3339: Any) -> dict[str, Any]:
    """``GET /v1/ensembles/{ns}/{name}/domain`` (issue 17's fields, then three more)."""
    return {
        "status": view.status,
        "generation": view.generation,
        "members": [
            {"index": m.index, "slot": m.slot, "imex_state": m.imex_state, "clique": m.clique,
             "channel0": m.channel0,
             "reported_at": rfc3339(m.reported_at) if m.reported_at is not None else None}
            for m in view.members],
        "links": [{"from": a, "to": b, "state": s} for a, b, s in view.links],
        "missing_links": [[a, b] for a, b in view.missing],
        "partitions": [list(p) for p in view.partitions],
        "cliques": {k: list(v) for k, v in view.cliques.items()},
        "asymmetric_links": [[a, b] for a, b in view.asymmetric],
        "silent": list(view.silent),
        "problems": list(view.problems),
    }


def matrix_text(view: DomainView) -> str:
    """``?format=matrix``: rows from, columns to, one letter per cell, then the state."""
    indices = [m.index for m in view.members]
    rows = [(a, [view.cell(a, b) for b in indices]) for a in indices]
    return "\n".join([*matrix_lines(indices, rows), f"Domain State: {view.status}"]) + "\n"


def cr_status(view: DomainView) -> tuple[str, dict[str, str]]:
    """``status.domainStatus`` and the ``DomainUp`` condition of the ImexEnsemble CR.

    For the CR's status function (issue 15 owns the writer; it adds
    ``lastTransitionTime`` and ``observedGeneration``): True only when UP, Unknown when
    nothing can be judged, False otherwise, with the first problem as the message.
    """
    status = {"UP": "True", "UNKNOWN": "Unknown"}.get(view.status, "False")
    reason = {"UP": "AllLinksConnected", "DEGRADED": "LinksMissing", "DOWN": "NoMemberReady",
              "UNKNOWN": "ReportsMissing"}[view.status]
    message = view.problems[0] if view.problems else (
        f"{len(view.members)} members, every expected link CONNECTED" if view.status == "UP"
        else "no fresh report from any member")
    return view.status, {"type": "DomainUp", "status": status, "reason": reason,
                         "message": message[:1024]}
