"""The air-gapped wheelhouse the guests install from: this tree's wheel plus its guest deps.

TEST HARNESS. What an air-gapped site does (cloudinit/README.md, "A wheelhouse for
find-links"): ``pip wheel`` where the index is reachable, then serve the directory over
HTTP with a listing so ``pip install --no-index --find-links URL`` in the guest works.

* The dependencies of the ``guest`` extra (read from pyproject.toml) are fetched once with
  the venv's pip and cached under ``<vm cache>/wheels-<sha of the requirement list>``;
  binary wheels only (the guest has no compiler). The guest runs bookworm's CPython 3.11,
  the same minor version as the harness, so wheels pip picks here install there.
* The project's wheel is built on every run from a copy of the tree
  (``--no-deps --no-build-isolation``: offline, the work tree stays clean), so the guest
  runs exactly the code under test.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

from tests.vm.image import REPO_ROOT, cache_root


class WheelhouseError(Exception):
    """pip could not build or fetch a wheel; the message holds pip's last lines."""


def guest_requirements() -> list[str]:
    """The ``guest`` extra's requirements, as pyproject.toml lists them."""
    doc = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return list(doc["project"]["optional-dependencies"]["guest"])


def _pip(args: list[str], what: str, timeout: float = 600) -> None:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise WheelhouseError(f"{what}: pip still running after {timeout:.0f}s") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-20:])
        raise WheelhouseError(f"{what} failed (exit {proc.returncode}):\n{tail}")


def dependency_wheels(root: Path | None = None) -> Path:
    reqs = guest_requirements()
    root = root or cache_root()
    key = hashlib.sha256("\n".join(sorted(reqs)).encode()).hexdigest()[:16]
    final = root / f"wheels-{key}"
    if final.is_dir() and any(final.glob("*.whl")):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".wheels-", dir=root))
    try:
        _pip(["wheel", "-q", "--only-binary=:all:", "-w", str(tmp), *reqs],
             "pip wheel (guest dependencies)")
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def project_wheel(out: Path) -> Path:
    """Build this tree's wheel into ``out`` and return its path."""
    src = Path(tempfile.mkdtemp(prefix="imex-vm-src-"))
    try:
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(REPO_ROOT / name, src / name)
        for pkg in ("guest_agent", "host_agent"):
            shutil.copytree(REPO_ROOT / pkg, src / pkg,
                            ignore=shutil.ignore_patterns("__pycache__"))
        _pip(["wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(src)],
             "pip wheel (this tree)", 300)
    finally:
        shutil.rmtree(src, ignore_errors=True)
    wheels = sorted(out.glob("imex_ensemble-*.whl"))
    if not wheels:
        raise WheelhouseError(f"pip wheel built no imex_ensemble wheel into {out}")
    return wheels[-1]


def build_wheelhouse(out: Path) -> Path:
    """``out`` holds the project wheel and copies of the dependency wheels."""
    out.mkdir(parents=True, exist_ok=True)
    for whl in dependency_wheels().glob("*.whl"):
        shutil.copy(whl, out / whl.name)
    project_wheel(out)
    return out
