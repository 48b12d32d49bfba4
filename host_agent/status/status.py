"""An ImexEnsemble's whole desired status, from what the agent knows (pure).

``desired_status`` is a function of the reconciler's ``Declaration`` (what
the last pass concluded about the CR), the registry's snapshot (members,
problems, the guests' reports) and the time; it reads no clock and does no
I/O, so the status is tested byte for byte. ``status_io.py`` applies it.

Transitions only: nothing here changes with the mere passing of time or
with a report that says what the last one said (no timestamp that moves by
itself, per member or report), so a steady ensemble costs no writes. The one thing time changes is
staleness: a report older than ``--report-stale-after`` makes its member
``GuestSilent``; ``next_change`` says when that next happens, so the writer
looks again then (and only then).

Conditions (metav1.Condition; ``lastTransitionTime`` moves only when the
status of that condition changes):

- ``Ready``: every published member's guest reports IMEX ``READY`` and has
  applied the current membership generation, and no VMI of the ensemble is
  left out (a crashed or pending member is not ready: so a crash flips Ready
  to False and the rejoin back to True). Reasons when False, first that
  applies: the refusal's reason (the CR is not published), ``NoMembers``, the
  reason a VMI is left out (``DuplicateIndex``, ``IndexOutOfRange``,
  ``NoIndex``, ``InvalidName``, ``NoAddress``, ``MemberNotRunning``),
  ``GuestSilent``, ``GuestNotReady`` (not READY, not reported yet, or an older
  generation applied).
- ``Degraded``: something needs a person: a refusal (``InvalidSpec``,
  ``SelectorConflict``, ``ServiceConflict``), a VMI left out, a silent guest,
  a guest whose IMEX is not READY, or any other problem the registry lists
  (``Problem``). A guest that has not yet applied a generation a moment old
  is catching up, not degraded.
- ``Published``: the members are in the EndpointSlice (``EndpointsPublished``);
  False with ``NoMembers`` or the refusal's reason.

``problems`` and each member's ``clique`` are exactly what the registry's JSON
says (``views.all_problems``, ``state.served_cliques``): one source, two faces.

- ``GuestChecks`` (issue 28, registry/guest_checks.py): the guests' preflight checks, False
  naming the failing check and the members; Unknown before any member reported them.
- ``CliqueShared`` (issue 28, state/shared.py): True when another ensemble's members
  report one of this ensemble's NVLink cliques. Informational: neither it nor its
  registry problem makes the ensemble Degraded or not Ready.
- ``DomainUp`` (issue 17) and ``domainStatus`` (the ``DOMAIN`` column): the
  registry's domain view (``domain_view.aggregate``, ``cr_status``): True when
  UP, Unknown when no member's report can be judged, False otherwise, the
  first domain problem as the message.

The persisted membership (issue 16, persist/pair.py): ``membershipGeneration``
with ``members[].index/ip/since``, ``caBundleSHA256`` and ``cliquesSplit`` (when true,
``members[].clique`` is the split guests pin by) are the (generation, GuestView) pair
every replica serves. ``since`` moves only with ``ip``, so it costs no write.

``caSHA256`` (issue 19) is filled from the snapshot's CA; ``GuestCertExpiring``
(a fresh report's certificate expires within 24 h) and ``CASecretInvalid`` (the CA
Secret is unusable; the agent never mints a new CA on its own) are Degraded reasons.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

from host_agent.crd.imexensemble import (
    CONDITION_CLIQUE_SHARED,
    CONDITION_DEGRADED,
    CONDITION_DOMAIN_UP,
    CONDITION_GUEST_CHECKS,
    CONDITION_PUBLISHED,
    CONDITION_READY,
    MAX_CONDITION_MESSAGE,
    MAX_PROBLEM_LENGTH,
    MAX_PROBLEMS,
)
from host_agent.ensembles.cr_spec import Declaration
from host_agent.ensembles.members import (
    DUPLICATE_INDEX,
    INDEX_OUT_OF_RANGE,
    INVALID_NAME,
    MEMBER_NOT_RUNNING,
    NO_ADDRESS,
    NO_INDEX,
)
from host_agent.ensembles.slices import slice_name
from host_agent.kube.objects import Obj
from host_agent.registry.domain_view import aggregate, cr_status
from host_agent.registry.guest_checks import guest_checks
from host_agent.registry.views import all_problems, rfc3339
from host_agent.state.shared import is_shared_problem, shared_messages
from host_agent.state.snapshot import EnsembleSnapshot, GuestReport, served_cliques
from imex_shared.model import EnsembleId, ModelError

READY_STATE: Final = "READY"
GUEST_SILENT: Final = "GuestSilent"
GUEST_NOT_READY: Final = "GuestNotReady"
NO_MEMBERS: Final = "NoMembers"
NOT_PUBLISHED: Final = "NotPublished"
ALL_READY: Final = "AllMembersReady"
AS_EXPECTED: Final = "AsExpected"
PROBLEM: Final = "Problem"
PUBLISHED: Final = "EndpointsPublished"
#: authEncryption (issue 19): a guest's certificate expires within 24 h (it cannot renew)
GUEST_CERT_EXPIRING: Final = "GuestCertExpiring"
#: authEncryption: the CA Secret does not hold a usable CA (never replaced by a new one)
CA_SECRET_INVALID: Final = "CASecretInvalid"
CERT_WARNING_S: Final = 24 * 3600.0
#: CliqueShared's reasons (state/shared.py)
CLIQUE_SHARED: Final = "SharedWithAnotherEnsemble"
NOT_SHARED: Final = "NotShared"

#: Which reason a condition names when several apply: the most telling first.
ABSENT_ORDER: Final = (DUPLICATE_INDEX, INDEX_OUT_OF_RANGE, NO_INDEX, INVALID_NAME, NO_ADDRESS,
                       MEMBER_NOT_RUNNING)

Status = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Evaluation:
    """One evaluation's inputs and result (Events read the same)."""

    decl: Declaration
    snap: EnsembleSnapshot | None
    status: Obj
    now: float
    #: The status the API held before (None: a CR never written, or a Service-only one).
    previous: Mapping[str, Any] | None = None


def rfc3339_seconds(ts: float) -> str:
    """metav1.Time: RFC 3339 in UTC, whole seconds (what the apiserver stores)."""
    return _rfc3339(int(ts))


@functools.lru_cache(maxsize=16)
def _rfc3339(seconds: int) -> str:
    # memoized: a sync evaluates thousands of conditions within the same few seconds
    return dt.datetime.fromtimestamp(seconds, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _fresh(report: GuestReport | None, now: float, stale_after: float) -> bool:
    return report is not None and now - report.received_at <= stale_after


def imex_state(report: GuestReport | None, now: float, stale_after: float) -> str:
    """A member's ``imexState``: the last reported state, ``GuestSilent`` when that report
    is older than ``stale_after``, empty before the first report."""
    if report is None:
        return ""
    if not _fresh(report, now, stale_after):
        return GUEST_SILENT
    state = report.fields.get("imex_state")
    return state if isinstance(state, str) else ""


def _generation_applied(report: GuestReport | None) -> int | None:
    value = report.fields.get("generation_applied") if report is not None else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def members_status(snap: EnsembleSnapshot, now: float, stale_after: float,
                   with_since: bool = True) -> list[Status]:
    """``status.members``: every published slot, index order, no timestamp that moves by
    itself (``since`` moves with ``ip``); ``clique`` as the registry serves it.
    ``with_since=False``: without ``since`` (an evaluation only the Events read)."""
    out: list[Status] = []
    cliques = served_cliques(snap)
    prefix = snap.ens.slot(0)[:-1]  # "imex-<domain id>-": the sha256 once, not per member
    for pub in snap.members:
        m = pub.member
        report = snap.reports.get(m.index)
        entry: Status = {"index": m.index, "slot": f"{prefix}{m.index}", "ip": m.ip,
                         "ready": bool(m.ready), "imexState": imex_state(report, now,
                                                                         stale_after)}
        if m.vmi:
            entry["vmi"] = m.vmi
        if m.node:
            entry["node"] = m.node
        if m.phase:
            entry["phase"] = m.phase
        applied = _generation_applied(report)
        if applied is not None:
            entry["generationApplied"] = applied
        clique = cliques.get(m.index)
        if clique:
            entry["clique"] = clique
        if with_since:
            entry["since"] = rfc3339(pub.since)  # persisted with the generation (issue 16)
        out.append(entry)
    return out


def _slots(indexes: Iterable[int]) -> str:
    items = sorted(indexes)
    word = "slot" if len(items) == 1 else "slots"
    return f"{word} {', '.join(map(str, items))}"


def _guests(snap: EnsembleSnapshot, now: float, stale_after: float
            ) -> tuple[list[int], list[str], list[int]]:
    """(silent slots, why each not-ready one is not, slots whose IMEX is not READY)."""
    silent: list[int] = []
    not_ready: list[str] = []
    imex_down: list[int] = []
    for pub in snap.members:
        i = pub.member.index
        report = snap.reports.get(i)
        if report is None:
            not_ready.append(f"slot {i}: no report yet")
            continue
        if not _fresh(report, now, stale_after):
            silent.append(i)
            continue
        state = imex_state(report, now, stale_after)
        applied = _generation_applied(report)
        if state != READY_STATE:
            not_ready.append(f"slot {i}: IMEX {state or 'state unknown'}")
            imex_down.append(i)
        elif applied != snap.generation:
            not_ready.append(f"slot {i}: applied generation {applied}, current "
                             f"{snap.generation}")
    return silent, not_ready, imex_down


def _cert_not_after(report: GuestReport | None) -> float | None:
    value = report.fields.get("cert_not_after") if report is not None else None
    if not isinstance(value, str):
        return None
    try:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=dt.UTC).timestamp()
    except ValueError:
        return None


def cert_expiring(snap: EnsembleSnapshot, now: float, stale_after: float) -> list[int]:
    """Slots whose fresh report says their certificate expires within 24 h (issue 19)."""
    out = []
    for pub in snap.members:
        report = snap.reports.get(pub.member.index)
        not_after = _cert_not_after(report)
        if _fresh(report, now, stale_after) and not_after is not None and \
                not_after - now <= CERT_WARNING_S:
            out.append(pub.member.index)
    return out


def _absent_reason(snap: EnsembleSnapshot) -> tuple[str, str] | None:
    if not snap.absent:
        return None
    reasons = {a.reason for a in snap.absent}
    reason = next((r for r in ABSENT_ORDER if r in reasons), sorted(reasons)[0])
    parts = [f"{a.vmi} ({f'slot {a.index}' if a.index is not None else 'no slot'}, "
             f"{a.phase or 'no phase yet'}): {a.reason}" for a in snap.absent]
    return reason, "VMIs without a published slot: " + "; ".join(parts)


def _condition(ctype: str, status: bool, reason: str, message: str, generation: int,
               previous: Mapping[str, Mapping[str, Any]], now: float) -> Status:
    value = "True" if status else "False"
    before = previous.get(ctype)
    since = before.get("lastTransitionTime") if before is not None and \
        before.get("status") == value else None
    return {
        "type": ctype,
        "status": value,
        "observedGeneration": generation,
        "lastTransitionTime": since if isinstance(since, str) else rfc3339_seconds(now),
        "reason": reason,
        "message": _clip(message, MAX_CONDITION_MESSAGE),
    }


def _tri(ctype: str, status: str, reason: str, message: str, generation: int,
         previous: Mapping[str, Mapping[str, Any]], now: float) -> Status:
    """A condition that may also be Unknown (GuestChecks)."""
    return _domain_up({"type": ctype, "status": status, "reason": reason,
                       "message": message}, generation, previous, now)


def _informational(snap: EnsembleSnapshot | None, now: float, stale_after: float,
                   gen: int, prev: Mapping[str, Mapping[str, Any]]) -> list[Status]:
    """GuestChecks and CliqueShared: neither makes the ensemble Degraded or not Ready."""
    if snap is None:
        return [_tri(CONDITION_GUEST_CHECKS, "Unknown", "NotPublished",
                     "the ensemble is not published", gen, prev, now),
                _condition(CONDITION_CLIQUE_SHARED, False, NOT_SHARED,
                           "the ensemble is not published", gen, prev, now)]
    shared = shared_messages(snap)
    return [_tri(CONDITION_GUEST_CHECKS, *guest_checks(snap, now, stale_after), gen, prev,
                 now),
            _condition(CONDITION_CLIQUE_SHARED, bool(shared),
                       CLIQUE_SHARED if shared else NOT_SHARED,
                       "; ".join(shared) if shared else "no other ensemble's members report "
                       "this ensemble's NVLink cliques", gen, prev, now)]


def _domain_up(cond: Mapping[str, str], generation: int,
               previous: Mapping[str, Mapping[str, Any]], now: float) -> Status:
    """``DomainUp`` (issue 17): True, False or Unknown, from ``domain_view.cr_status``."""
    before = previous.get(CONDITION_DOMAIN_UP)
    since = before.get("lastTransitionTime") if before is not None and \
        before.get("status") == cond["status"] else None
    return {**cond, "observedGeneration": generation,
            "lastTransitionTime": since if isinstance(since, str) else rfc3339_seconds(now),
            "message": _clip(cond["message"], MAX_CONDITION_MESSAGE)}


def previous_conditions(status: Mapping[str, Any] | None) -> dict[str, Mapping[str, Any]]:
    out: dict[str, Mapping[str, Any]] = {}
    for c in (status or {}).get("conditions") or ():
        if isinstance(c, Mapping) and isinstance(c.get("type"), str):
            out[c["type"]] = c
    return out


def desired_status(
    decl: Declaration,
    snap: EnsembleSnapshot | None,
    now: float,
    stale_after: float,
    previous: Mapping[str, Any] | None = None,
    declared_max: int | None = None,
    events_only: bool = False,
) -> Status:
    """The whole ``status`` the CR should have now (see the module docstring).

    ``previous`` is the status as last observed (or written): only its conditions'
    lastTransitionTime is read. ``declared_max`` (the CR's spec.maxMembers) sizes
    ``publishedSummary`` while nothing is published. ``events_only``: a Service-only
    ensemble's evaluation, which nothing writes and only the Events read
    (events.facts_of): without the domain view (``domainStatus``, ``DomainUp``) and the
    members' ``since``, which cost most of an evaluation and which no Event reads.
    """
    prev = previous_conditions(previous)
    gen = decl.generation
    refusal = decl.refusals[0] if decl.refusals else None
    out: Status = {"observedGeneration": gen}
    # a CR name that is not a DNS label has no slots (InvalidSpec says so)
    with contextlib.suppress(ModelError):
        out["domainID"] = EnsembleId(decl.namespace, decl.name).domain_id
    if snap is None:
        reason, message = refusal or (NOT_PUBLISHED, "the ensemble is not published")
        out.update(publishedSummary=f"0/{declared_max if declared_max is not None else '?'}",
                   membersPublished=0, imexReady=0, members=[])
        out["domainStatus"] = "UNKNOWN"
        out["conditions"] = [
            _condition(CONDITION_READY, False, reason, message, gen, prev, now),
            _condition(CONDITION_DEGRADED, True, reason, message, gen, prev, now),
            _condition(CONDITION_PUBLISHED, False, reason, message, gen, prev, now),
            _domain_up({"type": CONDITION_DOMAIN_UP, "status": "Unknown",
                        "reason": "ReportsMissing", "message": message}, gen, prev, now),
            *_informational(None, now, stale_after, gen, prev),
        ]
        out["problems"] = [_clip(m, MAX_PROBLEM_LENGTH) for _, m in decl.refusals][:MAX_PROBLEMS]
        return out

    spec = snap.spec
    published = len(snap.members)
    members = members_status(snap, now, stale_after, with_since=not events_only)
    ready_count = sum(1 for m in members if m["imexState"] == READY_STATE)
    out.update(
        membershipGeneration=snap.generation,
        publishedSummary=f"{published}/{spec.max_members}",
        membersPublished=published,
        imexReady=ready_count,
        members=members,
    )
    if snap.ca is not None:
        out["caSHA256"] = snap.ca.sha256
        out["caBundleSHA256"] = snap.ca.bundle_sha256
    # with membershipGeneration and members[].ip/since: the pair every replica serves
    out["cliquesSplit"] = bool(snap.cliques)
    silent, not_ready, imex_down = _guests(snap, now, stale_after)
    absent = _absent_reason(snap)

    # Ready
    if published == 0:
        ready = (False, NO_MEMBERS, f"no member is published (0/{spec.max_members})")
    elif absent is not None:
        ready = (False, *absent)
    elif silent:
        ready = (False, GUEST_SILENT, f"no report from {_slots(silent)} for more than "
                 f"{stale_after:g} s")
    elif not_ready:
        ready = (False, GUEST_NOT_READY, "; ".join(not_ready))
    else:
        ready = (True, ALL_READY, f"all {published} published members report IMEX READY at "
                 f"generation {snap.generation}")

    # Degraded: what needs a person (in this order of telling)
    causes: list[tuple[str, str]] = list(decl.refusals)
    if absent is not None:
        causes.append(absent)
    if silent:
        causes.append((GUEST_SILENT, f"no report from {_slots(silent)} for more than "
                       f"{stale_after:g} s"))
    if imex_down:
        causes.append((GUEST_NOT_READY, f"IMEX not READY on {_slots(imex_down)}"))
    expiring = cert_expiring(snap, now, stale_after)
    if expiring:
        causes.append((GUEST_CERT_EXPIRING, f"the IMEX certificate of {_slots(expiring)} "
                       "expires within 24 h and was not renewed (is the registry reachable?)"))
    problems = all_problems(snap, now, stale_after)
    refused = {m for _, m in decl.refusals}
    ca_broken = [p for p in problems if "not minting a new CA" in p]
    if ca_broken:
        causes.append((CA_SECRET_INVALID, ca_broken[0]))
    others = [p for p in problems if p not in refused and p not in ca_broken
              and not is_shared_problem(p)]  # CliqueShared is informational
    if others and not causes:
        causes.append((PROBLEM, "; ".join(others)))
    degraded = (True, causes[0][0], "; ".join(m for _, m in causes)) if causes else \
        (False, AS_EXPECTED, "no problems")

    # Published
    slices = slice_name(spec.ens.name, "IPv4")
    if published:
        note = f"{published} of {spec.max_members} slots published (EndpointSlice {slices}" \
            + (", and -v6 for IPv6)" if any(":" in p.member.ip for p in snap.members) else ")")
        if refusal is not None:
            note += f"; from Service {spec.ens.name} as it is ({refusal[0]})"
        pub = (True, PUBLISHED, note)
    else:
        pub = (False, NO_MEMBERS, f"no member is published (0/{spec.max_members})")

    out["conditions"] = [
        _condition(CONDITION_READY, *ready, gen, prev, now),
        _condition(CONDITION_DEGRADED, *degraded, gen, prev, now),
        _condition(CONDITION_PUBLISHED, *pub, gen, prev, now),
    ]
    if not events_only:
        domain, domain_up = cr_status(aggregate(snap, now, stale_after))
        out["domainStatus"] = domain
        out["conditions"].append(_domain_up(domain_up, gen, prev, now))
    out["conditions"] += _informational(snap, now, stale_after, gen, prev)
    out["problems"] = [_clip(p, MAX_PROBLEM_LENGTH) for p in problems][:MAX_PROBLEMS]
    return out


def next_change(snap: EnsembleSnapshot | None, now: float, stale_after: float) -> float | None:
    """When the status would next change by time alone (a fresh report going stale)."""
    if snap is None:
        return None
    due = [r.received_at + stale_after for r in snap.reports.values()
           if r.received_at + stale_after >= now]
    # a reported certificate entering its last 24 h (GuestCertExpiring)
    due += [t - CERT_WARNING_S for r in snap.reports.values()
            if (t := _cert_not_after(r)) is not None and t - CERT_WARNING_S >= now]
    return min(due) if due else None


def _same_items(want: Any, have: Any, key: str) -> bool:
    """List-map comparison: ``have`` holds exactly ``want``'s keys, each item containing
    the wanted fields (extra fields inside an item: another writer's, e.g. a clique)."""
    if not isinstance(have, list):
        return not want
    by_key = {h.get(key): h for h in have if isinstance(h, Mapping)}
    if set(by_key) != {w[key] for w in want}:
        return False
    return all(all(by_key[w[key]].get(k) == v for k, v in w.items()) for w in want)


def status_in_sync(desired: Mapping[str, Any], observed: Mapping[str, Any] | None) -> bool:
    """The observed status already says everything ``desired`` says.

    Fields others write (ha's persisted generation, a member's extra fields) may be
    there too; they are not ours to compare.
    """
    have = observed or {}
    for k, v in desired.items():
        if k == "members":
            if not _same_items(v, have.get(k), "index"):
                return False
        elif k == "conditions":
            theirs = previous_conditions(have)
            for c in v:
                got = theirs.get(c["type"])
                if got is None or any(got.get(f) != c[f] for f in c):
                    return False
        elif have.get(k) != v:
            return False
    return True
