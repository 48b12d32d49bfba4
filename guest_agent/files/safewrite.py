"""One writer for the hosts file and the nodes file that never leaves them torn.

Order of preference:
1. unchanged content: no write at all (no inotify noise, no mtime churn);
2. temp file in the same directory, fsync, rename over the target, fsync the
   directory; the temp file gets the target's mode and owner. Readers see the
   old file or the new one, and so does the disk after a crash;
3. when rename cannot replace the target (EBUSY/EXDEV: a bind mount such as
   ``/etc/hosts`` under ``ip netns exec`` or in a pod; EROFS/EACCES/EPERM on
   the directory), an in-place write that never empties the file: one
   ``pwrite`` at offset 0 of the new content, padded with ``\\n`` to the old
   length when it is shorter, then ``ftruncate`` to the new length. A reader
   or a crash between the two calls sees the new content followed by blank
   lines, which every hosts parser reads as the new content; nothing of the
   old entries remains. A single ``pwrite`` within one 4 KiB page is not split
   by a signal, so files up to a page are all-or-nothing against SIGKILL.

A symlink is followed: its target is written and the link kept. A target
that is a mount point (listed in /proc/self/mountinfo) goes straight to the
in-place path instead of paying for a temp file and a failed rename on every
write. Temp files a crash left behind (ours end in ``.imex-tmp``) are removed
by the next write once they are a minute old.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
from pathlib import Path

_IN_PLACE_ERRNOS = frozenset({errno.EBUSY, errno.EXDEV, errno.EROFS, errno.EACCES, errno.EPERM})
PAD_BYTE = b"\n"
TMP_SUFFIX = ".imex-tmp"
STALE_TMP_AGE_S = 60.0


class FileWriteError(OSError):
    """A managed file could not be written; the message names the file."""


def _fsync_dir(directory: str) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike[str]) -> bytes | None:
    """Current content of ``path``, or None when it does not exist."""
    try:
        return Path(path).read_bytes()
    except FileNotFoundError:
        return None


def _unescape_mountinfo(field: str) -> str:
    return field.encode().decode("unicode_escape") if "\\" in field else field


def is_mount_point(path: str) -> bool:
    """Whether ``path`` is itself a mount point (a bind-mounted file counts)."""
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as f:
            return any(
                len(parts) > 4 and _unescape_mountinfo(parts[4]) == path
                for parts in (line.split() for line in f)
            )
    except OSError:
        return False


def _remove_stale_temps(directory: str, base: str) -> None:
    prefix, cutoff = f".{base}.", time.time() - STALE_TMP_AGE_S
    try:
        names = [
            n for n in os.listdir(directory) if n.startswith(prefix) and n.endswith(TMP_SUFFIX)
        ]
    except OSError:
        return
    for name in names:
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.lstat(path).st_mtime < cutoff:
                os.unlink(path)


def _replace(target: str, data: bytes, st: os.stat_result | None, default_mode: int) -> None:
    directory = os.path.dirname(target) or "."
    base = os.path.basename(target)
    _remove_stale_temps(directory, base)
    fd, tmp = tempfile.mkstemp(prefix=f".{base}.", suffix=TMP_SUFFIX, dir=directory)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if st is not None:
            os.fchmod(fd, stat.S_IMODE(st.st_mode))
            if (st.st_uid, st.st_gid) != (os.geteuid(), os.getegid()):
                os.fchown(fd, st.st_uid, st.st_gid)
        else:
            os.fchmod(fd, default_mode)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, target)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    _fsync_dir(directory)


def _pwrite_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    offset = 0
    while offset < len(data):
        offset += os.pwrite(fd, view[offset:], offset)


def write_in_place(target: str, data: bytes) -> None:
    """Overwrite ``target`` without replacing its inode (see module docstring)."""
    fd = os.open(target, os.O_RDWR | os.O_CLOEXEC)
    try:
        old_len = os.fstat(fd).st_size
        padded = data + PAD_BYTE * (old_len - len(data)) if len(data) < old_len else data
        _pwrite_all(fd, padded)
        if len(padded) != len(data):
            os.ftruncate(fd, len(data))
        os.fsync(fd)
    finally:
        os.close(fd)


def _in_place(path: str | os.PathLike[str], target: str, data: bytes) -> bool:
    try:
        write_in_place(target, data)
    except OSError as exc:
        raise FileWriteError(exc.errno, f"cannot write {path} in place: {exc.strerror}") from exc
    return True


def replace_file(path: str | os.PathLike[str], data: bytes, *, mode: int) -> None:
    """Make ``path`` hold ``data`` by rename only: a temp file of ``mode`` in the same
    directory, fsynced, renamed over ``path``, the directory fsynced (step 2 above,
    never step 3). On any failure ``path`` is as it was, the temp file is gone, and
    FileWriteError (chained to the OSError) names ``path``. For files whose old
    content must survive a failed write, such as the operator's generated user-data.
    """
    target = os.path.realpath(path)
    try:
        _replace(target, data, None, mode)
    except OSError as exc:
        raise FileWriteError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc


def write_file(path: str | os.PathLike[str], data: bytes, *, default_mode: int = 0o644) -> bool:
    """Make ``path`` hold exactly ``data``; True when something was written.

    Raises FileWriteError (chained to the OSError) naming the file.
    """
    target = os.path.realpath(path)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and st.st_size == len(data) and read_bytes(target) == data:
        return False
    if st is not None and is_mount_point(target):
        return _in_place(path, target, data)
    try:
        _replace(target, data, st, default_mode)
    except OSError as exc:
        if st is None or exc.errno not in _IN_PLACE_ERRNOS:
            raise FileWriteError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
        return _in_place(path, target, data)
    return True
