"""Wheels for the chroot tier: the guest wheelhouse per target, and the test runner's wheels.

TEST HARNESS. The guest package comes from the same ``make wheelhouse`` tree the VMs use
(:func:`tests.vm.wheelhouse.build_wheelhouse`, cached per target). Running the guest unit
tests inside a chroot also needs pytest and its plugins for *that* Python and CPU: they
are downloaded once per target as binary wheels, at the versions the development venv
runs (so a chroot run differs from the venv's only in the interpreter), into
``<vm cache>/testwheels-<target>-<sha>/``. The host extra's wheels for the arm64 install
check are fetched the same way. Both need the package index, as the VM tier does.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path

from tests.vm.image import REPO_ROOT, cache_root
from tools.wheelhouse import Target, WheelhouseError

#: what tests/unit/guest and tests/unit/shared import beyond the guest extra
TEST_RUNNER = ("pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "pyyaml")


def pinned(names: tuple[str, ...]) -> list[str]:
    return [f"{n}=={metadata.version(n)}" for n in names]


def host_requirements() -> list[str]:
    doc = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return list(doc["project"]["optional-dependencies"]["host"])


def download(target: Target, reqs: list[str], label: str, root: Path | None = None) -> Path:
    """``reqs`` and their dependencies as binary wheels for ``target`` (cached)."""
    root = root or cache_root()
    key = hashlib.sha256("\n".join(sorted(reqs)).encode()).hexdigest()[:16]
    final = root / f"{label}-{target.dirname}-{key}"
    if final.is_dir() and any(final.glob("*.whl")):
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{label}-", dir=root))
    try:
        plats = [a for t in target.platform_tags() for a in ("--platform", t)]
        proc = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
             "--only-binary=:all:", *plats, "--python-version", target.python,
             "--implementation", "cp", "--dest", str(tmp), *reqs],
            capture_output=True, text=True, timeout=1200, check=False)
        if proc.returncode != 0:
            raise WheelhouseError(f"{label} for {target.dirname}: {proc.stderr[-1500:]}")
        tmp.rename(final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def runner_wheels(target: Target) -> Path:
    return download(target, pinned(TEST_RUNNER), "testwheels")


def host_wheels(target: Target) -> Path:
    return download(target, host_requirements(), "hostwheels")
