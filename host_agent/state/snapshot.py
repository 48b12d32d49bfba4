"""An ensemble as the host agent knows it at one moment: immutable values (pure).

``EnsembleSnapshot`` is what every reader shares: the reconciler makes one per
change (store.py keeps the latest), the slice applier, the registry, the status
and the Events read the same one, so they can never disagree about who is in an
ensemble. ``GuestView`` is everything any guest writes from a snapshot; its
changes, and only they, move the generation.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from host_agent.kube.selectors import LabelSelector
from imex_shared.cliques import split
from imex_shared.model import EnsembleId, Member
from imex_shared.render import Mode

Source = Literal["cr", "service"]


@dataclass(frozen=True, slots=True)
class EnsembleSpec:
    """What the ensemble's declaration says, parsed; the same value for both sources.

    An ensemble is declared by an ImexEnsemble (``source="cr"``,
    host_agent/ensembles/cr_spec.py) or by a hand-made Service (``source="service"``,
    host_agent/ensembles/service_spec.py). Both parse
    into this, and everything after parsing (members, slices, registry, status, events)
    reads only this, so the two forms cannot drift apart.
    """

    ens: EnsembleId
    max_members: int
    port: int
    network: str | None = None
    token_sha256: str | None = None
    #: The Service's uid: the EndpointSlices' owner (None until the Service exists).
    uid: str | None = None
    #: What the guests write into nodes_config: slot names, or IPs (IMEX < 570.158.01).
    mode: Mode = "names"
    #: IMEX_ENABLE_AUTH_ENCRYPTION (never with mode ips: certificates name slots).
    auth_encryption: bool = False
    #: Any change of this value starts a CA rotation (issue 19).
    ca_rotation: str | None = None
    #: ANDed with ``imex-ensemble.io/ensemble=<name>`` (CR only; None: every labelled VMI).
    member_selector: LabelSelector | None = None
    source: Source = "service"
    #: The ImexEnsemble's uid (source "cr"): the owned Service's controller reference.
    owner_uid: str | None = None
    #: ``registryTLS: Required``: the token is refused on plain HTTP (registry/auth.py).
    registry_tls_required: bool = False


@dataclass(frozen=True, slots=True)
class PublishedMember:
    """A member as published, with the time its slot got its current IP.

    ``addresses`` are all the usable addresses its VMI reports on any
    interface: a guest whose IMEX network is a Multus secondary network
    reaches the registry over the pod network, so its status reports come
    from an address other than the published one.
    """

    member: Member
    since: float
    addresses: frozenset[str] = frozenset()

    @property
    def index(self) -> int:
        return self.member.index


@dataclass(frozen=True, slots=True)
class GuestReport:
    """A guest's last status report (the PUT body, validated) and when it came.

    ``fields`` never holds the raw ``imex_domain``: ``links`` is what is kept of it, the
    state word of each of this member's own links by peer index (None: the report had
    no domain view of this member).
    """

    received_at: float
    from_ip: str
    fields: Mapping[str, object]
    links: tuple[str | None, ...] | None = None
    #: (boot id, CLOCK_BOOTTIME ns) when the guest sent it; None: a guest before 0.2
    sent: tuple[str, int] | None = None


def guest_order(a: GuestReport, b: GuestReport) -> bool | None:
    """Whether the guest sent ``a`` after ``b`` by its own stamps; None when they cannot
    say: a stamp is missing (a guest before 0.2) or they are of two boots (a guest
    rebooted inside the same VMI starts its clock again)."""
    if a.sent is None or b.sent is None or a.sent[0] != b.sent[0]:
        return None
    return a.sent[1] > b.sent[1]


def sent_after(a: GuestReport, b: GuestReport) -> bool:
    """Whether the guest sent ``a`` after ``b``: by the guest's own stamps where they
    order the two (:func:`guest_order`), else by when each replica received it.

    Why the guest's order: a replica stamps ``received_at`` when it handles a request,
    and a request can wait unhandled (a replica stopped or starved while the guest
    timed out and sent its next report elsewhere). Handled later, the older report had
    the later ``received_at`` and overwrote the newer one everywhere (the CI soak's
    seed 0xecef7e8e)."""
    by_guest = guest_order(a, b)
    return a.received_at > b.received_at if by_guest is None else by_guest


def report_counts(pub: PublishedMember, report: GuestReport | None) -> bool:
    """Whether ``report`` speaks for the member now: it came after the slot got its
    current address (a report from the slot's previous VM, or from before a migration,
    does not)."""
    return report is not None and report.received_at >= pub.since


def member_cliques(
    members: Iterable[PublishedMember], reports: Mapping[int, GuestReport]
) -> dict[int, str]:
    """index -> ``"<cluster_uuid>.<clique_id>"`` of the members whose clique is known."""
    out: dict[int, str] = {}
    for pub in members:
        report = reports.get(pub.index)
        if not report_counts(pub, report):
            continue
        assert report is not None
        fabric = report.fields.get("fabric")
        if isinstance(fabric, (dict, Mapping)):
            out[pub.index] = f"{fabric.get('cluster_uuid')}.{fabric.get('clique_id')}"
    return out


def served_cliques(snap: EnsembleSnapshot) -> dict[int, str]:
    """index -> clique as guests are told: the served split when there is one (what
    they pin follows it), else what this replica's reports say (changes nothing)."""
    return dict(snap.cliques) if snap.cliques else member_cliques(snap.members, snap.reports)


@dataclass(frozen=True, slots=True)
class GuestView:
    """What any guest of the ensemble would write, and nothing else.

    The generation moves exactly when this changes, so a guest long-polling
    with ``wait=G`` is woken for every change it must act on and for no other.
    Anything a guest renders from the registry (pins, and what later decides
    which peers a guest pins) belongs here; phases, node names and reports do
    not.
    """

    #: (index, IP) of every published member, by index.
    pins: tuple[tuple[int, str], ...] = ()
    #: sha256 of the CA bundle guests trust (authEncryption): a new bundle (a rotation
    #: starting or its overlap ending) must reach every guest at once, so it renews.
    ca_bundle_sha256: str | None = None
    #: (index, clique) of the members whose NVLink clique is known, when they span two
    #: or more cliques (each guest then pins only its own clique's peers); empty otherwise,
    #: since one clique (or none known) changes nothing any guest writes.
    cliques: tuple[tuple[int, str], ...] = ()

    @classmethod
    def of(
        cls,
        members: Iterable[PublishedMember],
        ca: CaPublished | None = None,
        reports: Mapping[int, GuestReport] | None = None,
    ) -> GuestView:
        listed = tuple(members)
        return cls(
            pins=tuple((p.member.index, p.member.ip) for p in listed),
            ca_bundle_sha256=ca.bundle_sha256 if ca is not None else None,
            cliques=tuple(sorted(split(member_cliques(listed, reports or {})).items())),
        )


@dataclass(frozen=True, slots=True)
class CaPublished:
    """What guests learn about the ensemble's CA from the registry (fingerprints only).

    Guests never trust a CA for coming from the registry: they check the bundle
    against the fingerprint pinned in their user-data (issue 19, "Trust bootstrap").
    """

    #: hex sha256 of the current CA certificate's DER (``status.caSHA256``).
    sha256: str
    #: hex sha256 of the PEM bundle the certificate endpoint answers with.
    bundle_sha256: str


@dataclass(frozen=True, slots=True)
class Absent:
    """A VMI of the ensemble that holds no published slot, and why (``reason``: a status
    reason such as MemberNotRunning, NoAddress, DuplicateIndex; members.py decides)."""

    vmi: str
    index: int | None
    phase: str
    reason: str


@dataclass(frozen=True, slots=True)
class EnsembleSnapshot:
    spec: EnsembleSpec
    generation: int
    members: tuple[PublishedMember, ...]
    problems: tuple[str, ...]
    changed_at: float
    reports: Mapping[int, GuestReport] = field(default_factory=dict)
    #: the ensemble's CA (authEncryption on and the CA exists), else None.
    ca: CaPublished | None = None
    #: the served ``GuestView.cliques``: (index, clique) when the members span two or more
    #: NVLink cliques, else empty. What guests pin follows this, not this replica's reports.
    cliques: tuple[tuple[int, str], ...] = ()
    #: VMIs of the ensemble without a published slot (ImexEnsemble status; not served).
    absent: tuple[Absent, ...] = ()
    #: per NVLink clique its members report: the other ensembles whose members report it
    #: too (state/shared.py; State keeps it across ensembles). Informational only.
    shared: tuple[tuple[str, tuple[EnsembleId, ...]], ...] = ()

    @property
    def ens(self) -> EnsembleId:
        return self.spec.ens

    def pins(self) -> dict[int, str]:
        """index -> IP of the published members (what guests pin)."""
        return {p.member.index: p.member.ip for p in self.members}

    def member(self, index: int) -> PublishedMember | None:
        for p in self.members:
            if p.member.index == index:
                return p
        return None
