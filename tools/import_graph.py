"""Figures of the product packages' layout, from grimp (import-linter's own graph).

    python -m tools.import_graph            # a table
    python -m tools.import_graph --json     # the same as JSON

Per package: modules per folder, import arrows (one per importing module and
imported module of the same package, counting imports inside functions too, as
grimp does), import layers (the longest chain of arrows, cycles counted as one
module) and the largest module in lines. docs/architecture.md quotes them.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from typing import Any

PACKAGES = ("imex_shared", "guest_agent", "host_agent")
ROOT = Path(__file__).resolve().parents[1]


def _longest_chain(modules: list[str], arrows: set[tuple[str, str]]) -> int:
    """Layers: the longest path in the graph of strongly connected components."""
    succ: dict[str, set[str]] = collections.defaultdict(set)
    for a, b in arrows:
        succ[a].add(b)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    comp: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    counter = [0, 0]

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in succ[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp[w] = counter[1]
                if w == v:
                    break
            counter[1] += 1

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10 * len(modules) + 100))
    for v in modules:
        if v not in index:
            visit(v)
    csucc: dict[int, set[int]] = collections.defaultdict(set)
    for a, b in arrows:
        if comp[a] != comp[b]:
            csucc[comp[a]].add(comp[b])
    depth: dict[int, int] = {}

    def chain(c: int) -> int:
        if c not in depth:
            depth[c] = 1 + max((chain(d) for d in csucc[c]), default=0)
        return depth[c]

    return max((chain(comp[m]) for m in modules), default=0)


def _lines(module: str, is_package: bool) -> int:
    rel = Path(*module.split("."))
    path = ROOT / (rel / "__init__.py" if is_package else rel.with_suffix(".py"))
    return len(path.read_text(encoding="utf-8").splitlines())


def figures(packages: tuple[str, ...] = PACKAGES) -> dict[str, Any]:
    import grimp

    graph = grimp.build_graph(*packages, include_external_packages=False)
    out: dict[str, Any] = {}
    for pkg in packages:
        modules = sorted(m for m in graph.modules if m == pkg or m.startswith(pkg + "."))
        inside = set(modules)
        arrows = {(m, i) for m in modules for i in graph.find_modules_directly_imported_by(m)
                  if i in inside and i != m}
        packages_here = {m for m in modules if graph.find_children(m)}
        folders: collections.Counter[str] = collections.Counter()
        for m in modules:
            if m in packages_here:
                continue  # a folder's __init__ is the folder, not a module in it
            folders[m.rsplit(".", 1)[0]] += 1
        sizes = {m: _lines(m, m in packages_here) for m in modules}
        largest = max(sizes, key=lambda m: sizes[m])
        out[pkg] = {
            "modules": sum(folders.values()),
            "folders": dict(sorted(folders.items())),
            "arrows": len(arrows),
            "layers": _longest_chain(modules, arrows),
            "largest": {"module": largest, "lines": sizes[largest]},
        }
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.import_graph", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON")
    args = parser.parse_args(argv)
    data = figures()
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    print(f"{'package':<12} {'modules':>7} {'arrows':>6} {'layers':>6}  largest module")
    for pkg, f in data.items():
        big = f["largest"]
        print(f"{pkg:<12} {f['modules']:>7} {f['arrows']:>6} {f['layers']:>6}  "
              f"{big['module']} ({big['lines']} lines)")
    print()
    print(f"{'folder':<28} modules")
    for f in data.values():
        for folder, n in f["folders"].items():
            print(f"{folder:<28} {n:>7}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
