"""The ensemble model shared by both agents: identity, slot names, members.

Dependency-free on purpose: the guest installs it without FastAPI or a
Kubernetes client, and host_agent imports it so that both sides derive slot
names and validate addresses in exactly one way.

Naming contract (DESIGN.md "Names"): the domain id is the first 8 hex digits
of sha256("<namespace>/<name>"); slot i is ``imex-<domain id>-<i>``. The name
depends only on the ensemble, so the nodes file is identical on every member
and two ensembles never share one (the pod-based driver learnt that the hard
way when IP reuse let two same-sized domains accept each other's peers).
"""

from __future__ import annotations

import hashlib
import ipaddress
import re
from dataclasses import dataclass
from typing import Final

#: Where an absent slot is pinned, so IMEX never asks DNS for it (FACTS.md:
#: unpinned slots leaked to cluster DNS, multiplied by search domains).
ABSENT_IP: Final = "127.0.0.2"

#: One IMEX domain on an NVL72 rack holds at most 18 nodes (one per tray).
DEFAULT_MAX_MEMBERS: Final = 18
#: The one bound on an ensemble's size, everywhere (the ImexEnsemble CRD, the
#: Service annotation, the guest config): an EndpointSlice holds at most 1000
#: endpoints, and a nodes file longer than that is a typo, not a rack.
MAX_MEMBERS_LIMIT: Final = 1000
DEFAULT_PORT: Final = 50000
#: nodes_config.cfg modes: slot names (IMEX 570.158.01+) or the members' IPs.
MODES: Final = ("names", "ips")
DEFAULT_MODE: Final = "names"
DEFAULT_ZONE: Final = "cluster.local"

#: Addresses a masquerade-bound guest reports about itself. They are the same
#: in every VM, so peers can never reach a member through them (FACTS.md,
#: KubeVirt masquerade; kubevirt#18760).
GUEST_INTERNAL: Final = frozenset(
    {ipaddress.ip_address("10.0.2.2"), ipaddress.ip_address("fd10:0:2::2")}
)

#: A sha256 digest as both agents write it (token hashes, CA fingerprints, file digests):
#: 64 lowercase hex digits. The CRD's schema, the registry's models and the checks below
#: all use this one pattern.
SHA256_HEX_PATTERN: Final = "^[0-9a-f]{64}$"
_SHA256_HEX = re.compile(SHA256_HEX_PATTERN)

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_TRAILING_INDEX = re.compile(r"-(\d+)$", re.ASCII)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address


class ModelError(ValueError):
    """A value that does not fit the ensemble model; the message says why."""


class InvalidName(ModelError):
    """A namespace, ensemble or VMI name that is not a DNS label."""


class InvalidIndex(ModelError):
    """A slot index that is missing, not a number, or out of range."""


class UnusableAddress(ModelError):
    """An address peers could not reach (or not an address at all)."""


def is_decimal(text: object) -> bool:
    """Only ASCII digits: ``str.isdigit()`` also accepts ``²`` and Arabic-Indic digits,
    which ``int()`` refuses or reads as another number (issue 30's fuzzing found both)."""
    return isinstance(text, str) and text.isascii() and text.isdigit()


def check_dns_label(value: str, what: str) -> str:
    """Return ``value`` if it is a lowercase RFC 1123 label, else raise naming ``what``."""
    if not isinstance(value, str) or not _DNS_LABEL.match(value):
        raise InvalidName(f"{what} {value!r} is not a lowercase RFC 1123 label")
    return value


def domain_id(namespace: str, name: str) -> str:
    """First 8 hex digits of sha256("<namespace>/<name>")."""
    return hashlib.sha256(f"{namespace}/{name}".encode()).hexdigest()[:8]


@dataclass(frozen=True, slots=True)
class EnsembleId:
    """An ensemble: the headless Service ``name`` in ``namespace``."""

    namespace: str
    name: str

    def __post_init__(self) -> None:
        check_dns_label(self.namespace, "namespace")
        check_dns_label(self.name, "ensemble name")

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def domain_id(self) -> str:
        return domain_id(self.namespace, self.name)

    def slot(self, index: int) -> str:
        """Slot name for ``index``: ``imex-<domain id>-<index>``, no padding."""
        if index < 0:
            raise InvalidIndex(f"slot index {index} is negative")
        return f"imex-{self.domain_id}-{index}"

    def slot_index(self, slot: str) -> int | None:
        """The index encoded in one of *our* slot names, else None."""
        prefix = f"imex-{self.domain_id}-"
        if not slot.lower().startswith(prefix):
            return None
        tail = slot[len(prefix) :]
        if not is_decimal(tail) or (len(tail) > 1 and tail[0] == "0"):
            return None
        return int(tail)

    def service_fqdn(self, zone: str = DEFAULT_ZONE) -> str:
        return f"{self.name}.{self.namespace}.svc.{zone.strip('.')}"

    def slot_fqdn(self, index: int, zone: str = DEFAULT_ZONE) -> str:
        return f"{self.slot(index)}.{self.service_fqdn(zone)}"

    def srv_name(self, zone: str = DEFAULT_ZONE) -> str:
        return f"_imex._tcp.{self.service_fqdn(zone)}"

    @property
    def block_begin(self) -> str:
        return f"# BEGIN imex-ensemble {self.key}"

    @property
    def block_end(self) -> str:
        return f"# END imex-ensemble {self.key}"


def ipv4_octets(text: str) -> tuple[int, int, int, int] | None:
    """The four octets of ``text`` when it is an IPv4 address in canonical dotted-quad
    form (no spaces, prefix or leading zeros), else None.

    A string check, about 20 times cheaper than ``ipaddress`` on the 10,000 distinct
    addresses of a first sync (tests/bench ``sync_profile``); callers fall back to
    ``parse_ip`` on None, so anything else is judged exactly as before.
    """
    parts = text.split(".")
    if len(parts) != 4:
        return None
    for part in parts:
        if not (0 < len(part) <= 3 and part.isascii() and part.isdigit()) or \
                (len(part) > 1 and part[0] == "0"):
            return None
    a, b, c, d = (int(part) for part in parts)
    if max(a, b, c, d) > 255:
        return None
    return a, b, c, d


def parse_ip(text: str) -> IPAddress:
    """Parse an IPv4/IPv6 address, stripping a ``/prefix`` (KubeVirt may report one).

    Raises UnusableAddress for anything that is not an address.
    """
    if not isinstance(text, str) or not text.strip():
        raise UnusableAddress(f"{text!r} is not an IP address")
    raw = text.strip().split("/", 1)[0]
    if "%" in raw:
        raise UnusableAddress(f"{text!r} has a zone index; peers cannot use it")
    try:
        return ipaddress.ip_address(raw)
    except ValueError as exc:
        raise UnusableAddress(f"{text!r} is not an IP address") from exc


def unusable_reason(addr: IPAddress) -> str | None:
    """Why peers could not reach ``addr``, or None when they can."""
    if addr in GUEST_INTERNAL:
        return f"{addr} is the guest-internal masquerade address, not reachable from peers"
    if addr.is_loopback:
        return f"{addr} is a loopback address, not reachable from peers"
    if addr.is_link_local:
        return f"{addr} is a link-local address, not reachable from peers"
    if addr.is_unspecified:
        return f"{addr} is the unspecified address, not reachable from peers"
    if addr.is_multicast:
        return f"{addr} is a multicast address, not reachable from peers"
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return f"{addr} is an IPv4-mapped IPv6 address; publish the IPv4 address instead"
    return None


def usable_ip(text: str) -> str:
    """Canonical text of an address peers can reach, else UnusableAddress with the reason."""
    addr = parse_ip(text)
    reason = unusable_reason(addr)
    if reason is not None:
        raise UnusableAddress(reason)
    return str(addr)


def check_index(index: object, max_members: int) -> int:
    """Validate a slot index against the ensemble size."""
    if isinstance(index, bool) or not isinstance(index, int):
        raise InvalidIndex(f"slot index {index!r} is not an integer")
    if index < 0:
        raise InvalidIndex(f"slot index {index} is negative")
    if index >= max_members:
        raise InvalidIndex(
            f"slot index {index} is out of range: the ensemble has {max_members} slots "
            f"(0..{max_members - 1})"
        )
    return index


def index_from_name(name: str) -> int | None:
    """The trailing ``-<n>`` of a VMI name (VirtualMachinePool naming), else None."""
    m = _TRAILING_INDEX.search(name)
    if m is None:
        return None
    digits = m.group(1)
    if len(digits) > 1 and digits[0] == "0":
        return None
    return int(digits)


@dataclass(frozen=True, slots=True)
class Member:
    """One published member: slot ``index`` reachable at ``ip``.

    ``vmi``, ``node``, ``phase`` and ``ready`` are what the host agent knows
    about it; a guest learning members from DNS only has index and ip.
    """

    index: int
    ip: str
    vmi: str | None = None
    node: str | None = None
    phase: str | None = None
    ready: bool | None = None
    #: ``"<cluster_uuid>.<clique_id>"`` of its GPUs' NVLink fabric, as the registry says
    clique: str | None = None

    @classmethod
    def checked(
        cls,
        index: object,
        ip: str,
        max_members: int,
        *,
        vmi: str | None = None,
        node: str | None = None,
        phase: str | None = None,
        ready: bool | None = None,
        clique: str | None = None,
    ) -> Member:
        """Build a member after validating index and address (raises ModelError)."""
        return cls(
            index=check_index(index, max_members),
            ip=usable_ip(ip),
            vmi=vmi,
            node=node,
            phase=phase,
            ready=ready,
            clique=clique,
        )


def members_from_json(data: object, max_members: int) -> list[Member]:
    """Parse ``[{"index": 0, "ip": "10.0.0.1"}, ...]`` (the ``render --members`` file).

    Every entry is validated; the first bad one raises ModelError naming it.
    Two entries for one index are refused: a slot has one address.
    """
    if not isinstance(data, list):
        raise ModelError('members must be a JSON list of {"index": N, "ip": "A"} objects')
    seen: dict[int, Member] = {}
    for pos, entry in enumerate(data):
        if not isinstance(entry, dict):
            raise ModelError(f"members[{pos}] is not an object")
        unknown = set(entry) - {"index", "ip", "vmi", "node", "phase", "ready", "slot"}
        if unknown:
            raise ModelError(f"members[{pos}] has unknown field(s) {sorted(unknown)}")
        if "index" not in entry or "ip" not in entry:
            raise ModelError(f"members[{pos}] needs both 'index' and 'ip'")
        ip = entry["ip"]
        if not isinstance(ip, str):
            raise UnusableAddress(f"members[{pos}].ip {ip!r} is not a string")
        try:
            member = Member.checked(entry["index"], ip, max_members)
        except ModelError as exc:
            raise type(exc)(f"members[{pos}]: {exc}") from exc
        if member.index in seen:
            raise InvalidIndex(f"members[{pos}]: slot index {member.index} appears twice")
        seen[member.index] = member
    return [seen[i] for i in sorted(seen)]


def pins_of(members: list[Member] | tuple[Member, ...]) -> dict[int, str]:
    """index -> IP map of members (the input of every renderer)."""
    return {m.index: m.ip for m in members}


def is_sha256_hex(text: str) -> bool:
    """``text`` is a sha256 digest in the form ``SHA256_HEX_PATTERN`` describes."""
    return bool(_SHA256_HEX.match(text))
