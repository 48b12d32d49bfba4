"""binfmt_misc for foreign-architecture chroots: set up what is missing, undo only that.

TEST HARNESS. ``mmdebstrap --arch=arm64`` on an amd64 machine runs the arm64 maintainer
scripts through ``qemu-aarch64-static``, which the kernel only does once a binfmt_misc
handler for aarch64 ELF files is registered. Handlers and the binfmt_misc mount are
machine-wide (FACTS.md), so :func:`foreign_arch` registers the handler from the line
``qemu-user-static`` ships in ``/usr/lib/binfmt.d/`` only when none is there, mounts
binfmt_misc only when it is not mounted, and removes exactly those when the last user of
this machine is done. A handler or mount that existed before is never touched.

Concurrency: several processes (an image build, a chroot test) may need the handler at the
same time. Users are counted by pid in ``/run/imex-ensemble-binfmt/state.json`` under an
exclusive ``flock``; the last user to leave (dead pids do not count) undoes what the state
says was set up here. A killed process leaves its pid behind; the next user prunes it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import platform
import subprocess
from collections.abc import Iterator
from pathlib import Path

BINFMT = Path("/proc/sys/fs/binfmt_misc")
STATE_DIR = Path("/run/imex-ensemble-binfmt")
BINFMT_D = Path("/usr/lib/binfmt.d")

#: Debian architecture -> (qemu-user name, ``platform.machine()`` of a native host)
ARCHES = {"amd64": ("x86_64", "x86_64"), "arm64": ("aarch64", "aarch64")}


class BinfmtError(Exception):
    """The handler could not be set up; the message says what is missing."""


def native_arch() -> str:
    machine = platform.machine()
    for deb, (_, native) in ARCHES.items():
        if native == machine:
            return deb
    return machine


def handler_line(arch: str, binfmt_d: Path = BINFMT_D) -> str:
    """The registration line qemu-user-static ships for ``arch`` (``:qemu-aarch64:M::...``)."""
    qemu = ARCHES[arch][0]
    path = binfmt_d / f"qemu-{qemu}.conf"
    try:
        line = path.read_text().strip()
    except OSError as e:
        raise BinfmtError(f"{path} is missing: apt-get install qemu-user-static ({e})") from e
    if not line.startswith(f":qemu-{qemu}:"):
        raise BinfmtError(f"{path}: not a binfmt_misc registration line: {line[:60]!r}")
    return line


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def _state() -> Iterator[dict[str, object]]:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    with open(STATE_DIR / "lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = STATE_DIR / "state.json"
        try:
            state: dict[str, object] = json.loads(path.read_text())
        except (OSError, ValueError):
            state = {"users": [], "mounted": False, "registered": []}
        yield state
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state))
        os.replace(tmp, path)


def _users(state: dict[str, object]) -> list[int]:
    raw = state.get("users")
    return [int(p) for p in raw if _alive(int(p))] if isinstance(raw, list) else []


def _enter(arch: str) -> None:
    qemu = ARCHES[arch][0]
    with _state() as state:
        users = _users(state)
        if not os.path.ismount(BINFMT):
            subprocess.run(["mount", "-t", "binfmt_misc", "binfmt_misc", str(BINFMT)],
                           check=True, capture_output=True, timeout=30)
            state["mounted"] = True
        registered = [str(r) for r in state.get("registered") or []]  # type: ignore[attr-defined]
        handler = BINFMT / f"qemu-{qemu}"
        if not handler.exists():
            (BINFMT / "register").write_text(handler_line(arch))
            registered.append(f"qemu-{qemu}")
        if "enabled" not in handler.read_text():
            raise BinfmtError(f"{handler} exists but is disabled; not touching it")
        state["registered"] = sorted(set(registered))
        state["users"] = [*users, os.getpid()]


def _leave() -> list[str]:
    undone: list[str] = []
    with _state() as state:
        users = [p for p in _users(state) if p != os.getpid()]
        state["users"] = users
        if users:
            return undone
        for name in state.get("registered") or []:  # type: ignore[attr-defined]
            with contextlib.suppress(OSError):
                (BINFMT / str(name)).write_text("-1")
                undone.append(str(name))
        state["registered"] = []
        if state.get("mounted"):
            subprocess.run(["umount", str(BINFMT)], capture_output=True, timeout=30)
            undone.append("mount")
            state["mounted"] = False
    return undone


@contextlib.contextmanager
def foreign_arch(arch: str) -> Iterator[None]:
    """Binaries of ``arch`` run here for the duration (a no-op for the native arch)."""
    if arch == native_arch():
        yield
        return
    if arch not in ARCHES:
        raise BinfmtError(f"no qemu-user handler known for architecture {arch!r}")
    if not Path(f"/usr/bin/qemu-{ARCHES[arch][0]}-static").exists():
        raise BinfmtError(f"qemu-{ARCHES[arch][0]}-static is missing: "
                          "apt-get install qemu-user-static")
    _enter(arch)
    try:
        yield
    finally:
        _leave()


def cleanup() -> list[str]:
    """Undo what dead users left set up (a killed run never reached its ``finally``)."""
    if not (STATE_DIR / "state.json").exists():
        return []
    with _state() as state:
        if _users(state):
            return []
        state["users"] = [os.getpid()]
    return _leave()


if __name__ == "__main__":  # python -m tests.vm.binfmt: remove what killed runs left behind
    undone = cleanup()
    print("binfmt: removed " + (", ".join(undone) if undone else "nothing"))
