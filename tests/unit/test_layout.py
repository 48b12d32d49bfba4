"""The layout's rules that import-linter cannot say (its contracts are in pyproject.toml).

- imex_shared, which both agents and the guest's oldest supported Python import,
  uses the standard library only;
- the pure half of a pair (``x.py`` beside ``x_io.py``) imports no I/O module;
- every folder of a product package says in its ``__init__`` what it does;
- no product module is over 500 lines;
- no task lives outside a TaskGroup: ``create_task`` is only ever a TaskGroup's.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("imex_shared", "guest_agent", "host_agent")
#: modules that talk to the outside world without an ``_io`` suffix (no pure twin)
IO_MODULES = ("host_agent.kube.client", "host_agent.kube.writers", "host_agent.kube.informer")


def product_files() -> list[Path]:
    return sorted(p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py"))


def module_of(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = rel.parts[:-1] if rel.name == "__init__" else rel.parts
    return ".".join(parts)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES, include_external_packages=True)


def test_imex_shared_imports_the_standard_library_only(graph: grimp.ImportGraph) -> None:
    foreign = {}
    for module in graph.modules:
        if not module.startswith("imex_shared"):
            continue
        for imported in graph.find_modules_directly_imported_by(module):
            top = imported.split(".")[0]
            if top != "imex_shared" and top not in sys.stdlib_module_names:
                foreign.setdefault(module, set()).add(imported)
    assert foreign == {}


def test_the_pure_half_of_a_pair_imports_no_io_module(graph: grimp.ImportGraph) -> None:
    modules = {m for m in graph.modules if m.startswith(PACKAGES)}
    pairs = [m[: -len("_io")] for m in modules if m.endswith("_io")]
    assert len(pairs) >= 15, pairs  # the convention is used, not just allowed
    offenders = {}
    for pure in pairs:
        if pure not in modules:
            continue
        io = {i for i in graph.find_modules_directly_imported_by(pure)
              if i.endswith("_io") or i in IO_MODULES}
        if io:
            offenders[pure] = io
    assert offenders == {}


def test_every_folder_says_what_it_does() -> None:
    bare = []
    for pkg in PACKAGES:
        for init in (ROOT / pkg).rglob("__init__.py"):
            doc = ast.get_docstring(ast.parse(init.read_text(encoding="utf-8")))
            if not doc or len(doc.split()) < 12:
                bare.append(str(init.relative_to(ROOT)))
    assert bare == []


def test_no_product_module_is_over_500_lines() -> None:
    sizes = {str(p.relative_to(ROOT)): len(p.read_text(encoding="utf-8").splitlines())
             for p in product_files()}
    assert {p: n for p, n in sizes.items() if n > 500} == {}


def test_every_task_is_a_taskgroups() -> None:
    """``asyncio.create_task``/``ensure_future``/``loop.create_task`` make tasks nobody
    owns; the agents create theirs from a TaskGroup (``tg.create_task``)."""
    loose = []
    for path in product_files():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
                continue
            name, owner = node.func.attr, node.func.value
            if name == "ensure_future" or (name == "create_task" and not (
                    isinstance(owner, ast.Name) and owner.id == "tg")):
                loose.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert loose == []


def test_every_package_folder_is_shipped() -> None:
    """A package folder missing from pyproject's explicit list is left out of the wheel,
    and the installed agent fails to start (the vm tier caught guest_agent.workload)."""
    import tomllib

    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())
                 ["tool"]["setuptools"]["packages"])
    folders = {".".join(p.parent.relative_to(ROOT).parts)
               for top in PACKAGES for p in (ROOT / top).rglob("__init__.py")}
    assert folders <= listed, sorted(folders - listed)
