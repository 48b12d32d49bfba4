"""Keeps the IMEX channel device nodes (the I/O half of :mod:`guest_agent.imex.channels`).

:func:`keep_channels` is one pass: read ``/proc/devices`` (at most 64 KiB), make the
directory when it is missing, ``lstat`` each configured channel and act on what
``channels.plan_channel`` says. ``run`` and ``once`` both call it (``run`` every
``poll_interval``, so a node that goes missing is back within one poll). Every system
call error becomes a message in the returned state, never an exception: a pass that
cannot do its work says why, and the next pass tries again.

The paths are fixed (``/proc/devices``, ``/dev/nvidia-caps-imex-channels``): the tests run
the agent in a private mount namespace with a fake ``/proc/devices`` bind-mounted over
the real one and a tmpfs on the directory, so the product has no test-only setting.
"""

from __future__ import annotations

import contextlib
import grp
import logging
import os
import stat
from collections.abc import Sequence

from guest_agent.imex.channels import (
    CHANNEL_DIR,
    MAJOR_NAME,
    PROC_DEVICES,
    PROC_DEVICES_MAX,
    ChannelsState,
    DevicesError,
    Observed,
    channel_path,
    parse_major,
    plan_channel,
)

log = logging.getLogger("guest_agent.channels")  # logger name pinned

DIR_MODE = 0o755


def read_proc_devices(path: str = PROC_DEVICES) -> str:
    """The text of ``/proc/devices``; DevicesError when it cannot be read, is over
    64 KiB or is not text."""
    try:
        with open(path, "rb") as f:
            data = f.read(PROC_DEVICES_MAX + 1)
    except OSError as exc:
        raise DevicesError(f"cannot read {path}: {exc.strerror}") from exc
    if len(data) > PROC_DEVICES_MAX:
        raise DevicesError(f"{path} is over {PROC_DEVICES_MAX} bytes: not the kernel's "
                           "device list")
    try:
        return data.decode("ascii")
    except UnicodeDecodeError as exc:
        raise DevicesError(f"{path} is not ASCII text (byte {exc.start})") from exc


def observe(path: str) -> Observed:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return Observed("missing")
    return Observed.of_stat(st.st_mode, st.st_rdev, os.major(st.st_rdev),
                            os.minor(st.st_rdev), st.st_gid)


def group_id(name: str) -> int:
    """The gid of ``name``; KeyError when the group does not exist (yet)."""
    return grp.getgrnam(name).gr_gid


def _make(path: str, major: int, n: int, mode: int, gid: int | None) -> None:
    """mknod at ``path``, then the exact mode (mknod honours the umask) and group."""
    os.mknod(path, stat.S_IFCHR | mode, os.makedev(major, n))
    try:
        if gid is not None:
            os.chown(path, -1, gid)
        os.chmod(path, mode)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(path)
        raise


def _ensure_dir(directory: str) -> str | None:
    """Make the channel directory when missing; a message when something else is there."""
    try:
        st = os.lstat(directory)
    except FileNotFoundError:
        try:
            os.makedirs(directory, mode=DIR_MODE, exist_ok=True)
            os.chmod(directory, DIR_MODE)
        except OSError as exc:
            return f"cannot create {directory}: {exc.strerror}"
        log.info("created %s", directory)
        return None
    except OSError as exc:
        return f"cannot look at {directory}: {exc.strerror}"
    if not stat.S_ISDIR(st.st_mode):
        return (f"{directory} exists and is not a directory; no channel node is made "
                "there (remove it to let the agent create the channels)")
    return None


def keep_channels(channels: Sequence[int], mode: int, group: str | None,
                  directory: str = CHANNEL_DIR,
                  proc_devices: str = PROC_DEVICES, *, act: bool = True) -> ChannelsState:
    """One pass over the configured channels (module docstring); never raises for what
    it finds on the system. ``present`` holds only channels checked against the major:
    without one (waiting, or an unreadable /proc/devices) it is empty. ``act`` False
    (``preflight``): look only; what a pass would do is an error."""
    state = ChannelsState(configured=tuple(channels))
    if not channels:
        return state
    try:
        major = parse_major(read_proc_devices(proc_devices))
    except DevicesError as exc:
        state.errors.append(f"{exc}; no channel node is made or changed")
        return state
    if major is None:
        state.waiting = (f"the nvidia driver has not registered {MAJOR_NAME} in "
                         f"{proc_devices} (module not loaded yet?)")
        return state
    state.major = major
    problem = _ensure_dir(directory) if act else None
    if problem is not None:
        state.errors.append(problem)
        return state
    gid: int | None = None
    if group is not None:
        try:
            gid = group_id(group)
        except KeyError:
            state.errors.append(f"imex_channel_group {group!r} does not exist; channel "
                                "nodes keep the group they have (new ones: root)")
    for n in channels:
        path = channel_path(n, directory)
        try:
            if not act:
                _look_one(state, n, path, major, mode, gid)
                continue
            _keep_one(state, n, path, major, mode, gid, directory)
        except OSError as exc:
            state.errors.append(f"{path}: {exc.strerror or exc}")
    return state


def _look_one(state: ChannelsState, n: int, path: str, major: int, mode: int,
              gid: int | None) -> None:
    action = plan_channel(n, path, major, observe(path), mode, gid)
    if action.verb in ("ok", "fix"):  # a node that opens; its mode is the agent's to set
        state.present.append(n)
    elif action.verb == "refuse":
        state.errors.append(action.why)
    else:
        state.errors.append(f"{path}: {action.why} (the agent {action.verb}s it)")


def _keep_one(state: ChannelsState, n: int, path: str, major: int, mode: int,
              gid: int | None, directory: str) -> None:
    action = plan_channel(n, path, major, observe(path), mode, gid)
    if action.verb == "ok":
        state.present.append(n)
    elif action.verb == "refuse":
        state.errors.append(action.why)
    elif action.verb == "create":
        try:
            _make(path, major, n, mode, gid)
        except FileExistsError:
            return  # appeared meanwhile: the next pass looks at it
        state.present.append(n)
        state.changed.append(f"created channel{n} ({major}:{n}, mode {mode:04o})")
    elif action.verb == "replace":
        tmp = f"{directory}/.channel{n}.imex-guest-agent.tmp"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        _make(tmp, major, n, mode, gid)
        if observe(path).kind != "chr":  # changed under us: leave it for the next pass
            os.unlink(tmp)
            return
        os.rename(tmp, path)
        state.present.append(n)
        state.changed.append(f"replaced channel{n} ({action.why})")
    else:  # fix
        if gid is not None:
            os.chown(path, -1, gid, follow_symlinks=False)
        os.chmod(path, mode)
        state.present.append(n)
        state.changed.append(f"set channel{n}'s {action.why}")



def log_news(old: ChannelsState, new: ChannelsState) -> None:
    """Log what a pass changed, and what is wrong or awaited when it is news."""
    for change in new.changed:
        log.info("imex channels: %s", change)
    if new.waiting and new.waiting != old.waiting:
        log.info("imex channels: waiting: %s", new.waiting)
    for error in new.errors:
        if error not in old.errors:
            log.error("imex channels: %s", error)
