"""Where an agent's code comes from: this tree, or the previous release's wheel in a venv.

TEST STAND-IN support for the version-skew tests (docs/install.md "Upgrades"). The
previous release is 0.1.0, commit :data:`PREVIOUS_COMMIT`. :func:`previous_release`
builds it once and caches it under
``${XDG_CACHE_HOME:-~/.cache}/imex-ensemble/releases/<commit>-<venv>/`` (``<venv>``: a
hash of this venv's path, whose dependencies it borrows):

1. its source, ``git archive`` of the commit out of this repository (no worktree is
   registered, so deleting the cache leaves nothing behind in ``.git``);
2. its wheel, built offline with this venv's setuptools (``pip wheel --no-deps
   --no-build-isolation``), as ``tests/guest_support/wheels.py`` builds this tree's;
3. a venv of its own (``--without-pip``) with the wheel installed by pip ``--no-deps``;
   its dependencies are this venv's: a ``.pth`` puts this venv's site-packages after
   its own (a plain path, so this venv's own ``.pth`` files, the editable install of
   this tree among them, are not read there). ``imex-guest-agent`` and
   ``imex-host-agent`` in its ``bin/`` are the release's console scripts.

The cache is keyed by the commit and marked complete last, so an interrupted build is
redone. A second process waits on the lock file instead of building beside it.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PREVIOUS_VERSION = "0.1.0"
PREVIOUS_COMMIT = "85031694b59c42fd4e2b557a51d8c6fc98ac4885"
CACHE = Path(os.environ.get("IMEX_RELEASE_CACHE") or Path(
    os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "imex-ensemble" / "releases")


@dataclass(frozen=True)
class Release:
    """An installed release: its version and the venv whose ``bin/`` holds its agents."""

    version: str
    venv: Path

    def script(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    @property
    def python(self) -> str:
        return str(self.venv / "bin" / "python")

    def env(self, base: Mapping[str, str]) -> dict[str, str]:
        """``base`` without this tree on ``PYTHONPATH`` (it would shadow the release)."""
        out = dict(base)
        kept = [p for p in out.get("PYTHONPATH", "").split(":")
                if p and Path(p).resolve() != REPO]
        if kept:
            out["PYTHONPATH"] = ":".join(kept)
        else:
            out.pop("PYTHONPATH", None)
        return out


class ReleaseBuildError(RuntimeError):
    """The previous release could not be built; the message says which step failed."""


def _run(argv: list[str], what: str, **kw: object) -> None:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=300, check=False,
                          **kw)  # type: ignore[call-overload]
    if proc.returncode != 0:
        raise ReleaseBuildError(f"{what} failed ({proc.returncode}): "
                                f"{(proc.stderr or proc.stdout)[-1500:]}")


def _build(commit: str, into: Path) -> None:
    src, wheels, venv = into / "src", into / "wheels", into / "venv"
    for d in (src, wheels, venv):
        shutil.rmtree(d, ignore_errors=True)
    src.mkdir(parents=True)
    with tempfile.TemporaryDirectory(prefix="imex-release-") as tmp:
        tar = Path(tmp) / "src.tar"
        _run(["git", "-C", str(REPO), "archive", "--format=tar", "-o", str(tar), commit],
             f"git archive {commit[:12]} (is the commit in this clone? a shallow clone "
             "lacks it)")
        with tarfile.open(tar) as tf:
            try:
                tf.extractall(src, filter="data")
            except TypeError:  # a CPython before 3.11.4: our own git archive, trusted
                tf.extractall(src)
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
          "-w", str(wheels), str(src)], "building the release's wheel")
    (wheel,) = wheels.glob("imex_ensemble-*.whl")
    _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], "making its venv")
    pure = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    pure.mkdir(parents=True, exist_ok=True)
    (pure / "zz-imex-test-deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    _run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
          "--no-index", "--ignore-installed", "--disable-pip-version-check", str(wheel)],
         "installing the wheel into its venv")


def release_at(commit: str, version: str) -> Release:
    """The release built from ``commit`` (built on first use, then cached)."""
    # keyed by the venv too: the release's venv borrows this venv's dependencies
    deps = hashlib.sha256(sysconfig.get_paths()["purelib"].encode()).hexdigest()[:8]
    into = CACHE / f"{commit}-{deps}"
    into.mkdir(parents=True, exist_ok=True)
    release = Release(version, into / "venv")
    done = into / "complete"
    with open(into / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            done.unlink(missing_ok=True)
            _build(commit, into)
            got = subprocess.run([release.script("imex-guest-agent"), "--help"],
                                 capture_output=True, text=True, timeout=60,
                                 env=release.env(os.environ), check=False)
            if got.returncode != 0:
                raise ReleaseBuildError(f"the built release does not run: {got.stderr[-800:]}")
            done.write_text(f"{commit} {version}\n")
    return release


def previous_release() -> Release:
    """0.1.0, the release before this one (commit 8503169)."""
    return release_at(PREVIOUS_COMMIT, PREVIOUS_VERSION)


def installed_version(release: Release) -> str:
    """The version the release's venv reports for imex-ensemble (its own metadata)."""
    out = subprocess.run([release.python, "-c", "import importlib.metadata as m; "
                          "print(m.version('imex-ensemble'))"], capture_output=True,
                         text=True, timeout=60, env=release.env(os.environ), check=True,
                         cwd="/")
    return out.stdout.strip()
