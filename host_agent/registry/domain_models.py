"""The status report's domain fields as the registry accepts them, and what it keeps of them.

A guest's ``imex_domain`` is its ``nvidia-imex-ctl -N -j`` (cleaned by the guest with
``imex_shared.imex_domain.clean_imex_domain``); the registry checks it again, because a report
comes from a VM: wrong types, words that are not words, more nodes than an ensemble can
hold, node ids outside the ensemble and nesting deeper than the parser allows are all
422, never a crash. The body itself is at most 64 KiB (refused before parsing otherwise).

The raw document is never kept: :func:`reduce_links` takes the reporting member's *own*
entry (``nodes["<its index>"]``) and keeps one interned state word per peer index. A
copy of another member's row that IMEX relays is ignored, so link i->j only ever comes
from member i.

Only what the registry uses is checked: the node ids, each node's ``connections`` and
each connection's ``status`` word. Every other field (a node's ``status``, ``host``,
``hostName`` and ``version``; a connection's ``host`` and ``changed``; the document's
``timestamp`` and ``status``) is ignored whatever its type, so a field the registry
never reads can never cost a member its report (issue 30: IMEX does not document the
type of ``changed``; a boolean there made every report of a real IMEX a 422).
"""

from __future__ import annotations

import sys
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field

from imex_shared.imex_domain import Fabric

#: Most nodes (and connections per node) an ``imex_domain`` may list: an ensemble's limit.
MAX_NODES = 1000

_Word = Annotated[str, Field(pattern=r"^[A-Z][A-Z0-9_]{0,31}$")]
_Index = Annotated[str, Field(pattern=r"^(0|[1-9][0-9]{0,5})$")]


class ConnectionIn(BaseModel):
    """One link of a node's ``connections``: the state word IMEX printed (``host`` and
    ``changed`` are ignored, whatever their type)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    status: _Word


class NodeIn(BaseModel):
    """One node of ``-N -j``: its outgoing links by peer node id (its ``status``,
    ``host``, ``hostName`` and ``version`` are ignored, whatever their type)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    connections: Annotated[dict[_Index, ConnectionIn], Field(max_length=MAX_NODES)] = {}


class ImexDomainIn(BaseModel):
    """``nvidia-imex-ctl -N -j`` as the guest forwards it (``timestamp`` and ``status``
    are ignored, whatever their type)."""

    model_config = ConfigDict(strict=True, extra="ignore")

    nodes: Annotated[dict[_Index, NodeIn], Field(max_length=MAX_NODES)]


class FabricIn(BaseModel):
    """The guest's NVLink fabric identity (``nvidia-smi -q``, Fabric section)."""

    model_config = ConfigDict(strict=True, extra="forbid")

    cluster_uuid: Annotated[
        str,
        Field(pattern=r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-"
                      r"[0-9a-fA-F]{12}$"),
    ]
    clique_id: Annotated[int, Field(ge=0, le=2**32 - 1)]

    def fabric(self) -> Fabric:
        return Fabric(self.cluster_uuid, self.clique_id)


def index_errors(doc: ImexDomainIn, max_members: int) -> list[dict[str, Any]]:
    """422 details for node ids outside the ensemble (0..max_members-1)."""
    detail: list[dict[str, Any]] = []
    last = max_members - 1
    for key, node in doc.nodes.items():
        if int(key) > last:
            detail.append({"loc": ["imex_domain", "nodes", key],
                           "msg": f"node id {key} is outside the ensemble (0..{last})"})
        for peer in node.connections:
            if int(peer) > last:
                detail.append({"loc": ["imex_domain", "nodes", key, "connections", peer],
                               "msg": f"node id {peer} is outside the ensemble (0..{last})"})
            elif peer == key:
                detail.append({"loc": ["imex_domain", "nodes", key, "connections", peer],
                               "msg": "a node's connection to itself"})
        if len(detail) >= 20:
            break
    return detail


Links = tuple[str | None, ...]


def reduce_links(doc: ImexDomainIn, index: int) -> Links | None:
    """State word per peer index (None: not listed) from member ``index``'s own entry.

    None when the document has no entry for the member itself (then nothing is known
    about its links).
    """
    own = doc.nodes.get(str(index))
    if own is None:
        return None
    width = max((int(k) for k in own.connections), default=-1) + 1
    row: list[str | None] = [None] * width
    for key, conn in own.connections.items():
        row[int(key)] = sys.intern(conn.status)
    return tuple(row)
