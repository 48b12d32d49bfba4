"""What a reader of a guest's two managed files may see: pure verdicts on one read.

Invariant 2 ("no torn or empty file, ever") needs a definition of torn that does not
depend on what the agent meant to write, since the reader reads between writes:

**hosts file** (``/etc/hosts``, written in place under a bind mount):
- empty: torn (an in-place write that truncates first would show this);
- every line is blank, a comment, or ``IP name...`` with a valid IP (a write cut short
  leaves the new content followed by a tail of the old one: a line that is not an
  entry);
- our block, when there is one: exactly one BEGIN, then exactly ``max_members`` slot
  lines in index order, each ``IP<TAB>slot``, then END. Lines with our slot names
  outside the block, or an END without a BEGIN, are torn too;
- no block at all is *not* torn: a VM before the agent's first write, and the moment
  after cloud-init's rewrite (the agent puts it back within about 0.1 s), have none.

**nodes file** (``nodes_config.cfg``, written by rename): exactly the bytes
:func:`imex_shared.render.render_nodes_config` gives in names mode. Empty is allowed
only between a boot (the sandbox writes the image's empty file) and the agent's first
write, which the reader is told about (``boot`` below).
"""

from __future__ import annotations

from dataclasses import dataclass

from imex_shared.model import EnsembleId, UnusableAddress, parse_ip
from imex_shared.render import render_nodes_config


@dataclass(frozen=True)
class HostsRead:
    ok: bool
    why: str = ""
    #: the block's pins (index -> IP, absent slots included), None: no block
    block: dict[int, str] | None = None


def check_hosts(data: bytes, ens: EnsembleId, max_members: int) -> HostsRead:
    """The verdict on one read of the hosts file (see the module docstring)."""
    if not data:
        return HostsRead(False, "empty")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        return HostsRead(False, f"not UTF-8 at byte {e.start}")
    lines = text.split("\n")
    begin = [n for n, ln in enumerate(lines) if ln.strip() == ens.block_begin]
    end = [n for n, ln in enumerate(lines) if ln.strip() == ens.block_end]
    if len(begin) > 1 or len(end) > 1:
        return HostsRead(False, f"{len(begin)} BEGIN and {len(end)} END markers")
    if len(begin) != len(end):
        return HostsRead(False, "a block marker without its pair")
    block_lines: range = range(0)
    block: dict[int, str] | None = None
    if begin:
        b, e = begin[0], end[0]
        if e - b - 1 != max_members:
            return HostsRead(False, f"the block has {e - b - 1} lines, not {max_members}")
        block = {}
        for i, ln in enumerate(lines[b + 1:e]):
            parts = ln.split("\t")
            if len(parts) != 2 or parts[1] != ens.slot(i):
                return HostsRead(False, f"block line {i} is {ln!r}")
            try:
                block[i] = str(parse_ip(parts[0]))
            except UnusableAddress:
                return HostsRead(False, f"block line {i} has a bad address: {ln!r}")
        block_lines = range(b, e + 1)
    for n, ln in enumerate(lines):
        if n in block_lines:
            continue
        body = ln.split("#", 1)[0].strip()
        if not body:
            continue
        fields = body.split()
        if len(fields) < 2:
            return HostsRead(False, f"line {n + 1} is not an entry: {ln!r}")
        try:
            parse_ip(fields[0])
        except UnusableAddress:
            return HostsRead(False, f"line {n + 1} has no valid address: {ln!r}")
        if any(ens.slot_index(name) is not None for name in fields[1:]):
            return HostsRead(False, f"line {n + 1} names our slot outside the block: {ln!r}")
    return HostsRead(True, "", block)


def check_nodes(data: bytes, ens: EnsembleId, max_members: int, booting: bool) -> str:
    """'' when the read is whole, else why not; ``booting``: no agent write since boot."""
    if not data and booting:
        return ""
    want = render_nodes_config(ens, max_members, "names")
    if data == want:
        return ""
    if not data:
        return "empty"
    return f"{len(data)} bytes that are not the {len(want)}-byte names-mode file"
