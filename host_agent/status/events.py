"""Which Events an ensemble's story needs, decided from two evaluations (pure).

The status writer evaluates every ensemble (status.py) at most once a second;
each evaluation is reduced to ``Facts`` (who is published at which IP, who is
left out and why, whether it is Ready, which problems it has, what happened
to its Service), and ``decide(before, after)`` names the Events that tell what
changed in between. ``event_body`` renders one as an events.k8s.io/v1 Event.
No clock, no I/O: events_io.py creates them (and aggregates repeats into
``series``).

What becomes an Event (``reason``, ``type``, ``action``):

- transitions: ``MemberJoined`` (a slot got published), ``MemberLeft`` (a
  slot was withdrawn: Warning when its VMI is still there but not running, a
  crash; Normal when the VMI is gone), ``MemberIPChanged`` (the same VMI at a
  new address: a migration or a restart); ``ReadyLost`` / ``ReadyRegained``
  (the Ready condition flipping; ``Ready`` the first time);
- problems, when they appear: a VMI left out (``DuplicateIndex``,
  ``IndexOutOfRange``, ``NoIndex``, ``InvalidName``, ``NoAddress``), a spec
  the agent cannot use (``InvalidSpec``, ``SelectorConflict``,
  ``ServiceConflict``), anything else the registry lists (``Problem``);
- the Service: ``ServiceCreated``, ``ServiceAdopted``;
- ``CliqueShared`` (Warning) when that condition turns True: another ensemble's
  members report one of this ensemble's NVLink cliques (state/shared.py).

Bounded: members that join (or leave) in one evaluation share one Event, so a
boot storm of 18 VMs costs as many MemberJoined Events as evaluations, at
most one a second, however many passes and reports it causes; a problem is
an Event when it appears, not on every pass. The first evaluation of an
ensemble in this process is compared with the status the CR already holds
(``first_facts``), so an agent restart tells nothing that did not happen.
"""

from __future__ import annotations

import datetime as dt
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from host_agent.crd.imexensemble import API_VERSION as CR_API_VERSION
from host_agent.crd.imexensemble import CONDITION_CLIQUE_SHARED, CONDITION_READY
from host_agent.crd.imexensemble import KIND as CR_KIND
from host_agent.ensembles.cr_spec import Declaration
from host_agent.ensembles.members import MEMBER_NOT_RUNNING
from host_agent.status.status import Evaluation

REPORTING_CONTROLLER: Final = "imex-ensemble.io/host-agent"
NOTE_LIMIT: Final = 1024

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class Regarding:
    """The object an Event is about (its ``regarding``)."""

    api_version: str
    kind: str
    namespace: str
    name: str
    uid: str

    def ref(self) -> dict[str, str]:
        return {"apiVersion": self.api_version, "kind": self.kind,
                "namespace": self.namespace, "name": self.name, "uid": self.uid}


@dataclass(frozen=True, slots=True)
class Intent:
    """One Event to record (the writer adds time, names and series)."""

    type: EventType
    reason: str
    action: str
    note: str


@dataclass(frozen=True, slots=True)
class Facts:
    """What of one evaluation an Event can be about."""

    regarding: Regarding
    #: index -> (vmi, ip) of every published slot
    members: Mapping[int, tuple[str, str]] = field(default_factory=dict)
    #: vmi -> (phase, reason) of every VMI left out
    absent: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    ready: bool = False
    ready_message: str = ""
    #: problem text -> reason
    problems: Mapping[str, str] = field(default_factory=dict)
    ever_ready: bool = False
    #: CliqueShared's message while it is True, else "" (state/shared.py)
    clique_shared: str = ""


def _clique_shared(status: Mapping[str, Any]) -> str:
    cond = next((c for c in status.get("conditions") or () if isinstance(c, Mapping)
                 and c.get("type") == CONDITION_CLIQUE_SHARED), {})
    return str(cond.get("message", "")) if cond.get("status") == "True" else ""


def regarding_of(evaluation: Evaluation) -> Regarding:
    d = evaluation.decl
    if d.kind == "Service":
        return Regarding("v1", "Service", d.namespace, d.name, d.uid)
    return cr_regarding(d)


def first_facts(evaluation: Evaluation) -> Facts | None:
    """What to compare an ensemble's first evaluation (in this process) with.

    A CR whose status was written before (by this agent before a restart, or by
    another replica) is compared with that status, so a restart says nothing that
    did not happen and what happened meanwhile is still told. A CR never written is
    new: everything about it is news. A Service-only ensemble has nothing stored:
    its first evaluation is only looked at for problems.
    """
    regarding = regarding_of(evaluation)
    if evaluation.decl.kind == "Service":
        return None
    previous = evaluation.previous
    if not previous:
        return Facts(regarding=regarding)
    members = {int(m["index"]): (str(m.get("vmi", "")), str(m.get("ip", "")))
               for m in previous.get("members") or () if isinstance(m, Mapping)
               and isinstance(m.get("index"), int)}
    ready = any(isinstance(c, Mapping) and c.get("type") == CONDITION_READY
                and c.get("status") == "True" for c in previous.get("conditions") or ())
    problems = {str(p): "" for p in previous.get("problems") or ()}
    return Facts(regarding=regarding, members=members, ready=ready, problems=problems,
                 ever_ready=ready, clique_shared=_clique_shared(previous))


def facts_of(evaluation: Evaluation, before: Facts | None = None) -> Facts:
    """The Facts of one evaluation (``before`` carries ``ever_ready`` along)."""
    status, snap, decl = evaluation.status, evaluation.snap, evaluation.decl
    members = {int(m["index"]): (str(m.get("vmi", "")), str(m["ip"]))
               for m in status.get("members") or ()}
    ready_cond: Mapping[str, Any] = next((c for c in status.get("conditions") or ()
                                          if c.get("type") == CONDITION_READY), {})
    ready = ready_cond.get("status") == "True"
    absent = {a.vmi: (a.phase, a.reason) for a in snap.absent} if snap is not None else {}
    problems: dict[str, str] = {message: reason for reason, message in decl.refusals}
    for text in (snap.problems if snap is not None else ()):
        if text not in problems:
            problems[text] = problem_reason(text, absent)
    return Facts(
        regarding=regarding_of(evaluation),
        members=members,
        absent=absent,
        ready=ready,
        ready_message=str(ready_cond.get("message", "")),
        problems=problems,
        ever_ready=ready or (before is not None and before.ever_ready),
        clique_shared=_clique_shared(status),
    )


def problem_reason(text: str, absent: Mapping[str, tuple[str, str]]) -> str:
    """The reason of one registry problem: that of the VMI it names (members.py writes
    ``VMI <name> ...``, or lists duplicates as ``(<a>, <b>)``), else ``Problem``."""
    for vmi, (_, reason) in absent.items():
        if reason == MEMBER_NOT_RUNNING:
            continue
        name = re.escape(vmi)
        if re.search(rf"VMI {name}(?![-a-z0-9])", text) or \
                re.search(rf"[(,] ?{name}(?=[,)])", text):
            return reason
    return "Problem"


def _clip(text: str) -> str:
    return text if len(text) <= NOTE_LIMIT else text[: NOTE_LIMIT - 1] + "…"


def _who(index: int, vmi: str) -> str:
    return f"{index} ({vmi})" if vmi else str(index)


def _group(verb: str, items: list[tuple[str, str]]) -> str:
    """``member 2 (gb200-2) joined at 10.0.0.3``, or ``3 members joined: 0 (a) at ...; ...``."""
    if len(items) == 1:
        who, detail = items[0]
        return f"member {who} {verb} {detail}"
    return f"{len(items)} members {verb}: " + "; ".join(f"{w} {d}" for w, d in items)


def decide(before: Facts | None, after: Facts) -> list[Intent]:
    """The Events between two evaluations of one ensemble (module docstring)."""
    out: list[Intent] = []
    old_problems = before.problems if before is not None else {}
    if before is not None and before.regarding.uid == after.regarding.uid:
        joined: list[tuple[str, str]] = []
        moved: list[tuple[str, str]] = []
        left_gone: list[tuple[str, str]] = []
        left_down: list[tuple[str, str]] = []
        for i, (vmi, ip) in sorted(after.members.items()):
            was = before.members.get(i)
            if was is None or was[0] != vmi:
                joined.append((_who(i, vmi), f"at {ip}"))
            elif was[1] != ip:
                moved.append((_who(i, vmi), f"from {was[1]} to {ip}"))
        for i, (vmi, ip) in sorted(before.members.items()):
            now = after.members.get(i)
            if now is not None and now[0] == vmi:
                continue
            if vmi in after.absent:
                phase, reason = after.absent[vmi]
                why = f"VMI {phase or 'without a phase'}" + (
                    f", {reason}" if reason != MEMBER_NOT_RUNNING else "")
                left_down.append((_who(i, vmi), f"(was at {ip}; {why})"))
            else:
                left_gone.append((_who(i, vmi), f"(was at {ip}; VMI gone)"))
        if left_down:
            out.append(Intent("Warning", "MemberLeft", "Unpublish",
                              _clip(_group("left", left_down))))
        if left_gone:
            out.append(Intent("Normal", "MemberLeft", "Unpublish",
                              _clip(_group("left", left_gone))))
        if moved:
            out.append(Intent("Normal", "MemberIPChanged", "Publish",
                              _clip(_group("moved", moved))))
        if joined:
            out.append(Intent("Normal", "MemberJoined", "Publish",
                              _clip(_group("joined", joined))))
        if before.ready and not after.ready:
            out.append(Intent("Warning", "ReadyLost", "Evaluate",
                              _clip(f"Ready is False: {after.ready_message}")))
        elif after.ready and not before.ready:
            reason = "ReadyRegained" if before.ever_ready else "Ready"
            out.append(Intent("Normal", reason, "Evaluate", _clip(after.ready_message)))
    for text, reason in after.problems.items():
        if text not in old_problems:
            out.append(Intent("Warning", reason, "Examine", _clip(text)))
    if after.clique_shared and not (before.clique_shared if before is not None else ""):
        out.append(Intent("Warning", "CliqueShared", "Examine", _clip(after.clique_shared)))
    return out


def service_intent(decl: Declaration) -> Intent | None:
    """The Event of a pass that created or adopted the CR's Service (else None).

    Taken from the pass itself, not from an evaluation: the next pass (the Service's
    own watch event) declares "own" before the evaluation would have seen it.
    """
    if decl.service_wrote is None or decl.service_action not in ("create", "adopt"):
        return None
    name = f"{decl.namespace}/{decl.name}"
    if decl.service_action == "create":
        return Intent("Normal", "ServiceCreated", "CreateService",
                      f"created Service {name} (headless, owned by this ImexEnsemble)")
    return Intent("Normal", "ServiceAdopted", "AdoptService",
                  f"adopted Service {name}: ownerReference added; the domain id and every "
                  "slot name are unchanged, so no guest restarts IMEX")


def cr_regarding(decl: Declaration) -> Regarding:
    return Regarding(CR_API_VERSION, CR_KIND, decl.namespace, decl.name, decl.uid)


def micro_time(ts: float) -> str:
    """metav1.MicroTime as the apiserver renders it: UTC, six fractional digits."""
    return dt.datetime.fromtimestamp(ts, tz=dt.UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def event_body(regarding: Regarding, intent: Intent, name: str, instance: str,
               when: float) -> dict[str, Any]:
    """The events.k8s.io/v1 Event for a first occurrence (no series, no deprecated fields)."""
    return {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": regarding.namespace},
        "eventTime": micro_time(when),
        "reportingController": REPORTING_CONTROLLER,
        "reportingInstance": instance,
        "action": intent.action,
        "reason": intent.reason,
        "type": intent.type,
        "note": _clip(intent.note),
        "regarding": regarding.ref(),
    }


def series_patch(count: int, last: float) -> dict[str, Any]:
    """A repeat: the Event's ``series`` (count >= 2, lastObservedTime)."""
    return {"series": {"count": count, "lastObservedTime": micro_time(last)}}

