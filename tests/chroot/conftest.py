"""Fixtures for the chroot tier (``make chroottest``; marker ``chroot``).

Each test gets fresh chroots over the cached Debian trees (tests/chroot/sandbox.py): the
VM tier's images for bookworm amd64 and arm64 and trixie amd64, and a python3-only
bullseye for the floor. The first run builds what is missing (mmdebstrap, several minutes
per suite; the arm64 one under qemu-user) and fetches wheels from the package index; later
runs take seconds. Needs root (mount and user-less namespaces) and mmdebstrap.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.chroot.sandbox import Chroot, tree
from tests.vm import image
from tests.vm.binfmt import foreign_arch
from tests.vm.image import GuestOs
from tests.vm.wheelhouse import build_wheelhouse, target_for

REPO = Path(__file__).resolve().parents[2]
#: the wheelhouse every chroot test can see at /wheelhouse: amd64 and arm64, 3.11 and 3.13
TARGETS = [target_for("amd64", "3.11"), target_for("amd64", "3.13"),
           target_for("arm64", "3.11")]


@pytest.fixture(scope="session")
def wheelhouse(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if os.geteuid() != 0:
        pytest.skip("needs root: mounts and namespaces")
    if shutil.which("mmdebstrap") is None:
        pytest.fail("mmdebstrap is not installed (apt-get install mmdebstrap)")
    return build_wheelhouse(tmp_path_factory.mktemp("wheelhouse"), TARGETS)


ChrootFactory = Callable[..., Chroot]


@pytest.fixture
def chroot(tmp_path: Path, wheelhouse: Path) -> Iterator[ChrootFactory]:
    """``chroot(guest, name=..., binds=...)``: a fresh root over that guest's tree, with the
    repository at /src and the wheelhouse root at /wheelhouse (both read-only)."""
    made: list[Chroot] = []
    arches: set[str] = set()
    stack: list[object] = []

    def make(guest: GuestOs, name: str | None = None,
             binds: dict[str, Path] | None = None) -> Chroot:
        if guest.arch not in arches:
            cm = foreign_arch(guest.arch)
            cm.__enter__()
            stack.append(cm)
            arches.add(guest.arch)
        c = Chroot(tree(guest), tmp_path / f"chroot-{len(made)}", name or guest.id,
                   {"/src": REPO, "/wheelhouse": wheelhouse, **(binds or {})})
        made.append(c)
        return c

    try:
        yield make
    finally:
        for cm in reversed(stack):
            cm.__exit__(None, None, None)  # type: ignore[attr-defined]
        for c in made:
            c.close()


GUESTS = {g.id: g for g in (image.BOOKWORM_AMD64, image.TRIXIE_AMD64, image.BOOKWORM_ARM64,
                            image.BULLSEYE_PYTHON)}
