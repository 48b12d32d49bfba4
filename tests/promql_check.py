"""Reading the PromQL of the alerts and the dashboard, for the test that evaluates it in a
real Prometheus (tests/integration/host/test_promql_live.py). Pure: no Prometheus here.

An alert's expression returns nothing on a healthy agent, by design. To show that the
series it reads exist, with the labels it uses, the test evaluates a *neutral* form:
every comparison with a number (``> 0.5``, ``== 1``) is dropped, which keeps every
series, and ``absent(X)`` becomes ``X``. Dropped, not turned into ``>= -Inf``: a ratio of
two rates that did not move (an idle agent's writes over a few seconds) is NaN, and NaN
fails every comparison, so ``>= -Inf`` would hide a series that exists.

A matcher that selects a failure value (``code=~"5.."``, ``result="FAIL"``) selects
nothing on a healthy agent; then the *widened* form replaces each matcher but ``job``'s
with ``=~".+"``: the series and the label still have to exist. The rules avoid
``unless``, which neutral forms would break.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

#: Grafana's variables the dashboard uses, and what the test puts in their place
GRAFANA_VARS = {"$__rate_interval": "1m", "$namespace": ".*"}
_COMPARE = re.compile(r"\s*(?:==|!=|>=|<=|>|<)\s*-?\d+(?:\.\d+)?(?![\w.])")
_ABSENT = re.compile(r"^\s*absent\((.*)\)\s*$", re.S)
_SELECTOR = re.compile(r"\b([a-zA-Z_:][\w:]*)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"([a-zA-Z_]\w*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
_GROUPING = re.compile(r"\b(?:by|on|without|ignoring|group_left|group_right)\s*\(([^)]*)\)")
_FUNCTIONS = frozenset({
    "abs", "absent", "avg", "bottomk", "ceil", "count", "count_values", "delta", "deriv",
    "exp", "floor", "group", "histogram_quantile", "idelta", "increase", "irate",
    "label_replace", "ln", "max", "min", "quantile", "rate", "resets", "round", "scalar",
    "sort", "sort_desc", "stddev", "sum", "time", "topk", "vector", "by", "on", "without",
    "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset",
})
_LABEL_REF = re.compile(r"\{\{\s*\$labels\.(\w+)\s*\}\}|\{\{\s*(\w+)\s*\}\}")


def grafana(expr: str) -> str:
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return expr


def neutral(expr: str) -> str:
    """``expr`` with its filters neutralised: every series it reads comes out."""
    expr = grafana(expr)
    m = _ABSENT.match(expr)
    if m:
        expr = m.group(1)
    return _COMPARE.sub("", expr)


def widened(expr: str) -> str:
    """neutral(expr) with every matcher but job's widened to ``=~".+"``."""
    def one(sel: re.Match[str]) -> str:
        matchers = [f'{k}=~".+"' if k != "job" else f'{k}{op}"{v}"'
                    for k, op, v in _MATCHER.findall(sel.group(2))]
        return f"{sel.group(1)}{{{','.join(matchers)}}}"
    return _SELECTOR.sub(one, neutral(expr))


@dataclass
class Names:
    #: metric -> the label names its matchers use
    metrics: dict[str, set[str]] = field(default_factory=dict)
    #: label names of by/on/without/ignoring lists
    grouping: set[str] = field(default_factory=set)


def names(expr: str) -> Names:
    """The metrics and label names ``expr`` reads."""
    expr = grafana(expr)
    out = Names()
    for sel in _SELECTOR.finditer(expr):
        out.metrics.setdefault(sel.group(1), set()).update(
            k for k, _, _ in _MATCHER.findall(sel.group(2)))
    for g in _GROUPING.finditer(expr):
        out.grouping.update(x.strip() for x in g.group(1).split(",") if x.strip())
    bare = re.sub(r"\{[^}]*\}|\"[^\"]*\"|\[[^\]]*\]|" + _GROUPING.pattern, " ", expr)
    for word in re.findall(r"\b([a-zA-Z_:][\w:]*)\b", bare):
        if word not in _FUNCTIONS and not re.fullmatch(r"Inf|NaN|e\d*", word):
            out.metrics.setdefault(word, set())
    return out


def label_refs(texts: Iterable[str]) -> set[str]:
    """Labels an alert's annotations (``{{ $labels.x }}``) or a legend (``{{x}}``) name."""
    out: set[str] = set()
    for text in texts:
        for a, b in _LABEL_REF.findall(text):
            if a or (b and not b.startswith("$")):
                out.add(a or b)
    return out


def unknown(expr: str, exported: Mapping[str, set[str]]) -> list[str]:
    """What ``expr`` names that the scrape does not have: metrics (``exported``: metric ->
    its label names, as Prometheus stores them) and label names."""
    found = names(expr)
    problems = [f"metric {m}" for m in found.metrics if m not in exported]
    for metric, labels in found.metrics.items():
        problems += [f"label {k} of {metric}" for k in sorted(labels)
                     if metric in exported and k not in exported[metric]]
    known = set().union(*(exported.get(m, set()) for m in found.metrics))
    problems += [f"label {k}" for k in sorted(found.grouping) if k not in known]
    return problems
