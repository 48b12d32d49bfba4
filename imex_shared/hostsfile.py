"""Merge our block into an existing ``/etc/hosts``, keeping every other byte.

Rules (DESIGN.md "Guest files"):
- bytes outside our block are kept as they are: CRLF endings, tabs, comments,
  IPv6 lines, other tools' blocks, other ensembles' blocks;
- a line outside the block that maps one of *our* slot names loses that name
  (and disappears when nothing else is left on it): duplicate entries for one
  name broke CUDA in the pod-based driver;
- our block is replaced where it stands, or appended (adding only the one
  newline a final line without one needs);
- merging the output again changes nothing.

Only ``\\n`` ends a line here, as for glibc's hosts parser; a ``\\r`` before it
is part of the line's ending and kept.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from imex_shared.model import EnsembleId, UnusableAddress, parse_ip
from imex_shared.render import render_hosts_block


def _lines(data: bytes) -> Iterator[bytes]:
    """Lines with their ``\\n`` kept; the last one may lack it."""
    start = 0
    while start < len(data):
        end = data.find(b"\n", start)
        if end < 0:
            yield data[start:]
            return
        yield data[start : end + 1]
        start = end + 1


def _text(line: bytes) -> str:
    return line.rstrip(b"\r\n").decode("utf-8", "surrogateescape")


def _fields(line: bytes) -> tuple[str, list[str], str] | None:
    """(ip, names, comment) of a hosts entry line, or None for anything else."""
    text = _text(line)
    body, hash_, comment = text.partition("#")
    parts = body.split()
    if len(parts) < 2:
        return None
    try:
        parse_ip(parts[0])
    except UnusableAddress:
        return None
    return parts[0], parts[1:], hash_ + comment


def _is_our_slot_line(ens: EnsembleId, line: bytes) -> bool:
    fields = _fields(line)
    return fields is not None and all(ens.slot_index(n) is not None for n in fields[1])


def _strip_our_names(ens: EnsembleId, line: bytes) -> bytes | None:
    """The line without our slot names; None to drop it; itself when untouched."""
    fields = _fields(line)
    if fields is None:
        return line
    ip, names, comment = fields
    keep = [n for n in names if ens.slot_index(n) is None]
    if len(keep) == len(names):
        return line
    if not keep:
        return None
    ending = line[len(line.rstrip(b"\r\n")) :]
    rebuilt = "\t".join([ip, " ".join(keep)]) + (f" {comment}" if comment else "")
    return rebuilt.encode("utf-8", "surrogateescape") + ending


def _block_span(ens: EnsembleId, lines: list[bytes], begin: int) -> int:
    """Index one past the end of the block starting at ``begin``.

    With no END marker (someone cut the file), the block is the BEGIN line and
    the slot lines right after it, so we never swallow foreign lines.
    """
    for j in range(begin + 1, len(lines)):
        text = _text(lines[j]).strip()
        if text == ens.block_end:
            return j + 1
        if text == ens.block_begin:
            break
    j = begin + 1
    while j < len(lines) and _is_our_slot_line(ens, lines[j]):
        j += 1
    return j


def merge_hosts(
    existing: bytes, ens: EnsembleId, max_members: int, pins: Mapping[int, str]
) -> bytes:
    """The whole hosts file with our block for ``pins`` merged into ``existing``."""
    block = render_hosts_block(ens, max_members, pins)
    lines = list(_lines(existing))
    out: list[bytes] = []
    placed = False
    i = 0
    while i < len(lines):
        line = lines[i]
        if _text(line).strip() == ens.block_begin:
            end = _block_span(ens, lines, i)
            if not placed:
                if out and not out[-1].endswith(b"\n"):
                    out[-1] += b"\n"
                out.append(block)
                placed = True
            i = end
            continue
        kept = _strip_our_names(ens, line)
        if kept is not None:
            out.append(kept)
        i += 1
    if not placed:
        if out and not out[-1].endswith(b"\n"):
            out[-1] += b"\n"
        out.append(block)
    return b"".join(out)


def read_block(existing: bytes, ens: EnsembleId) -> dict[int, str] | None:
    """index -> IP as our block in ``existing`` pins them; None when there is no block."""
    lines = list(_lines(existing))
    for i, line in enumerate(lines):
        if _text(line).strip() != ens.block_begin:
            continue
        pins: dict[int, str] = {}
        for entry in lines[i + 1 : _block_span(ens, lines, i)]:
            fields = _fields(entry)
            if fields is None:
                continue
            for name in fields[1]:
                index = ens.slot_index(name)
                if index is not None:
                    pins[index] = str(parse_ip(fields[0]))
        return pins
    return None
