"""IMEX's view of the domain and the GPUs' fabric identity, checked before anything trusts them.

Pure and dependency-free, shared by the guest (which collects) and the host agent (which
renders the matrix). Why each rule (FACTS.md "IMEX: the domain view, cliques, channels"):

- ``nvidia-imex-ctl -N -j`` prints ``{"nodes": {"<id>": {"status", "host", "hostName",
  "connections": {"<id>": {"host", "status", "changed"}}, "version"}}, "timestamp",
  "status"}``; the node id is the line of the nodes file, which is our slot index. The
  guest forwards it only after :func:`clean_imex_domain` rebuilt it from the known fields
  of the right types, node ids inside the ensemble, words that are words: a daemon (or
  anything else on the ctl's path) printing garbage, a truncated line or a hostile
  document costs a counted error, never a crash, and nothing raw leaves the guest.
- Strict only about what is used (issue 30): the node ids, the ``connections`` and each
  link's ``status`` word (the link matrix), and the objects that hold them. Every other
  field (a node's ``status``, ``host``, ``hostName``, ``version``; a link's ``host`` and
  ``changed``; the document's ``timestamp`` and ``status``) is forwarded when it has the
  type every registry version accepts and left out otherwise: IMEX does not document the
  type of ``changed``, and a ``"changed": false`` must not cost the view. A node's
  ``status`` is sent as ``UNKNOWN`` when missing or not a word: registries before this
  rule require one.
- Link words: IMEX documents CONNECTED and INVALID for the JSON; for the other states of
  the text legend the JSON word is undocumented, so we assume the legend's name in
  capitals with underscores (DISCONNECTED, NEVER_CONNECTED, RECOVERING, AUTHENTICATING).
  MISMATCH is the stand-in's word for a node-map mismatch (``!M!`` in the text table).
- ``nvidia-smi -q`` prints a ``Fabric`` section per GPU (State, Status, CliqueId,
  ClusterUUID; ``N/A`` without a fabric). The GPUs of one tray share one clique; GPUs that
  disagree are reported as an error, not guessed between.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

#: The compact encoding of a cleaned ``imex_domain`` must fit in this, so the whole status
#: report (a few hundred bytes more) fits in the registry's 64 KiB limit.
IMEX_DOMAIN_MAX_BYTES: Final = 63 * 1024
#: Read at most this much of the ctl's / nvidia-smi's output; more is treated as garbage.
OUTPUT_MAX_BYTES: Final = 1 << 20

#: Link state word -> the letter of nvidia-imex-ctl's connectivity legend.
STATE_LETTERS: Final[Mapping[str, str]] = {
    "CONNECTED": "C",
    "DISCONNECTED": "D",
    "NEVER_CONNECTED": "N",
    "INVALID": "I",
    "RECOVERING": "R",
    "AUTHENTICATING": "A",
    "MISMATCH": "M",
}
CONNECTED: Final = "CONNECTED"
SELF_CELL: Final = "."
UNKNOWN_CELL: Final = "?"
#: a node's ``status`` when IMEX printed none, or not a word (module docstring)
NODE_STATUS_UNKNOWN: Final = "UNKNOWN"
OTHER_CLIQUE_CELL: Final = "-"
MATRIX_LABEL: Final = "Nodes From\\To"

_WORD = re.compile(r"^[A-Z][A-Z0-9_]{0,31}$")
_INDEX = re.compile(r"^(0|[1-9][0-9]{0,5})$")
_UUID = re.compile(r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$")
_MAX_TEXT = 255
_MAX_INT = 2**63 - 1
_CLIQUE_MAX = 2**32 - 1


class DomainError(ValueError):
    """Output of nvidia-imex-ctl or nvidia-smi that cannot be trusted; says what is wrong."""


def letter(state: str | None) -> str:
    """The matrix letter of a link state word (``?`` when unknown or absent)."""
    if state is None:
        return UNKNOWN_CELL
    return STATE_LETTERS.get(state, UNKNOWN_CELL)


# --- nvidia-imex-ctl -N -j ------------------------------------------------------------


def _word(value: object, where: str) -> str:
    if not isinstance(value, str) or not _WORD.match(value):
        raise DomainError(f"{where}: {_short(value)} is not a state word")
    return value


def _text(value: object, where: str) -> str:
    if not isinstance(value, str) or len(value) > _MAX_TEXT or not value.isprintable():
        raise DomainError(f"{where}: {_short(value)} is not a short printable string")
    return value


def _stamp(value: object, where: str) -> int | float | str:
    if isinstance(value, bool):
        raise DomainError(f"{where}: a boolean is not a time")
    if isinstance(value, int):
        if not 0 <= value <= _MAX_INT:
            raise DomainError(f"{where}: {value} is out of range")
        return value
    if isinstance(value, float):
        if not 0.0 <= value < 1e18:
            raise DomainError(f"{where}: {value} is out of range")
        return value
    if isinstance(value, str) and len(value) <= 64 and value.isprintable():
        return value
    raise DomainError(f"{where}: {_short(value)} is not a time")


def _index(key: object, max_members: int, where: str) -> int:
    if not isinstance(key, str) or not _INDEX.match(key):
        raise DomainError(f"{where}: node id {_short(key)} is not a decimal index")
    index = int(key)
    if index >= max_members:
        raise DomainError(
            f"{where}: node id {index} is outside the ensemble (0..{max_members - 1})"
        )
    return index


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _mapping(value: object, where: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise DomainError(f"{where}: expected an object, got {type(value).__name__}")
    return value


def _optional(out: dict[str, Any], source: Mapping[str, Any], name: str,
              check: Callable[[object, str], object]) -> None:
    """Copy an unused field into ``out`` when ``check`` passes it; leave it out otherwise."""
    if name in source:
        with contextlib.suppress(DomainError):
            out[name] = check(source[name], name)


def clean_imex_domain(doc: object, max_members: int) -> dict[str, Any]:
    """``-N -j`` rebuilt from its known fields (raises DomainError naming the bad part).

    Unknown fields are left out, and so are the unused known ones whose value does not
    pass its check (module docstring); missing optional ones stay missing;
    ``connections`` defaults to empty (a node that is down lists none in some versions).
    """
    top = _mapping(doc, "imex_domain")
    return _finish(_clean_nodes(top.get("nodes"), max_members), top)


def _clean_nodes(value: object, max_members: int) -> dict[str, Any]:
    """The ``nodes`` object rebuilt (clean_imex_domain): nearly all of a clean's cost."""
    nodes_in = _mapping(value, "imex_domain.nodes")
    if len(nodes_in) > max_members:
        raise DomainError(
            f"imex_domain.nodes: {len(nodes_in)} nodes, the ensemble has {max_members} slots"
        )
    nodes: dict[str, Any] = {}
    for key, raw in nodes_in.items():
        where = f"imex_domain.nodes[{_short(key)}]"
        index = _index(key, max_members, where)
        node = _mapping(raw, where)
        # a node's state word is unused, but registries before issue 30 require one: a
        # missing or bad one goes as UNKNOWN so that no registry refuses the report
        out: dict[str, Any] = {"status": NODE_STATUS_UNKNOWN}
        _optional(out, node, "status", _word)
        for name in ("host", "hostName", "version"):
            _optional(out, node, name, _text)
        conns_in = _mapping(node.get("connections", {}), f"{where}.connections")
        if len(conns_in) > max_members:
            raise DomainError(f"{where}.connections: {len(conns_in)} entries, too many")
        conns: dict[str, Any] = {}
        for ckey, craw in conns_in.items():
            cwhere = f"{where}.connections[{_short(ckey)}]"
            peer = _index(ckey, max_members, cwhere)
            if peer == index:
                raise DomainError(f"{cwhere}: a node's connection to itself")
            conn = _mapping(craw, cwhere)
            c: dict[str, Any] = {"status": _word(conn.get("status"), f"{cwhere}.status")}
            _optional(c, conn, "host", _text)
            _optional(c, conn, "changed", _stamp)
            conns[str(peer)] = c
        out["connections"] = conns
        nodes[str(index)] = out
    return nodes


def _finish(nodes: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    """The cleaned document around cleaned ``nodes``: the top-level fields, the size."""
    cleaned: dict[str, Any] = {"nodes": nodes}
    _optional(cleaned, top, "timestamp", _stamp)
    _optional(cleaned, top, "status", _word)
    size = len(encode_compact(cleaned))
    if size > IMEX_DOMAIN_MAX_BYTES:
        raise DomainError(
            f"imex_domain: {size} bytes once cleaned, over the {IMEX_DOMAIN_MAX_BYTES} allowed"
        )
    return cleaned


def decode_imex_domain(output: bytes) -> object:
    """The ctl's stdout (``-N -j``) as JSON, not yet checked; DomainError when it is not."""
    if len(output) > OUTPUT_MAX_BYTES:
        raise DomainError(f"nvidia-imex-ctl -N -j printed over {OUTPUT_MAX_BYTES} bytes")
    try:
        return json.loads(output.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise DomainError(f"nvidia-imex-ctl -N -j: not UTF-8 ({exc.reason})") from exc
    except RecursionError as exc:
        raise DomainError("nvidia-imex-ctl -N -j: JSON nested too deeply") from exc
    except ValueError as exc:
        raise DomainError(f"nvidia-imex-ctl -N -j: not JSON ({exc})") from exc


def parse_imex_domain(output: bytes, max_members: int) -> dict[str, Any]:
    """The ctl's stdout (``-N -j``) -> a cleaned document, or DomainError."""
    return clean_imex_domain(decode_imex_domain(output), max_members)


class DomainParser:
    """``parse_imex_domain`` for one caller that asks again and again (the guest's
    collector): it keeps the last ``nodes`` it cleaned beside what it cleaned them from.

    Why: IMEX stamps every print of ``-N -j`` with a new ``timestamp``, but the nodes,
    nearly all of a clean's cost (~1 ms of CPU at 18 nodes), change only when a link
    does. Equal nodes (compared in C, as decoded JSON) get the kept clean again: the
    result is the same document ``parse_imex_domain`` returns, whose ``nodes`` object
    may be shared between calls, so callers must not change it.
    """

    def __init__(self, max_members: int) -> None:
        self.max_members = max_members
        self._kept: tuple[object, dict[str, Any]] | None = None

    def parse(self, output: bytes) -> dict[str, Any]:
        top = _mapping(decode_imex_domain(output), "imex_domain")
        raw = top.get("nodes")
        kept = self._kept
        if kept is not None and kept[0] == raw:
            nodes = kept[1]
        else:
            nodes = _clean_nodes(raw, self.max_members)
            self._kept = (raw, nodes)
        return _finish(nodes, top)


def encode_compact(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":"), ensure_ascii=True).encode()


def own_entry(doc: object, index: int) -> Mapping[str, Any] | None:
    """Node ``index``'s own entry in a ``-N -j`` document (None: no such entry, or not a
    document): the only part of a member's view the registry keeps."""
    nodes = doc.get("nodes") if isinstance(doc, Mapping) else None
    node = nodes.get(str(index)) if isinstance(nodes, Mapping) else None
    return node if isinstance(node, Mapping) else None


def own_view(doc: Mapping[str, Any], index: int | None) -> dict[str, Any]:
    """The part of a cleaned ``-N -j`` document that a member reports: its own entry
    (none when the view does not list node ``index``, or ``index`` is None) and the
    top-level fields.

    Why: every registry, 0.1.0's included, keeps only the reporting member's own row;
    the other 17 entries of an 18-node view (~21 KB of its ~23) cost the guest two JSON
    encodes per report (the body and :func:`domain_key`) and the registry ~1 ms of
    checking, for nothing. What a member says about its peers' links is theirs to report.
    """
    own = own_entry(doc, index) if index is not None else None
    return {"nodes": {str(index): own} if own is not None else {},
            **{k: v for k, v in doc.items() if k != "nodes"}}


def own_row(doc: Mapping[str, Any], index: int) -> dict[int, str] | None:
    """Peer index -> link state word from node ``index``'s own entry (None if absent)."""
    node = own_entry(doc, index)
    if node is None:
        return None
    conns = node.get("connections", {})
    return {int(k): str(v["status"]) for k, v in conns.items()}


# --- the matrix text (docs/host-agent.md "The link matrix") ---------------------------


def matrix_lines(columns: Sequence[int], rows: Iterable[tuple[int, Sequence[str]]]) -> list[str]:
    """Header and one line per row: cells right-aligned to the widest index (at least 2)."""
    width = max([2, *(len(str(c)) for c in columns)])
    label = len(MATRIX_LABEL)
    lines = [MATRIX_LABEL + "".join(" " + str(c).rjust(width) for c in columns)]
    for index, cells in rows:
        lines.append(str(index).rjust(label) + "".join(" " + c.rjust(width) for c in cells))
    return lines


# --- nvidia-smi -q --------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Fabric:
    """A GPU's NVLink fabric identity; ``key`` is how cliques are named everywhere."""

    cluster_uuid: str
    clique_id: int

    @property
    def key(self) -> str:
        return f"{self.cluster_uuid}.{self.clique_id}"

    def to_json(self) -> dict[str, Any]:
        return {"cluster_uuid": self.cluster_uuid, "clique_id": self.clique_id}


def check_fabric(cluster_uuid: object, clique_id: object) -> Fabric:
    """A validated Fabric (raises DomainError)."""
    if not isinstance(cluster_uuid, str) or not _UUID.match(cluster_uuid):
        raise DomainError(f"fabric.cluster_uuid {_short(cluster_uuid)} is not a UUID")
    if isinstance(clique_id, bool) or not isinstance(clique_id, int):
        raise DomainError(f"fabric.clique_id {_short(clique_id)} is not an integer")
    if not 0 <= clique_id <= _CLIQUE_MAX:
        raise DomainError(f"fabric.clique_id {clique_id} is out of range 0..{_CLIQUE_MAX}")
    return Fabric(cluster_uuid, clique_id)


def _fabric_sections(text: str) -> list[dict[str, str]]:
    """The ``Key : Value`` lines directly under each ``Fabric`` heading."""
    sections: list[dict[str, str]] = []
    current: dict[str, str] | None = None
    depth = -1
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped:
            continue
        indent = len(line) - len(line.lstrip(" "))
        if current is not None:
            if indent <= depth:
                current = None
            else:
                key, sep, value = stripped.partition(":")
                if sep and key.strip() and key.strip() not in current:
                    current[key.strip()] = value.strip()
                continue
        if stripped == "Fabric":
            current = {}
            depth = indent
            sections.append(current)
    return sections


def fabric_sections(text: str) -> list[dict[str, str]]:
    """Each GPU's ``Fabric`` section of ``nvidia-smi -q`` as key -> value (State, Status,
    CliqueId, ClusterUUID, ...), in GPU order."""
    return _fabric_sections(text)


def parse_fabric(output: bytes) -> Fabric | None:
    """The tray's fabric from ``nvidia-smi -q``: None without one, DomainError on garbage."""
    if len(output) > OUTPUT_MAX_BYTES:
        raise DomainError(f"nvidia-smi -q printed over {OUTPUT_MAX_BYTES} bytes")
    try:
        text = output.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise DomainError(f"nvidia-smi -q: not UTF-8 ({exc.reason})") from exc
    found: set[Fabric] = set()
    for section in _fabric_sections(text):
        uuid = section.get("ClusterUUID", "N/A")
        clique = section.get("CliqueId", "N/A")
        if uuid in ("N/A", "") or clique in ("N/A", ""):
            continue  # this GPU has no fabric (not an NVLink-fabric GPU, or not set up)
        if section.get("State", "Completed") != "Completed":
            continue  # registration still in progress: no identity yet
        if not (clique.isascii() and clique.isdigit()):  # "²" is a digit int() refuses
            raise DomainError(f"nvidia-smi -q: CliqueId {_short(clique)} is not a number")
        found.add(check_fabric(uuid, int(clique)))
    if len(found) > 1:
        keys = ", ".join(sorted(f.key for f in found))
        raise DomainError(f"nvidia-smi -q: the GPUs report different cliques ({keys})")
    return next(iter(found), None)
