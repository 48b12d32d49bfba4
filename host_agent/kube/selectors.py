"""metav1.LabelSelector, parsed and evaluated without an API server (pure).

An ImexEnsemble's ``spec.memberSelector`` narrows which labelled VMIs are
members. It is always ANDed with ``imex-ensemble.io/ensemble=<name>`` (the
informers stay label-scoped and a VMI is never in two ensembles), so the agent
evaluates it over VMIs the label already picked; this module is that
evaluation, with the apiserver's semantics (k8s.io/apimachinery labels):
``matchLabels`` and every ``matchExpressions`` entry must all hold; ``In`` /
``NotIn`` need values, ``Exists`` / ``DoesNotExist`` take none; ``NotIn`` and
``DoesNotExist`` match a VMI without the key; an empty selector matches all.

``contradiction`` finds selectors that can never match anything (a key
required to be both ``a`` and ``b``, or to exist and not exist): the agent
refuses such a spec instead of silently publishing an empty ensemble.

The value is frozen and hashable (it is part of ``EnsembleSpec``, which keys
memo caches); requirements are kept in the order given, values sorted.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final, Literal

from host_agent.crd.imexensemble import LABEL_KEY, LABEL_VALUE

Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
OPERATORS: Final[tuple[Operator, ...]] = ("In", "NotIn", "Exists", "DoesNotExist")

# The CRD's own patterns (host_agent/crd/imexensemble.py), so the agent refuses nothing the
# API accepts for an ImexEnsemble and accepts nothing it refuses.
_KEY = re.compile(LABEL_KEY)
_VALUE = re.compile(LABEL_VALUE)


class SelectorError(ValueError):
    """A selector the apiserver would refuse, or that cannot be evaluated; names the field."""


@dataclass(frozen=True, slots=True)
class Requirement:
    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        return self.key not in labels or labels[self.key] not in self.values


@dataclass(frozen=True, slots=True)
class LabelSelector:
    #: (key, value) pairs of matchLabels, sorted by key.
    match_labels: tuple[tuple[str, str], ...] = ()
    match_expressions: tuple[Requirement, ...] = ()

    def requirements(self) -> tuple[Requirement, ...]:
        """matchLabels as ``In`` requirements, then the expressions."""
        return (
            *(Requirement(k, "In", (v,)) for k, v in self.match_labels),
            *self.match_expressions,
        )

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(r.matches(labels) for r in self.requirements())

    def describe(self) -> str:
        """The selector in kubectl's ``-l`` syntax (for messages)."""
        parts: list[str] = [f"{k}={v}" for k, v in self.match_labels]
        for r in self.match_expressions:
            if r.operator == "Exists":
                parts.append(r.key)
            elif r.operator == "DoesNotExist":
                parts.append(f"!{r.key}")
            else:
                word = "in" if r.operator == "In" else "notin"
                parts.append(f"{r.key} {word} ({','.join(r.values)})")
        return ",".join(parts) or "(everything)"


def _key(value: object, where: str) -> str:
    if not isinstance(value, str) or not _KEY.match(value) or len(value) > 317:
        raise SelectorError(f"{where}: {value!r} is not a label key")
    return value


def _value(value: object, where: str) -> str:
    if not isinstance(value, str) or not _VALUE.match(value):
        raise SelectorError(f"{where}: {value!r} is not a label value (at most 63 characters)")
    return value


def parse_label_selector(obj: object, where: str = "selector") -> LabelSelector:
    """A LabelSelector from its JSON form; raises SelectorError naming the bad field."""
    if obj is None:
        return LabelSelector()
    if not isinstance(obj, Mapping):
        raise SelectorError(f"{where}: expected an object with matchLabels/matchExpressions")
    unknown = sorted(set(obj) - {"matchLabels", "matchExpressions"})
    if unknown:
        raise SelectorError(f"{where}: unknown field {unknown[0]!r}")
    raw_labels = obj.get("matchLabels") or {}
    if not isinstance(raw_labels, Mapping):
        raise SelectorError(f"{where}.matchLabels: expected a map of label key to value")
    labels = tuple(sorted(
        (_key(k, f"{where}.matchLabels"), _value(v, f"{where}.matchLabels[{k}]"))
        for k, v in raw_labels.items()
    ))
    raw_exprs = obj.get("matchExpressions") or []
    if not isinstance(raw_exprs, list):
        raise SelectorError(f"{where}.matchExpressions: expected a list")
    exprs: list[Requirement] = []
    for i, raw in enumerate(raw_exprs):
        at = f"{where}.matchExpressions[{i}]"
        if not isinstance(raw, Mapping):
            raise SelectorError(f"{at}: expected an object with key, operator, values")
        key = _key(raw.get("key"), f"{at}.key")
        op = raw.get("operator")
        if op not in OPERATORS:
            raise SelectorError(
                f"{at}.operator: {op!r} is not one of {', '.join(OPERATORS)}"
            )
        values = raw.get("values") or []
        if not isinstance(values, list):
            raise SelectorError(f"{at}.values: expected a list of strings")
        checked = tuple(sorted({_value(v, f"{at}.values") for v in values}))
        if op in ("In", "NotIn") and not checked:
            raise SelectorError(f"{at}.values: operator {op} needs at least one value")
        if op in ("Exists", "DoesNotExist") and checked:
            raise SelectorError(f"{at}.values: operator {op} takes no values")
        exprs.append(Requirement(key, op, checked))
    return LabelSelector(labels, tuple(exprs))


def allowed_values(selector: LabelSelector, key: str) -> frozenset[str] | None:
    """The values of ``key`` a matching label set can carry.

    None: not constrained to a list (any value, or the key may be absent); an empty
    set: no value at all (``DoesNotExist``, or ``In`` lists that exclude each other).
    """
    allowed: frozenset[str] | None = None
    excluded: set[str] = set()
    for r in selector.requirements():
        if r.key != key:
            continue
        if r.operator == "In":
            allowed = frozenset(r.values) if allowed is None else allowed & frozenset(r.values)
        elif r.operator == "NotIn":
            excluded |= set(r.values)
        elif r.operator == "DoesNotExist":
            return frozenset()
    if allowed is None:
        return None
    return allowed - excluded


def contradiction(selector: LabelSelector) -> str | None:
    """Why the selector can match no label set at all, or None when some set matches."""
    by_key: dict[str, list[Requirement]] = {}
    for r in selector.requirements():
        by_key.setdefault(r.key, []).append(r)
    for key, reqs in sorted(by_key.items()):
        ops = {r.operator for r in reqs}
        if "DoesNotExist" in ops and ops & {"In", "Exists"}:
            return f"label {key} must both exist and not exist"
        allowed = allowed_values(selector, key)
        if "In" in ops and allowed is not None and not allowed:
            wanted = sorted({v for r in reqs if r.operator == "In" for v in r.values})
            return f"no value of label {key} satisfies it (asks for {', '.join(wanted)} at once)"
    return None
