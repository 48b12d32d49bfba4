"""The operator's page, rendered on the server (pure: snapshot and domain view in, HTML
out). ``GET /ui/`` lists the ensembles; ``GET /ui/ensembles/{ns}/{name}`` shows one: the
domain status in large type, the members (slot, VMI, node, IP, phase, IMEX state,
clique, preflight checks, age of the last report), the link matrix as a grid of cells
with a colour *and* a letter (the ``?format=matrix`` letters; slots as row and column
headers) and the problems. Every value is escaped; the page is whole without JavaScript,
and the inline script (``page_assets``) only refreshes the same elements from the JSON
API. No external resource of any kind; an 18-member page is about 20 KB, and the matrix
is left out past ``MATRIX_MAX`` members so a page stays under 100 KB.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from html import escape
from typing import Final

from host_agent.registry.domain_view import DomainView
from host_agent.registry.guest_checks import preflight_of
from host_agent.registry.page_assets import CSS, SCRIPT
from host_agent.registry.views import all_problems, format_age, is_stale, report_age
from host_agent.state.snapshot import EnsembleSnapshot, GuestReport
from imex_shared.imex_domain import OTHER_CLIQUE_CELL, SELF_CELL, UNKNOWN_CELL

MATRIX_MAX: Final = 64
LEGEND: Final = (("C", "connected"), ("D", "disconnected"), ("N", "never connected"),
                 ("I", "invalid"), ("R", "recovering"), ("A", "authenticating"),
                 ("M", "node map mismatch"), (SELF_CELL, "self"),
                 (UNKNOWN_CELL, "no report"), (OTHER_CLIQUE_CELL, "other clique"))


def _e(value: object) -> str:
    return escape("-" if value is None else str(value), quote=True)


def cell_class(letter: str) -> str:
    return {SELF_CELL: "s-self", UNKNOWN_CELL: "s-unknown",
            OTHER_CLIQUE_CELL: "s-other"}.get(letter, f"s-{letter}")


def _page(title: str, body: str, data: dict[str, str]) -> str:
    attrs = "".join(f' data-{k}="{_e(v)}"' for k, v in data.items())
    return (
        "<!doctype html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta name=\"viewport\" content=\"width=device-width, initial-scale=1\">"
        f"<title>{_e(title)}</title><style>{CSS}</style></head>\n"
        f"<body{attrs}>\n{body}\n<script>{SCRIPT}</script>\n</body></html>\n"
    )


def list_page(rows: Iterable[tuple[EnsembleSnapshot, DomainView]]) -> str:
    """``/ui/``: one row per ensemble (name, members, domain status, IMEX-ready count)."""
    lines = ["<h1>IMEX ensembles</h1>",
             "<table id=\"ensembles\"><thead><tr><th>namespace</th><th>ensemble</th>"
             "<th>members</th><th>domain</th><th>IMEX ready</th></tr></thead><tbody>"]
    count = 0
    for snap, view in rows:
        count += 1
        ns, name = snap.ens.namespace, snap.ens.name
        lines.append(
            f"<tr id=\"e-{_e(ns)}/{_e(name)}\"><td>{_e(ns)}</td>"
            f"<td><a href=\"/ui/ensembles/{_e(ns)}/{_e(name)}\">{_e(name)}</a></td>"
            f"<td class=\"members\">{len(snap.members)}/{snap.spec.max_members}</td>"
            f"<td><span class=\"domain badge st-{_e(view.status)}\">{_e(view.status)}</span>"
            f"</td><td class=\"ready\">{imex_ready(view)}</td></tr>")
    lines.append("</tbody></table>")
    if not count:
        lines.append("<p class=\"muted\">No ensembles yet (a Service labelled "
                     "imex-ensemble.io/ensemble, or an ImexEnsemble).</p>")
    return _page("IMEX ensembles", "\n".join(lines), {})


def imex_ready(view: DomainView) -> int:
    """Members whose fresh report says READY."""
    return sum(1 for m in view.members if m.reporting and m.imex_state == "READY")


def checks_cell(report: GuestReport | None) -> str | None:
    """The member's preflight checks in one cell: "PASS", "FAIL: dns, fabric", "WARN: x"."""
    checks = preflight_of(report)
    if not checks:
        return None
    for result in ("FAIL", "WARN"):
        names = [str(c["name"]) for c in checks if c["result"] == result]
        if names:
            return f"{result}: {', '.join(names)}"
    return "PASS"


def _members_table(snap: EnsembleSnapshot, view: DomainView, now: float,
                   stale_after: float) -> list[str]:
    lines = ["<table id=\"members\"><thead><tr><th>slot</th><th>VMI</th><th>node</th>"
             "<th>IP</th><th>phase</th><th>IMEX</th><th>clique</th><th>checks</th>"
             "<th>last report</th></tr></thead><tbody>"]
    domain = {m.index: m for m in view.members}
    for pub in snap.members:
        m, d = pub.member, domain.get(pub.index)
        report = snap.reports.get(pub.index)
        if report is None:
            age = "-"
        else:
            age = format_age(report_age(report, now)) + (
                " STALE" if is_stale(report, now, stale_after) else "")
        lines.append(
            f"<tr id=\"m-{m.index}\"><td>{m.index} <span class=\"muted\">"
            f"{_e(snap.ens.slot(m.index))}</span></td><td>{_e(m.vmi)}</td>"
            f"<td class=\"node\">{_e(m.node)}</td><td class=\"ip\">{_e(m.ip)}</td>"
            f"<td class=\"phase\">{_e(m.phase)}</td>"
            f"<td class=\"imex\">{_e(d.imex_state if d else None)}</td>"
            f"<td class=\"clique\">{_e(d.clique if d else None)}</td>"
            f"<td class=\"checks\">{_e(checks_cell(report))}</td>"
            f"<td class=\"age\">{_e(age)}</td></tr>")
    lines.append("</tbody></table>")
    return lines


def _matrix(view: DomainView) -> list[str]:
    indices = [m.index for m in view.members]
    if len(indices) > MATRIX_MAX:
        return [f"<p class=\"muted\">The matrix is shown up to {MATRIX_MAX} members; see "
                "<code>.../domain?format=matrix</code>.</p>"]
    head = "".join(f"<th scope=\"col\">{i}</th>" for i in indices)
    lines = [f"<table id=\"matrix\"><thead><tr><th title=\"from, to\">"
             f"&#8594;</th>{head}</tr></thead><tbody>"]
    for a in indices:
        cells = []
        for b in indices:
            letter = view.cell(a, b)
            other = ' data-other="1"' if letter == OTHER_CLIQUE_CELL else ""
            cells.append(f"<td class=\"cell {cell_class(letter)}\" data-from=\"{a}\" "
                         f"data-to=\"{b}\"{other}>{_e(letter)}</td>")
        lines.append(f"<tr><th scope=\"row\">{a}</th>{''.join(cells)}</tr>")
    lines.append("</tbody></table>")
    legend = "".join(f"<span><span class=\"cell {cell_class(k)}\">&nbsp;{_e(k)}&nbsp;</span> "
                     f"{_e(v)}</span>" for k, v in LEGEND)
    lines.append(f"<p class=\"legend muted\">{legend}</p>")
    return lines


def _problems(items: Sequence[str]) -> list[str]:
    lis = "".join(f"<li>{_e(p)}</li>" for p in items)
    return [f"<h2>Problems <span id=\"no-problems\" class=\"muted\">"
            f"{'' if items else 'none'}</span></h2>",
            f"<ul id=\"problems\" class=\"problems\" data-text=\"{_e(chr(10).join(items))}\">"
            f"{lis}</ul>"]


def ensemble_page(snap: EnsembleSnapshot, view: DomainView, now: float,
                  stale_after: float) -> str:
    """``/ui/ensembles/{ns}/{name}``: status, members, link matrix, problems."""
    problems = all_problems(snap, now, stale_after)
    problems += [p for p in view.problems if p not in problems]
    ens = snap.ens
    body = [
        "<p><a href=\"/ui/\">&#8592; all ensembles</a></p>",
        f"<h1>{_e(ens.namespace)}/{_e(ens.name)} <span class=\"muted\">domain "
        f"{_e(ens.domain_id)}, generation {snap.generation}, "
        f"{len(snap.members)}/{snap.spec.max_members} members, IMEX ready "
        f"{imex_ready(view)}</span></h1>",
        f"<div id=\"status\" class=\"status st-{_e(view.status)}\">{_e(view.status)}</div>",
        "<p class=\"muted\">updated <span id=\"updated\">at load</span> "
        "<span id=\"live\" class=\"muted\">(live)</span></p>",
        "<h2>Members</h2>",
        *_members_table(snap, view, now, stale_after),
        "<h2>Links <span class=\"muted\">(row: from, column: to)</span></h2>",
        *_matrix(view),
        *_problems(problems),
    ]
    return _page(f"{ens.key}: {view.status}", "\n".join(body), {
        "namespace": ens.namespace, "name": ens.name, "generation": str(snap.generation)})
