"""Label and field selectors, parsed and matched as the real apiserver does.

TEST STAND-IN, never product code. Imitates k8s.io/apimachinery's `labels`
and `fields` packages (Kubernetes docs, "Labels and Selectors"):

- label selectors: comma-separated requirements, all must hold (AND):
  `k=v`, `k==v`, `k!=v` (also true when the key is absent), `k in (a,b)`,
  `k notin (a,b)` (true when absent), `k` (exists), `!k` (does not exist),
  `k>n` / `k<n` (integer comparison; false when absent or not an integer);
- field selectors: `f=v`, `f==v`, `f!=v`, AND-ed; only the fields a kind
  supports (every kind: `metadata.name`, `metadata.namespace`; a few kinds
  more, see `SUPPORTED_FIELDS`). Anything else is a 400 "field label not
  supported", as on a real server.

Pure functions; no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class SelectorError(ValueError):
    """A selector string that cannot be parsed (the server answers 400)."""


@dataclass(frozen=True)
class Requirement:
    key: str
    op: str  # "=", "!=", "in", "notin", "exists", "!", "gt", "lt"
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        present = self.key in labels
        value = labels.get(self.key)
        if self.op in ("=", "in"):
            return present and value in self.values
        if self.op in ("!=", "notin"):
            return not present or value not in self.values
        if self.op == "exists":
            return present
        if self.op == "!":
            return not present
        if self.op in ("gt", "lt"):
            if value is None:
                return False
            try:
                have = int(value)
            except ValueError:
                return False
            want = int(self.values[0])
            return have > want if self.op == "gt" else have < want
        raise AssertionError(self.op)


_KEY = r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_KEY_RE = re.compile(_KEY)
_VALUE_RE = re.compile(f"^{_VALUE}$")


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside parentheses."""
    parts: list[str] = []
    depth = 0
    cur: list[str] = []
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
            if depth < 0:
                raise SelectorError(f"unable to parse requirement: unbalanced ')' in {text!r}")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise SelectorError(f"unable to parse requirement: found '', expected: ',' or ')' "
                             f"(unbalanced '(' in {text!r})")
    parts.append("".join(cur))
    return parts


def _check_key(key: str, whole: str) -> str:
    if not key or not _KEY_RE.fullmatch(key):
        raise SelectorError(f"invalid label key {key!r} in selector {whole!r}")
    return key


def _check_value(value: str, whole: str) -> str:
    if not _VALUE_RE.match(value) or len(value) > 63:
        raise SelectorError(f"invalid label value {value!r} in selector {whole!r}")
    return value


_SET_RE = re.compile(r"^\s*(?P<key>\S+)\s+(?P<op>in|notin)\s*\((?P<vals>[^()]*)\)\s*$")
_CMP_RE = re.compile(r"^\s*(?P<key>[^=!<>\s]+)\s*(?P<op>==|=|!=|>|<)\s*(?P<val>\S*)\s*$")


def parse_label_selector(text: str | None) -> tuple[Requirement, ...]:
    """Parse a labelSelector query parameter; empty means "everything"."""
    if text is None or not text.strip():
        return ()
    reqs: list[Requirement] = []
    for raw in _split_top(text):
        part = raw.strip()
        if not part:
            raise SelectorError(f"empty requirement in selector {text!r}")
        m = _SET_RE.match(part)
        if m:
            key = _check_key(m["key"], text)
            vals = tuple(_check_value(v.strip(), text) for v in m["vals"].split(","))
            reqs.append(Requirement(key, m["op"], vals))
            continue
        m = _CMP_RE.match(part)
        if m:
            key = _check_key(m["key"], text)
            op = {"==": "=", "=": "=", "!=": "!=", ">": "gt", "<": "lt"}[m["op"]]
            val = m["val"]
            if op in ("gt", "lt"):
                try:
                    int(val)
                except ValueError as e:
                    raise SelectorError(
                        f"for 'Gt', 'Lt' operators, the value must be an integer: {part!r}"
                    ) from e
            else:
                _check_value(val, text)
            reqs.append(Requirement(key, op, (val,)))
            continue
        if part.startswith("!"):
            reqs.append(Requirement(_check_key(part[1:].strip(), text), "!"))
            continue
        reqs.append(Requirement(_check_key(part, text), "exists"))
    return tuple(reqs)


def labels_match(reqs: tuple[Requirement, ...], labels: Mapping[str, str] | None) -> bool:
    have = labels or {}
    return all(r.matches(have) for r in reqs)


# Fields each kind supports in fieldSelector, beyond metadata.name/namespace
# (from the real registries' field label conversion funcs; CRDs: none).
SUPPORTED_FIELDS: dict[str, tuple[str, ...]] = {
    "Pod": ("spec.nodeName", "spec.restartPolicy", "spec.schedulerName",
            "spec.serviceAccountName", "status.phase", "status.podIP", "status.nominatedNodeName"),
    "Namespace": ("status.phase",),
    "Service": ("spec.clusterIP", "spec.type"),
}


@dataclass(frozen=True)
class FieldRequirement:
    field: str
    negate: bool
    value: str


def parse_field_selector(text: str | None, kind: str) -> tuple[FieldRequirement, ...]:
    if text is None or not text.strip():
        return ()
    allowed = ("metadata.name", "metadata.namespace", *SUPPORTED_FIELDS.get(kind, ()))
    reqs: list[FieldRequirement] = []
    for raw in text.split(","):
        part = raw.strip()
        m = re.match(r"^([^=!]+)(==|=|!=)(.*)$", part)
        if not m:
            raise SelectorError(f"invalid selector: {text!r}; can't understand {part!r}")
        field, op, value = m[1].strip(), m[2], m[3].strip()
        if field not in allowed:
            raise SelectorError(f'field label not supported: {field}')
        reqs.append(FieldRequirement(field, op == "!=", value))
    return tuple(reqs)


def _field_value(obj: Mapping[str, Any], path: str) -> str:
    cur: Any = obj
    for part in path.split("."):
        if not isinstance(cur, Mapping):
            return ""
        cur = cur.get(part)
    return "" if cur is None else str(cur)


def fields_match(reqs: tuple[FieldRequirement, ...], obj: Mapping[str, Any]) -> bool:
    for r in reqs:
        equal = _field_value(obj, r.field) == r.value
        if equal == r.negate:
            return False
    return True
