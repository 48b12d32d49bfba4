"""VMI JSON -> ensemble member, or the reason it is not one (pure).

Everything here follows FACTS.md "KubeVirt"; names, indexes and addresses are
validated with ``imex_shared.model`` so that host and guest agree on them.

Decision order for one VMI (``examine_vmi``):
1. the VMI's name must be a DNS label (guests match it to their hostname);
2. its slot index: the label ``imex-ensemble.io/index`` (a canonical decimal;
   a bad label is a problem, never silently replaced by the name), else the
   name's trailing ``-<n>`` (VirtualMachinePool naming); it must be below
   max-members;
3. whether it is live: not being deleted and not Succeeded/Failed. A live VMI
   holds its slot even before it runs, so two live VMIs on one slot are a
   conflict and neither is published until one goes;
4. whether it is published: phase Running, with a usable address on the
   ensemble's network: the interface named by the Service's network
   annotation, else ``default``, else the first named interface (unnamed
   ones are guest-agent-only NICs), else the first at all; its ``ipAddress``,
   else the first usable of ``ipAddresses``; ``/prefix`` stripped;
   10.0.2.2, fd10:0:2::2, loopback and link-local refused. During a live
   migration this is simply the IP KubeVirt reports now.

``derive_members`` applies this to all VMIs of one ensemble and resolves
duplicate slots. Nothing raises on malformed input: every oddity becomes a
problem string that names the VMI.

Cost: every reconcile pass re-examines every VMI of its ensemble, and parsing
an address with ``ipaddress`` plus the usability checks was the largest pure
cost of a pass (tests/bench, issue 7). The verdict on an address string
depends on nothing but the string, so ``classify_address`` memoizes it (a
bounded LRU; addresses of live VMIs repeat on every pass).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Final

from host_agent.ensembles.service_spec import INDEX_LABEL
from host_agent.state.snapshot import Absent, EnsembleSpec
from imex_shared.model import (
    GUEST_INTERNAL,
    InvalidIndex,
    Member,
    ModelError,
    check_dns_label,
    check_index,
    index_from_name,
    ipv4_octets,
    parse_ip,
    unusable_reason,
)

DEFAULT_NETWORK: Final = "default"
RUNNING: Final = "Running"
_FINISHED: Final = frozenset({"Succeeded", "Failed"})


@dataclass(frozen=True, slots=True)
class Candidate:
    """What one VMI means for its ensemble.

    ``index`` is set when the VMI claims a slot; ``live`` when it holds that
    slot (for duplicate detection); ``member`` when it can be published;
    ``problem`` says why not (or what is odd) in words an operator can act on.
    """

    vmi: str
    index: int | None
    live: bool
    member: Member | None
    problem: str | None
    #: Why it is not published, as a status reason (None when it is, or when it is
    #: leaving: being deleted).
    reason: str | None = None
    phase: str = ""
    deleting: bool = False
    #: a member's every usable address (``vmi_addresses``), kept with the rest so that
    #: a pass over an unchanged VMI (``ExamineMemo``) does not parse them again
    addresses: frozenset[str] = frozenset()


#: Reasons a VMI of the ensemble holds no published slot (ImexEnsemble status, Events).
INVALID_NAME: Final = "InvalidName"
NO_INDEX: Final = "NoIndex"
INDEX_OUT_OF_RANGE: Final = "IndexOutOfRange"
DUPLICATE_INDEX: Final = "DuplicateIndex"
NO_ADDRESS: Final = "NoAddress"
MEMBER_NOT_RUNNING: Final = "MemberNotRunning"


@dataclass(frozen=True, slots=True)
class Derivation:
    """``derive``'s answer: what to publish, the problems, and who is left out and why."""

    members: list[Member]
    problems: list[str]
    absent: tuple[Absent, ...] = ()
    #: member index -> every usable address its VMI reports (``vmi_addresses``)
    addresses: Mapping[int, frozenset[str]] = field(default_factory=dict)


def _mapping(value: object) -> Mapping[str, object]:
    return value if isinstance(value, (dict, Mapping)) else {}


def _text(value: object) -> str | None:
    return value if isinstance(value, str) and value else None


def vmi_name(vmi: Mapping[str, object]) -> str:
    name = _mapping(vmi.get("metadata")).get("name")
    return name if isinstance(name, str) else ""


def vmi_labels(vmi: Mapping[str, object]) -> dict[str, str]:
    labels = _mapping(_mapping(vmi.get("metadata")).get("labels"))
    return {str(k): v for k, v in labels.items() if isinstance(v, str)}


def _raw_index(name: str, labels: Mapping[str, object]) -> int:
    """The slot index the VMI claims (not yet checked against the size); InvalidIndex."""
    raw = labels.get(INDEX_LABEL)
    if raw is not None:
        if not isinstance(raw, str):
            raise InvalidIndex(f"label {INDEX_LABEL}={raw!r} is not a string")
        text = raw
        if not (text.isascii() and text.isdigit()) or (len(text) > 1 and text[0] == "0"):
            raise InvalidIndex(f"label {INDEX_LABEL}={text!r} is not a slot number")
        return int(text)
    index = index_from_name(name)
    if index is None:
        raise InvalidIndex(
            f"has no {INDEX_LABEL} label and its name does not end in -<n> (a number "
            "without leading zeros); cannot tell which slot it is"
        )
    return index


def _index(name: str, labels: Mapping[str, object], max_members: int) -> int:
    """The VMI's slot index; raises InvalidIndex with the reason."""
    return check_index(_raw_index(name, labels), max_members)


def _ready(status: Mapping[str, object]) -> bool:
    conditions = status.get("conditions")
    if not isinstance(conditions, list):
        return False
    for cond in conditions:
        c = _mapping(cond)
        if c.get("type") == "Ready":
            return c.get("status") == "True"
    return False


def _interface(
    interfaces: Sequence[object], network: str | None
) -> tuple[Mapping[str, object] | None, str]:
    """The interface of the ensemble's network and a description of the choice."""
    entries = [_mapping(i) for i in interfaces]
    if network is not None:
        for entry in entries:
            if entry.get("name") == network:
                return entry, f"network {network!r}"
        return None, f"network {network!r}"
    for entry in entries:
        if entry.get("name") == DEFAULT_NETWORK:
            return entry, f"network {DEFAULT_NETWORK!r}"
    # Interfaces without a name are ones only the guest agent reports (no
    # network of the VMI spec); a named one is preferred as "the first".
    named = [e for e in entries if isinstance(e.get("name"), str) and e.get("name")]
    if named:
        return named[0], f"network {named[0].get('name')!r}"
    if entries:
        return entries[0], "its first interface"
    return None, f"network {DEFAULT_NETWORK!r}"


#: GUEST_INTERNAL as text, for the fast path of ``classify_address``
_INTERNAL: Final = frozenset(str(a) for a in GUEST_INTERNAL)


@functools.lru_cache(maxsize=8192)
def classify_address(raw: str) -> tuple[str | None, str | None, bool]:
    """One reported address string -> (canonical IP if usable, reason if not, parsed).

    ``parsed`` is False when the text is not an address at all. Pure and
    memoized (see the module docstring); the results are immutable.
    """
    octets = ipv4_octets(raw)
    if octets is not None and _plainly_usable(octets, raw):
        return raw, None, True
    return classify_parsed(raw)


def _plainly_usable(octets: tuple[int, int, int, int], raw: str) -> bool:
    """A canonical IPv4 address that none of ``unusable_reason``'s rules can touch: not
    0/8, loopback, link-local, multicast or above, nor a guest-internal address. Anything
    near those ranges goes to the full check, which words the reason."""
    a, b = octets[0], octets[1]
    return 0 < a < 224 and a != 127 and not (a == 169 and b == 254) and raw not in _INTERNAL


def classify_parsed(raw: str) -> tuple[str | None, str | None, bool]:
    """``classify_address`` by ``ipaddress`` alone (the reference its fast path agrees with)."""
    try:
        addr = parse_ip(raw)
    except ModelError as exc:
        return None, str(exc), False
    reason = unusable_reason(addr)
    if reason is None:
        return str(addr), None, True
    return None, reason, True


def pick_address(iface: Mapping[str, object]) -> tuple[str | None, list[str]]:
    """``ipAddress`` if usable, else the first usable of ``ipAddresses``.

    Returns (canonical IP or None, the refused candidates with reasons).
    """
    candidates: list[object] = []
    primary = iface.get("ipAddress")
    if primary is not None:
        candidates.append(primary)
    many = iface.get("ipAddresses")
    if isinstance(many, list):
        candidates.extend(many)
    refused: list[str] = []
    seen: set[str] = set()
    for raw in candidates:
        if not isinstance(raw, str):
            refused.append(f"{raw!r} (not a string)")
            continue
        ip, reason, parsed = classify_address(raw)
        if ip is not None:
            return ip, refused
        assert reason is not None
        if not parsed:
            refused.append(reason)
        elif reason not in seen:  # one line per unusable address, however it was written
            seen.add(reason)
            refused.append(reason)
    return None, refused


def _guest_internal_only(raw_ips: list[str]) -> list[str] | None:
    """The addresses, when every one of them is a masquerade guest-internal one."""
    found: list[str] = []
    for raw in raw_ips:
        try:
            addr = parse_ip(raw)
        except ModelError:
            return None
        if addr not in GUEST_INTERNAL:
            return None
        found.append(str(addr))
    return list(dict.fromkeys(found)) or None


def _describe_refused(name: str, where: str, refused: list[str], raw_ips: list[str]) -> str:
    internal = _guest_internal_only(raw_ips)
    if internal is not None:
        return (
            f"VMI {name} reports only the guest-internal {', '.join(internal)} on {where} "
            "(masquerade address, not reachable from peers); not published until KubeVirt "
            "reports the pod IP"
        )
    if not refused:
        return f"VMI {name} has no IP address on {where} yet; not published"
    return f"VMI {name} has no usable IP address on {where}: " + "; ".join(refused)


def examine_vmi(vmi: Mapping[str, object], spec: EnsembleSpec) -> Candidate:
    """Decide what one VMI of ``spec``'s ensemble is (see the module docstring)."""
    meta = _mapping(vmi.get("metadata"))
    name = vmi_name(vmi)
    shown = name or "<unnamed>"
    status = _mapping(vmi.get("status"))
    phase = _text(status.get("phase")) or ""
    deleting = meta.get("deletionTimestamp") is not None
    try:
        check_dns_label(name, "VMI name")
    except ModelError as exc:
        return Candidate(shown, None, False, None, f"VMI {shown}: {exc}; not published",
                         INVALID_NAME, phase, deleting)
    try:
        raw_index = _raw_index(name, _mapping(meta.get("labels")))
    except ModelError as exc:
        return Candidate(name, None, False, None, f"VMI {name} {exc}; not published",
                         NO_INDEX, phase, deleting)
    try:
        index = check_index(raw_index, spec.max_members)
    except ModelError as exc:
        return Candidate(name, None, False, None, f"VMI {name} {exc}; not published",
                         INDEX_OUT_OF_RANGE, phase, deleting)

    live = not deleting and phase not in _FINISHED
    if not live:
        return Candidate(name, index, False, None, None, MEMBER_NOT_RUNNING, phase, deleting)
    if not status:  # just created: nothing to say yet
        return Candidate(name, index, True, None, None, MEMBER_NOT_RUNNING, phase)
    if phase != RUNNING:
        return Candidate(name, index, True, None, None, MEMBER_NOT_RUNNING, phase)

    interfaces = status.get("interfaces")
    if interfaces is None:
        interfaces = []
    if not isinstance(interfaces, list):
        return Candidate(
            name, index, True, None,
            f"VMI {name}: status.interfaces is not a list; not published", NO_ADDRESS, phase,
        )
    iface, where = _interface(interfaces, spec.network)
    if iface is None:
        what = "has no interfaces in its status yet" if not interfaces else f"has no {where}"
        return Candidate(name, index, True, None, f"VMI {name} {what}; not published",
                         NO_ADDRESS, phase)
    ip, refused = pick_address(iface)
    if ip is None:
        raw_ips = [
            r
            for r in [iface.get("ipAddress"), *_list(iface.get("ipAddresses"))]
            if isinstance(r, str)
        ]
        return Candidate(name, index, True, None,
                         _describe_refused(name, where, refused, raw_ips), NO_ADDRESS, phase)
    member = Member(
        index=index,
        ip=ip,
        vmi=name,
        node=_text(status.get("nodeName")),
        phase=phase,
        ready=_ready(status),
    )
    return Candidate(name, index, True, member, None, None, phase,
                     addresses=vmi_addresses(vmi))


def vmi_addresses(vmi: Mapping[str, object]) -> frozenset[str]:
    """Every usable address the VMI reports on any interface (canonical text).

    The registry accepts a guest's status report from any of them: the
    published address may sit on a secondary network while the guest talks to
    the registry over the pod network.
    """
    out: set[str] = set()
    for iface in _list(_mapping(vmi.get("status")).get("interfaces")):
        entry = _mapping(iface)
        for raw in [entry.get("ipAddress"), *_list(entry.get("ipAddresses"))]:
            if isinstance(raw, str):
                ip = classify_address(raw)[0]
                if ip is not None:
                    out.add(ip)
    return frozenset(out)


def _list(value: object) -> list[object]:
    return value if isinstance(value, list) else []


Examine = Callable[[Mapping[str, object], EnsembleSpec], Candidate]


class ExamineMemo:
    """``examine_vmi`` remembered per VMI while its resourceVersion and the spec stay the same.

    Why: a pass re-examined every VMI of the ensemble though one had changed; at
    steady update rates that was the largest agent-owned cost after the API
    calls (tests/bench profile). In Kubernetes an object's (namespace, name,
    resourceVersion) fixes its content, so only the version is remembered, never
    the object (a backlog of replaced objects must not stay alive here). A VMI
    without a resourceVersion is examined every time; ``forget`` drops a deleted
    VMI's entry.
    """

    def __init__(self) -> None:
        self._memo: dict[tuple[str, str], tuple[str, EnsembleSpec, Candidate]] = {}

    def __call__(self, vmi: Mapping[str, object], spec: EnsembleSpec) -> Candidate:
        meta = _mapping(vmi.get("metadata"))
        rv = meta.get("resourceVersion")
        if not isinstance(rv, str) or not rv:
            return examine_vmi(vmi, spec)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        hit = self._memo.get(key)
        if hit is not None and hit[0] == rv and hit[1] == spec:
            return hit[2]
        candidate = examine_vmi(vmi, spec)
        self._memo[key] = (rv, spec, candidate)
        return candidate

    def forget(self, namespace: str, name: str) -> None:
        self._memo.pop((namespace, name), None)

    def __len__(self) -> int:
        return len(self._memo)


def derive_members(
    spec: EnsembleSpec, vmis: Iterable[Mapping[str, object]], examine: Examine = examine_vmi
) -> tuple[list[Member], list[str]]:
    """The members to publish for one ensemble, and its VMI problems (see ``derive``)."""
    d = derive(spec, vmis, examine)
    return d.members, d.problems


def derive(
    spec: EnsembleSpec, vmis: Iterable[Mapping[str, object]], examine: Examine = examine_vmi
) -> Derivation:
    """The members to publish for one ensemble, its VMI problems, and who is left out.

    An ImexEnsemble's ``memberSelector`` (ANDed with the ensemble label, which picked
    ``vmis``) leaves out the VMIs it does not match: they are not members, and not
    problems either.
    Two live VMIs on one slot: neither is published and the problem names both.
    Output is sorted (members by index, problems by text, absent VMIs by name) so equal
    input gives equal output. ``examine`` may be an ``ExamineMemo`` (same results,
    cached). ``absent`` lists every selected VMI without a published slot that is not
    being deleted (a VMI on its way out is leaving, not missing), with its reason.
    """
    if spec.member_selector is not None:
        vmis = [v for v in vmis if spec.member_selector.matches(vmi_labels(v))]
    candidates = [examine(v, spec) for v in vmis]
    problems = [c.problem for c in candidates if c.problem is not None]
    holders: dict[int, list[Candidate]] = {}
    for c in candidates:
        if c.live and c.index is not None:
            holders.setdefault(c.index, []).append(c)
    members: list[Member] = []
    addresses: dict[int, frozenset[str]] = {}
    duplicated: set[str] = set()
    for index, group in holders.items():
        if len(group) > 1:
            names = ", ".join(sorted(c.vmi for c in group))
            duplicated.update(c.vmi for c in group)
            problems.append(
                f"slot {index} is claimed by {len(group)} live VMIs ({names}); "
                "publishing neither until only one is left"
            )
            continue
        member = group[0].member
        if member is not None:
            members.append(member)
            addresses[index] = group[0].addresses
    members.sort(key=lambda m: m.index)
    absent = tuple(sorted(
        (Absent(c.vmi, c.index, c.phase,
                DUPLICATE_INDEX if c.vmi in duplicated else c.reason or MEMBER_NOT_RUNNING)
         for c in candidates if (c.member is None or c.vmi in duplicated) and not c.deleting),
        key=lambda a: a.vmi,
    ))
    return Derivation(members, sorted(problems), absent, addresses)
