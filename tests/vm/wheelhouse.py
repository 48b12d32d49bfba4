"""The wheelhouse the guests install from: ``make wheelhouse``'s tree, one dir per guest.

TEST HARNESS. What an air-gapped site does (cloudinit/README.md): ``make wheelhouse`` where
the index is reachable, then serve ``dist/wheelhouse/`` over HTTP with a listing; each
guest's installer appends its own ``linux-<arch>-py<ver>/`` to that root URL, so one seed
serves the arm64 and the amd64 guests of a mixed ensemble.

* Each target directory's dependency wheels (and pip's) come from
  :func:`tools.wheelhouse.build_target` (binary wheels for that CPU and Python, never built
  here), cached under ``<vm cache>/wheels-<target>-<sha of the guest requirements>``.
* This tree's wheel is built on every run, offline (``--no-build-isolation``), and replaces
  the cached copy, so the guests run exactly the code under test.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import tomllib
from collections.abc import Iterable
from pathlib import Path

from tests.vm.image import REPO_ROOT, cache_root
from tools.wheelhouse import Target, WheelhouseError, build_project_wheel, build_target

__all__ = ["WheelhouseError", "build_wheelhouse", "guest_requirements", "target_for"]

_MACHINE_PLATFORM = {"amd64": "linux/amd64", "arm64": "linux/arm64"}


def guest_requirements() -> list[str]:
    """The ``guest`` extra's requirements, as pyproject.toml lists them."""
    doc = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return list(doc["project"]["optional-dependencies"]["guest"])


def target_for(arch: str, python: str) -> Target:
    """The wheelhouse target of a guest: Debian architecture and ``3.N``."""
    return Target(_MACHINE_PLATFORM[arch], python)


def _cached_target(target: Target, project_wheel: Path, root: Path) -> Path:
    key = hashlib.sha256("\n".join(sorted(guest_requirements())).encode()).hexdigest()[:16]
    final = root / f"wheels-{target.dirname}-{key}"
    if final.is_dir() and any(final.glob("pip-*.whl")):
        return final
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".wheels-", dir=root) as d:
        built = build_target(target, project_wheel, Path(d))
        shutil.rmtree(final, ignore_errors=True)
        built.rename(final)
    return final


def build_wheelhouse(out: Path, targets: Iterable[Target], root: Path | None = None) -> Path:
    """``out/<target.dirname>/`` per target: cached dependency wheels, a fresh project wheel."""
    root = root or cache_root()
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="imex-vm-wheel-") as d:
        wheel = build_project_wheel(Path(d), isolation=False)
        for t in set(targets):
            dest = out / t.dirname
            dest.mkdir(exist_ok=True)
            for whl in _cached_target(t, wheel, root).glob("*.whl"):
                if not whl.name.startswith("imex_ensemble-"):
                    shutil.copy(whl, dest / whl.name)
            shutil.copy(wheel, dest / wheel.name)
    return out
