"""The shell blocks of the docs that are executed, and the markers that say otherwise.

Every fenced block of the files in ``DOCS`` has a language (an untagged fence could hide
a command). Every ``sh`` block (or ``bash``, ``shell``) is run by ``make docs-test``
(tests/docs/test_docs_run.py), in order, unless the line right above its fence says why
it cannot run here; the marker is an HTML comment, which Markdown renders as nothing:

    <!-- not run: REASON -->                     never run here; REASON says why
    <!-- not run: REASON | instead: CMD -->      CMD runs in the block's place
    <!-- run: id=install-5 cwd=root timeout=300 -->   a run block's options (all optional)

``instead`` is what the reader's shell needs from a block that cannot run for the next
ones to run (the objects a block needing a kubelet would have applied, say): it is the
test's, not the reader's. ``id`` names a block whose output tests/docs/test_docs_run.py
checks, ``cwd=root`` runs it from the tree's root (the doc says the reader is there),
``timeout`` is in seconds (default 120).
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHELL = frozenset({"sh", "bash", "shell"})
#: the docs whose every shell block is run or marked (issue 29)
DOCS = ("README.md", "docs/install.md", "cloudinit/README.md",
        *sorted(str(p.relative_to(REPO)) for p in (REPO / "manifests").rglob("README.md")))

_FENCE = re.compile(r"^(?P<indent> {0,3})```(?P<lang>[^\s`]*)[^\n]*\n(?P<body>.*?)"
                    r"^(?P=indent)```[ \t]*$", re.S | re.M)
_MARKER = re.compile(r"^\s*<!--\s*(?P<kind>not run|run)\s*:(?P<body>.*?)-->\s*$", re.S)
#: a comment that looks like a marker but is not one (a typo must not run a block)
_NEAR = re.compile(r"<!--\s*(not[ _-]?run|no[ _-]?run|skip|run|docs-test)\b", re.I)
MIN_REASON = 20
DEFAULT_TIMEOUT = 120.0


class MarkerError(ValueError):
    """A marker that does not parse."""


@dataclass(frozen=True)
class Block:
    doc: str
    line: int
    lang: str
    text: str
    #: does make docs-test run it (shell blocks without a ``not run`` marker)
    run: bool = False
    reason: str = ""
    instead: str = ""
    options: dict[str, str] = field(default_factory=dict)

    @property
    def where(self) -> str:
        return f"{self.doc}:{self.line}"

    @property
    def id(self) -> str:
        return self.options.get("id", "")

    @property
    def timeout(self) -> float:
        return float(self.options.get("timeout", DEFAULT_TIMEOUT))

    @property
    def marked(self) -> bool:
        return bool(self.reason)


def _parse(where: str, kind: str, body: str) -> tuple[str, str, dict[str, str]]:
    """(reason, instead, options) of one marker."""
    if kind == "not run":
        reason, _, instead = body.partition("| instead:")
        reason = " ".join(reason.split())
        if len(reason) < MIN_REASON:
            raise MarkerError(f"{where}: not run needs a reason of {MIN_REASON}+ characters "
                              f"saying why the block cannot run here, not {reason!r}")
        return reason, " ".join(instead.split()), {}
    options: dict[str, str] = {}
    for word in shlex.split(body):
        key, sep, value = word.partition("=")
        if not sep or key not in ("id", "cwd", "timeout"):
            raise MarkerError(f"{where}: run: takes id=, cwd=, timeout=, not {word!r}")
        if key == "cwd" and value != "root":
            raise MarkerError(f"{where}: cwd= takes only root, not {value!r}")
        if key == "timeout" and not value.replace(".", "", 1).isdigit():
            raise MarkerError(f"{where}: timeout= takes seconds, not {value!r}")
        options[key] = value
    return "", "", options


def blocks(doc: str) -> list[Block]:
    """Every fenced block of ``doc`` (a path under ``REPO``), with its marker; a marker
    that does not parse raises MarkerError naming the block."""
    text = (REPO / doc).read_text()
    out = []
    for m in _FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        where = f"{doc}:{line}"
        above = text[:max(m.start() - 1, 0)].rpartition("\n")[2]  # the line right above
        marker = _MARKER.match(above)
        reason, instead, options = "", "", dict[str, str]()
        if marker:
            reason, instead, options = _parse(where, marker["kind"], marker["body"])
        elif _NEAR.search(above):
            raise MarkerError(f"{where}: {above.strip()!r} is not a marker: write "
                              "<!-- not run: REASON --> or <!-- run: id=... -->")
        lang = m["lang"]
        out.append(Block(doc, line, lang, m["body"], lang in SHELL and not reason,
                         reason, instead, options))
    return out


def shell_blocks(doc: str) -> list[Block]:
    return [b for b in blocks(doc) if b.lang in SHELL]


def plan() -> list[Block]:
    """What make docs-test executes, in order: each doc's shell blocks (a marked block's
    ``instead``, if any, in its place)."""
    return [b for doc in DOCS for b in shell_blocks(doc) if b.run or b.instead]


def problems() -> list[str]:
    """What breaks the rule: an untagged fence, a marker that does not parse or sits on a
    block that is not shell, a ``run:`` marker on a block that is not run, two blocks with
    one id, a shell block that is neither in ``plan()`` nor marked."""
    out: list[str] = []
    ids: dict[str, str] = {}
    try:
        planned = {b.where for b in plan()}
    except MarkerError:  # reported below, with the doc
        planned = set()
    for doc in DOCS:
        try:
            found = blocks(doc)
        except MarkerError as exc:
            out.append(str(exc))
            continue
        for b in found:
            if not b.lang:
                out.append(f"{b.where}: a fence without a language (sh, text, yaml, ...)")
            elif b.lang not in SHELL and (b.reason or b.options):
                out.append(f"{b.where}: a marker on a {b.lang} block")
            elif b.lang in SHELL and b.where not in planned and not b.marked:
                out.append(f"{b.where}: a shell block neither run nor marked "
                           "<!-- not run: REASON -->")
            if b.id:
                if b.id in ids:
                    out.append(f"{b.where}: id {b.id} is also {ids[b.id]}")
                ids[b.id] = b.where
    return out
