"""A Debian root from the VM tier's cache, run as a throwaway chroot: no QEMU, seconds.

TEST HARNESS. The guest tier's image builds (tests/vm/image.py: mmdebstrap of each suite
and architecture, cached by suite, architecture and package list) double as chroot roots:
the same python3 and cloud-init the VMs boot with. :func:`tree` unpacks a base tarball
once into ``<vm cache>/tree-<guest>-<key>/`` (read-only from then on).

:class:`Chroot` runs one command at a time in a private world that dies with it::

    unshare --mount --uts --ipc --net --pid --fork --kill-child  sh -c '
        mount -t overlay ...      the tree as lowerdir, this test's upper/work dirs
        mount --bind -o ro ...    the repository (/src) and wheelhouses the test names
        mount proc, tmpfs /run /tmp /dev/shm, bind the few /dev nodes programs open
        ip link set lo up; hostname <name>
        exec chroot <merged> env -i PATH=... "$@"'

Every mount lives in the new mount namespace and disappears with its last process, the pid
namespace takes every child with it, the network namespace has only loopback (nothing
reaches out), and the UTS namespace keeps cloud-init's ``hostname`` calls off this machine.
Changes persist in the upper directory from one command to the next, so a test can "boot"
cloud-init several times. A foreign architecture (arm64) runs through qemu-user: the
caller holds :func:`tests.vm.binfmt.foreign_arch`.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import shutil
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path

from tests.vm import image
from tests.vm.image import GuestOs

PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DEV_NODES = ("null", "zero", "full", "random", "urandom", "tty")


class ChrootError(Exception):
    """The chroot could not be set up; the message holds the tool's output."""


def tree(guest: GuestOs, root: Path | None = None) -> Path:
    """The guest's root file system, unpacked once from its cached base (built if missing)."""
    root = root or image.cache_root()
    key = image.base_key(guest.packages, guest.suite, guest.arch)
    final = root / f"tree-{guest.id}-{key}"
    if (final / "usr" / "bin").is_dir():
        return final
    with image._locked(root, f"base-{guest.id}-{key}"):
        base = image.build_base(root, key, guest)
    with image._locked(root, f"tree-{guest.id}-{key}"):
        if (final / "usr" / "bin").is_dir():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=".tree-", dir=root))
        try:
            # device nodes stay out: the chroot binds the host's few (DEV_NODES)
            image._run(["tar", "-C", str(tmp), "--numeric-owner", "--xattrs",
                        "--xattrs-include=*", "--exclude=./dev/*", "-xpf",
                        str(base / "rootfs.tar")], f"unpacking {base / 'rootfs.tar'}", 900)
            os.replace(tmp, final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


class Chroot:
    """One throwaway root: ``lower`` read-only, this chroot's changes under ``workdir``."""

    def __init__(self, lower: Path, workdir: Path, name: str = "chroot-test",
                 binds: Mapping[str, Path] | None = None) -> None:
        self.lower = lower
        self.dir = workdir
        self.upper = workdir / "upper"
        self.work = workdir / "work"
        self.merged = workdir / "merged"
        for d in (self.upper, self.work, self.merged):
            d.mkdir(parents=True, exist_ok=True)
        self.name = name
        self.binds = dict(binds or {})

    def path(self, inside: str) -> Path:
        """Where a file the chroot wrote is visible from outside (its upper layer)."""
        return self.upper / inside.lstrip("/")

    def read(self, inside: str) -> str:
        """A file as the chroot sees it: upper layer first, else the read-only tree."""
        for base in (self.upper, self.lower):
            p = base / inside.lstrip("/")
            if p.exists():
                return p.read_text(errors="replace")
        raise FileNotFoundError(inside)

    def _script(self) -> str:
        q = shlex.quote
        m = q(str(self.merged))
        lines = [
            "set -e",
            f"mount -t overlay overlay -o lowerdir={q(str(self.lower))},"
            f"upperdir={q(str(self.upper))},workdir={q(str(self.work))} {m}",
        ]
        for inside, outside in self.binds.items():
            dst = f"{m}{q(inside)}"
            lines += [f"mkdir -p {dst}", f"mount --bind {q(str(outside))} {dst}",
                      f"mount -o remount,bind,ro {dst}"]
        lines += [f"mount -t proc proc {m}/proc", f"mount -t sysfs sysfs {m}/sys",
                  f"mount -t tmpfs tmpfs {m}/run", f"mount -t tmpfs tmpfs {m}/tmp",
                  f"mkdir -p {m}/dev/shm {m}/dev/pts", f"mount -t tmpfs tmpfs {m}/dev/shm"]
        for node in DEV_NODES:
            lines += [f"touch {m}/dev/{node}", f"mount --bind /dev/{node} {m}/dev/{node}"]
        lines += ["ip link set lo up", f"hostname {q(self.name)}",
                  f'exec chroot {m} /usr/bin/env -i "$@"']
        return "\n".join(lines)

    def run(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
            timeout: float = 600, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
        """``argv`` inside (PATH, HOME, LANG and ``env`` only); the result, never raising."""
        envs = [f"PATH={PATH}", "HOME=/root", "LANG=C.UTF-8",
                *(f"{k}={v}" for k, v in (env or {}).items())]
        cmd = ["unshare", "--mount", "--propagation", "private", "--uts", "--ipc", "--net",
               "--pid", "--fork", "--kill-child", "sh", "-c", self._script(), "chroot",
               *envs, *argv]
        try:
            return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout,
                                  input=stdin, check=False)
        except subprocess.TimeoutExpired as e:
            raise ChrootError(f"{argv[0]}: no result after {timeout:.0f}s in {self.name}:\n"
                              f"{e.stdout!r}\n{e.stderr!r}") from e

    def sh(self, script: str, env: Mapping[str, str] | None = None,
           timeout: float = 600) -> subprocess.CompletedProcess[str]:
        return self.run(["/bin/sh", "-c", script], env, timeout)

    def check(self, script: str, env: Mapping[str, str] | None = None,
              timeout: float = 600) -> str:
        """``script`` must exit 0; its stdout."""
        p = self.sh(script, env, timeout)
        if p.returncode != 0:
            raise ChrootError(f"{self.name}: exit {p.returncode}: {script}\n"
                              f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
        return p.stdout

    def close(self) -> None:
        with contextlib.suppress(OSError):
            shutil.rmtree(self.dir)
