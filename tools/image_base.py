"""The host agent image's local base: Debian's python3 in an mmdebstrap'd root, imported
into podman, for machines that cannot pull ``python:3.11-slim`` (this one: no container
registry is reachable, FACTS.md "Packaging").

``ensure_base(arch)`` returns ``localhost/imex-python3:<suite>-<arch>-<key>``, building what
is missing. Two cache levels, like tests/vm/image.py's guest images:

* ``${IMEX_IMAGE_CACHE:-~/.cache/imex-ensemble/image}/base-<suite>-<arch>-<key>/rootfs.tar``:
  ``mmdebstrap --variant=essential`` of the pinned suite with ``python3``,
  ``python3-venv`` and ``libstdc++6``. ``<key>`` hashes the suite, the architecture, the
  variant, the package list, the path filters and the mirror, so changing any of them
  builds a new root (and drops the old one) and nothing else does. Documentation, manual
  pages and translations are left out as Debian's own slim images leave them out (the
  copyright files stay).
* podman's image store: ``podman import`` of that tarball, once per key.

The suite is pinned (``bookworm``: Debian 12's python3 is 3.11, the Python the tests run
on), never the host's. No mirror is written here: mmdebstrap takes the host's apt sources
for the suite, or ``IMEX_IMAGE_MIRROR``. A foreign architecture's maintainer scripts run
under qemu-user (binfmt_misc, set up for the build only).

Concurrency: one builder per cache entry (``flock``); a result appears by ``rename`` only
once complete, so a killed build leaves no half-written entry.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import resource
import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Final

SUITE: Final = "bookworm"
#: the suite's python3 (what the wheelhouse must be built for)
SUITE_PYTHON: Final = {"bookworm": "3.11", "trixie": "3.13"}
#: python3-venv for ``python3 -m venv``; libstdc++6 because grpcio's manylinux wheel links
#: it from the system (manylinux allows that): the image's --version fails without it
PACKAGES: Final = ("python3", "python3-venv", "libstdc++6")
#: Essential packages and what PACKAGES need, no apt: nothing is installed into the image
#: later, every layer above is a COPY of a venv
VARIANT: Final = "essential"
#: merged /usr by the hook, not by the usrmerge package (which would pull in perl: 50 MB)
HOOK_DIR: Final = "/usr/share/mmdebstrap/hooks/merged-usr"
DPKG_PATHS: Final = (
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/info/*",
)
BASE_NAME: Final = "localhost/imex-python3"
#: Debian architecture of each image platform
ARCHES: Final = {"linux/amd64": "amd64", "linux/arm64": "arm64"}
#: podman's default rlimits exceed what this machine allows a container (FACTS.md): open
#: files up to the hard limit; processes at most 32768 (measured here: 32769 and above
#: failed in setrlimit with EPERM although the hard limit reads 96362)
NPROC_CAP: Final = 32768
NOFILE_CAP: Final = 1048576


class ImageError(Exception):
    """Building or importing the image failed; the message says which step and why."""


def cache_root() -> Path:
    env = os.environ.get("IMEX_IMAGE_CACHE")
    if env:
        return Path(env)
    xdg = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(xdg) / "imex-ensemble" / "image"


def podman(*args: str) -> list[str]:
    """``podman`` with the OCI runtime that works here: crun refuses this machine's hybrid
    cgroup layout, runc does not (FACTS.md)."""
    return ["podman", "--runtime", "runc", *args]


def ulimits() -> list[str]:
    """``--ulimit`` flags within this process's hard limits (for ``run`` and ``build``)."""
    out: list[str] = []
    for name, res, cap in (("nofile", resource.RLIMIT_NOFILE, NOFILE_CAP),
                           ("nproc", resource.RLIMIT_NPROC, NPROC_CAP)):
        hard = resource.getrlimit(res)[1]
        value = cap if hard == resource.RLIM_INFINITY else min(hard, cap)
        out += ["--ulimit", f"{name}={value}:{value}"]
    return out


def run(argv: Sequence[str], what: str, timeout: float) -> subprocess.CompletedProcess[str]:
    """Run a step; :class:`ImageError` with its last output lines when it fails."""
    try:
        proc = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout,
                              check=False)
    except subprocess.TimeoutExpired as e:
        raise ImageError(f"{what}: no result after {timeout:.0f}s ({' '.join(argv)})") from e
    except OSError as e:
        raise ImageError(f"{what}: cannot run {argv[0]}: {e}") from e
    if proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-25:])
        raise ImageError(f"{what} failed (exit {proc.returncode}): {' '.join(argv)}\n{tail}")
    return proc


@contextlib.contextmanager
def locked(root: Path, name: str) -> Iterator[None]:
    """One holder per cache entry or image tag at a time (others wait)."""
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".lock-{name}", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def base_key(arch: str, suite: str = SUITE, packages: Sequence[str] = PACKAGES) -> str:
    """Pure: the base's cache key."""
    parts = {"suite": suite, "arch": arch, "variant": VARIANT, "hook": HOOK_DIR,
             "packages": sorted(packages), "dpkg": list(DPKG_PATHS),
             "mirror": os.environ.get("IMEX_IMAGE_MIRROR", ""), "v": 1}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def base_ref(arch: str, suite: str = SUITE) -> str:
    return f"{BASE_NAME}:{suite}-{arch}-{base_key(arch, suite)}"


def mmdebstrap_argv(arch: str, out: Path, suite: str = SUITE) -> list[str]:
    argv = ["mmdebstrap", "--quiet", f"--variant={VARIANT}", f"--arch={arch}",
            f"--hook-dir={HOOK_DIR}", "--include=" + ",".join(PACKAGES),
            *(f"--dpkgopt={p}" for p in DPKG_PATHS), suite, str(out)]
    mirror = os.environ.get("IMEX_IMAGE_MIRROR")
    return [*argv, mirror] if mirror else argv


def build_rootfs(arch: str, root: Path | None = None, suite: str = SUITE) -> Path:
    """``base-<suite>-<arch>-<key>/rootfs.tar``, built when missing."""
    root = root or cache_root()
    name = f"base-{suite}-{arch}-{base_key(arch, suite)}"
    final = root / name
    with locked(root, name):
        if (final / "rootfs.tar").is_file():
            return final / "rootfs.tar"
        for tool in ("mmdebstrap",):
            if shutil.which(tool) is None:
                raise ImageError(f"{tool} is not installed (apt-get install {tool})")
        if not Path(HOOK_DIR).is_dir():
            raise ImageError(f"{HOOK_DIR} is missing: mmdebstrap 1.x ships it")
        tmp = Path(tempfile.mkdtemp(prefix=".base-", dir=root))
        try:
            t0 = time.monotonic()
            with foreign_arch(arch):
                run(mmdebstrap_argv(arch, tmp / "rootfs.tar", suite),
                    f"mmdebstrap ({suite}, {arch})", 3600)
            (tmp / "built.json").write_text(json.dumps({
                "suite": suite, "arch": arch, "packages": list(PACKAGES),
                "variant": VARIANT, "seconds": round(time.monotonic() - t0, 1)}))
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final / "rootfs.tar"


def image_exists(ref: str) -> bool:
    return subprocess.run(podman("image", "exists", ref), capture_output=True,
                          check=False).returncode == 0


def ensure_base(arch: str, suite: str = SUITE) -> str:
    """The local base image for ``arch`` (built and imported when missing): its name."""
    ref = base_ref(arch, suite)
    root = cache_root()
    with locked(root, f"import-{suite}-{arch}"):
        if image_exists(ref):
            return ref
        tar = build_rootfs(arch, root, suite)
        run(podman("import", "--quiet", "--arch", arch, "--os", "linux",
                   "--change", "ENV=LANG=C.UTF-8", "--change", 'CMD=["python3"]',
                   "--message", f"mmdebstrap --variant={VARIANT} {suite} "
                   f"--include={','.join(PACKAGES)} (tools/image_base.py)",
                   str(tar), ref), f"podman import {tar}", 600)
        forget_old_bases(arch, suite, root)
    return ref


def forget_old_bases(arch: str, suite: str, root: Path) -> None:
    """Bases of this suite and architecture under an older key: their tarballs and their
    podman images (an image still used by another is left to podman's refusal)."""
    keep = base_key(arch, suite)
    for old in root.glob(f"base-{suite}-{arch}-*"):
        if old.is_dir() and not old.name.endswith(keep):
            shutil.rmtree(old, ignore_errors=True)
    for lock in root.glob(f".lock-base-{suite}-{arch}-*"):
        if not lock.name.endswith(keep):
            lock.unlink(missing_ok=True)
    names = subprocess.run(podman("images", "--format", "{{.Repository}}:{{.Tag}}",
                                  BASE_NAME), capture_output=True, text=True, check=False)
    for ref in names.stdout.split():
        if ref.startswith(f"{BASE_NAME}:{suite}-{arch}-") and not ref.endswith(keep):
            subprocess.run(podman("rmi", ref), capture_output=True, check=False)


def handler_gone(arch: str) -> str:
    """Why ``arch``'s binaries cannot run here now ("" when they can or it is native): a
    handler another process removed mid-build shows as 'exec format error'."""
    from tests.vm.binfmt import ARCHES as QEMU
    from tests.vm.binfmt import BINFMT, native_arch

    if arch == native_arch() or arch not in QEMU:
        return ""
    handler = BINFMT / f"qemu-{QEMU[arch][0]}"
    if handler.exists():
        return ""
    return (f" ({handler} is gone: another process removed the qemu-user handler during "
            "the build; run it again)")


@contextlib.contextmanager
def foreign_arch(arch: str) -> Iterator[None]:
    """qemu-user for ``arch`` while the block runs (nothing for the native one): the
    binfmt_misc handler tests/vm/binfmt.py sets up and removes again."""
    from tests.vm.binfmt import BinfmtError
    from tests.vm.binfmt import foreign_arch as binfmt_foreign

    try:
        with binfmt_foreign(arch):
            yield
    except BinfmtError as e:
        raise ImageError(str(e)) from e


if __name__ == "__main__":  # python3 -m tools.image_base [ARCH...]: build (or find) bases
    import sys

    for a in sys.argv[1:] or ["amd64"]:
        t0 = time.monotonic()
        try:
            print(f"{ensure_base(a)} ({time.monotonic() - t0:.1f}s)", flush=True)
        except ImageError as e:
            raise SystemExit(f"tools.image_base: {e}") from e
