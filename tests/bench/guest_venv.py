"""A venv holding only the guest extra's dependencies, for measuring the guest agent.

Why: a real guest installs ``imex-ensemble[guest]`` and nothing else (cloudinit/),
but the development venv also holds the host and test stacks, and dnspython
imports whatever optional HTTP/2 and DoH libraries it finds (httpx, h2,
anyio: about 12 MB of RSS the guest would never have). The guest agent's RSS
and CPU are therefore taken from a venv like the guest's.

The venv is built once per dependency list (the list's hash names it) under
``~/.cache/imex-ensemble/bench/`` and reused; pip uses its usual configuration
(index, find-links). The agent itself still runs from the repository root.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
CACHE = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "imex-ensemble" / "bench"


def guest_requirements(pyproject: Path = REPO_ROOT / "pyproject.toml") -> list[str]:
    """The ``guest`` optional dependencies, as pyproject.toml lists them."""
    data = tomllib.loads(pyproject.read_text())
    reqs = data["project"]["optional-dependencies"]["guest"]
    if not reqs or not all(isinstance(r, str) for r in reqs):
        raise ValueError(
            f"{pyproject}: project.optional-dependencies.guest is empty or not strings")
    return list(reqs)


def venv_dir(reqs: list[str], base: Path = CACHE) -> Path:
    digest = hashlib.sha256("\n".join(sorted(reqs)).encode()).hexdigest()[:12]
    return base / f"guest-venv-{digest}"


def guest_python(base: Path = CACHE) -> str:
    """Path of the guest venv's interpreter, building the venv if it is not there."""
    reqs = guest_requirements()
    root = venv_dir(reqs, base)
    python = root / "bin" / "python"
    if (root / ".complete").exists() and python.exists():
        return str(python)
    shutil.rmtree(root, ignore_errors=True)
    root.parent.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, "-m", "venv", str(root)], check=True)
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--disable-pip-version-check",
                    *reqs], check=True, timeout=900)
    (root / ".complete").write_text("\n".join(reqs) + "\n")
    return str(python)
