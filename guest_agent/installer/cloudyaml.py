"""The YAML that cloud-init reads from us: a small subset, emitted by hand, exact.

The guest package installs without PyYAML, so the generator writes YAML itself. Every
scalar we did not write ourselves is double-quoted with YAML escapes, and file contents go
into literal block scalars only when that is provably lossless (else base64), so what
cloud-init writes is exactly the bytes rendered here. Pure functions only.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class WriteFile:
    """One ``write_files`` entry: exact bytes and octal permissions."""

    path: str
    content: bytes
    permissions: str = "0644"


def yaml_quote(text: str) -> str:
    """A YAML double-quoted scalar that loads back to exactly ``text``.

    Printable characters stay as they are; ``"`` and ``\\`` and everything
    YAML 1.1 does not allow raw in a stream (C0/C1 controls, DEL, surrogates,
    U+FFFE/FFFF) are escaped, so PyYAML (cloud-init's parser) reads it back
    unchanged.
    """
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif _yaml_printable(code):
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _yaml_printable(code: int) -> bool:
    # YAML 1.1 c-printable, minus NEL and U+2028/2029, which PyYAML treats as
    # line breaks (and would fold), and minus the byte-order mark.
    return (
        0x20 <= code <= 0x7E
        or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029))
        or (0xE000 <= code <= 0xFFFD and code != 0xFEFF)
        or 0x10000 <= code <= 0x10FFFF
    )


def block_safe(text: str) -> bool:
    """True when a literal block scalar reproduces ``text`` exactly.

    Refused (the caller falls back to base64): empty text, a first line that
    starts with a space (it would set the indentation), carriage returns and
    anything not plainly printable, and text ending in several newlines
    (keep-chomping works but is easy to get wrong in review).
    """
    if not text or text[0] in " \t\n" or text.endswith("\n\n"):
        return False
    return all(ch in "\n\t" or _yaml_printable(ord(ch)) for ch in text)


def content_lines(content: bytes, indent: str) -> list[str]:
    """``content:`` (and ``encoding:`` when needed) lines of one write_files entry."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\n" not in text and "\r" not in text:
        return [f"{indent}content: {yaml_quote(text)}"]
    if text is not None and block_safe(text):
        chomp = "" if text.endswith("\n") else "-"
        body = text[:-1] if text.endswith("\n") else text
        lines = [f"{indent}content: |{chomp}"]
        lines += [f"{indent}  {line}" if line else "" for line in body.split("\n")]
        return lines
    # Quoted: a plain base64 scalar can be a YAML 1.1 int, bool or null
    # ("1234", "True", "Null" are all valid base64), which cloud-init would
    # load as something other than the string it must decode.
    return [
        f"{indent}encoding: b64",
        f"{indent}content: {yaml_quote(base64.b64encode(content).decode('ascii'))}",
    ]


def render_write_files(files: Sequence[WriteFile]) -> list[str]:
    lines = ["write_files:"]
    for f in files:
        lines.append(f"  - path: {yaml_quote(f.path)}")
        lines.append(f"    permissions: {yaml_quote(f.permissions)}")
        lines += content_lines(f.content, "    ")
    return lines


def literal_item(script: str, indent: str = "  ") -> list[str]:
    """A shell script (our own text, ending in a newline) as one list item in a literal block."""
    body = script[:-1].split("\n")
    return [f"{indent}- |", *(f"{indent}  {line}" if line else "" for line in body)]
