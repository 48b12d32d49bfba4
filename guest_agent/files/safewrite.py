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

``SharedFile`` is the read-merge-write for a file others write too (``/etc/hosts``):
it keeps a line another process adds while we merge. It merges from one read, checks
the file is still that content right before replacing it, and keeps the inodes it
replaced open (the last ``REPLACED_KEPT``), so an append that lands in one after our
check (``echo >> /etc/hosts`` opened before one of our renames) is carried into the
next merge.

A symlink is followed: its target is written and the link kept. A target
that is a mount point (listed in /proc/self/mountinfo) goes straight to the
in-place path instead of paying for a temp file and a failed rename on every
write; for ``write_file`` (the agent's own files), a target found not to be one is
not looked up again (a mount made later fails the rename with EBUSY, and that write
goes in place). Temp files a crash left behind (ours end in ``.imex-tmp``) are
removed by the next write once they are a minute old.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

_IN_PLACE_ERRNOS = frozenset({errno.EBUSY, errno.EXDEV, errno.EROFS, errno.EACCES, errno.EPERM})
PAD_BYTE = b"\n"
TMP_SUFFIX = ".imex-tmp"
STALE_TMP_AGE_S = 60.0
#: merges ``SharedFile.merge`` makes before it settles for its last write: each retry means
#: another process wrote the file during the one before
MERGE_ATTEMPTS = 5
#: inodes ``SharedFile`` replaced and still holds open: a writer that opened the file
#: before our rename and writes only after this many more of our merges loses its line
#: (held: one file descriptor and one copy of the file's content each)
REPLACED_KEPT = 4


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


#: ``write_file`` targets found not to be mount points, so each write does not read
#: mountinfo again (the status file is written up to three times per change). A bind
#: mount made later makes the rename fail with EBUSY, which takes the in-place path and
#: drops the entry.
_NOT_MOUNTED: set[str] = set()


def _mounted(target: str) -> bool:
    if target in _NOT_MOUNTED:
        return False
    if is_mount_point(target):
        return True
    _NOT_MOUNTED.add(target)
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


def _replace(target: str, data: bytes, st: os.stat_result | None, default_mode: int,
             durable: bool = True) -> None:
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
        if durable:
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
    if durable:
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


def _put(
    path: str | os.PathLike[str], target: str, data: bytes, st: os.stat_result | None,
    default_mode: int, durable: bool = True,
    mount_point: Callable[[str], bool] = is_mount_point,
) -> None:
    """Steps 2-3 of the module docstring for content known to differ from the file's.

    ``mount_point``: ``write_file`` passes ``_mounted`` (the agent's own files). A
    shared file (``SharedFile``) is looked up on every write, as others mount over it;
    a faster merge made the open append race of test_safewrite_merge.py likelier
    (docs/benchmarks.md, 2026-12-05)."""
    if st is not None and mount_point(target):
        _in_place(path, target, data)
        return
    try:
        _replace(target, data, st, default_mode, durable)
    except OSError as exc:
        if st is None or exc.errno not in _IN_PLACE_ERRNOS:
            raise FileWriteError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
        _NOT_MOUNTED.discard(target)
        _in_place(path, target, data)


def write_file(path: str | os.PathLike[str], data: bytes, *, default_mode: int = 0o644,
               durable: bool = True) -> bool:
    """Make ``path`` hold exactly ``data``; True when something was written.

    ``durable=False`` leaves out both fsyncs: still all-or-nothing for readers (the
    rename), but not across a power loss. For runtime state under ``/run`` (a tmpfs,
    emptied at every boot), where an fsync buys nothing and costs the CPU of a write.

    Raises FileWriteError (chained to the OSError) naming the file.
    """
    target = os.path.realpath(path)
    try:
        st: os.stat_result | None = os.stat(target)
    except FileNotFoundError:
        st = None
    if st is not None and st.st_size == len(data) and read_bytes(target) == data:
        return False
    _put(path, target, data, st, default_mode, durable, mount_point=_mounted)
    return True


@dataclass(frozen=True, slots=True)
class Merged:
    """What ``SharedFile.merge`` did: the content it left, the content it merged from."""

    data: bytes
    base: bytes | None
    written: bool
    #: merges made; more than one means another process wrote the file meanwhile
    attempts: int


def _read_fd(fd: int) -> bytes:
    chunks, offset = [], 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def _open_existing(target: str) -> int | None:
    try:
        return os.open(target, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return None


def _same_inode(fd: int, target: str) -> bool:
    try:
        st = os.stat(target)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_ino, st.st_dev) == (held.st_ino, held.st_dev)


def _unchanged(fd: int | None, target: str, content: bytes | None) -> bool:
    """Whether ``target`` is still the inode behind ``fd`` and holds ``content``."""
    if fd is None:
        return not os.path.lexists(target)
    return _same_inode(fd, target) and _read_fd(fd) == content


@dataclass(slots=True)
class _Replaced:
    """The inode our last rename replaced, held open: a writer that opened it before
    the rename (``echo >> /etc/hosts`` blocked behind our fsync) still writes there."""

    fd: int
    #: what it held when we read it, and what we renamed over it
    known: bytes
    put: bytes


class SharedFile:
    """A file other processes write too (``/etc/hosts``), merged without losing their lines.

    Each ``merge`` reads once, merges, checks the file is still what it read right
    before replacing it (and merges again when not), and keeps the replaced inode open
    for the next ``REPLACED_KEPT`` merges. What was written to such an inode after our
    read (an append racing our rename, or one from a writer that stalled across several
    of our merges) is carried into the next merge, which the agent's file watcher runs
    right after our own write. One instance per path; not thread-safe.
    """

    def __init__(self, path: str | os.PathLike[str], *, default_mode: int = 0o644) -> None:
        self.path = path
        self.default_mode = default_mode
        #: oldest first
        self._replaced: list[_Replaced] = []

    def close(self) -> None:
        while self._replaced:
            os.close(self._replaced.pop().fd)

    def _hold(self, replaced: _Replaced) -> None:
        self._replaced.append(replaced)
        while len(self._replaced) > REPLACED_KEPT:
            os.close(self._replaced.pop(0).fd)

    def _carried(self, current: bytes | None) -> tuple[bytes | None, list[bytes | None]]:
        """(``current`` plus what was written to the inodes we replaced since we read
        them, what each of those holds now or None when unchanged); nothing is marked
        carried until the merge lands.

        The newest of them may also have been rewritten whole (its holder truncated
        and wrote it); the older ones can only have been appended to by a writer that
        opened the file before our rename, and an append is all they carry."""
        base, appended = current, b""
        news: list[bytes | None] = []
        for n, old in enumerate(self._replaced):
            later = _read_fd(old.fd)
            if later == old.known:
                news.append(None)
                continue
            news.append(later)
            if later.startswith(old.known):
                appended += later[len(old.known) :]  # an append: add it
            elif n == len(self._replaced) - 1 and current == old.put:
                base = later  # rewritten, and ours untouched since: theirs is newer
            # else both rewritten since: the file on disk wins
        if base is None or not appended:
            return base, news
        return base + appended, news

    def _landed(self, news: list[bytes | None]) -> None:
        """Mark what ``_carried`` read as carried, so no merge adds it twice."""
        for old, later in zip(self._replaced, news, strict=True):
            if later is not None:
                old.known = later

    def merge(self, merge: Callable[[bytes | None], bytes]) -> Merged:
        """Make the file hold ``merge(its content)``; ``merge`` must be pure.

        It is called again on the newer content whenever the file changed while we
        merged; after ``MERGE_ATTEMPTS`` such races in a row the last merge is written
        anyway (the managed part must land) and the race is left to the next call.
        Raises FileWriteError naming the file.
        """
        path, target = self.path, os.path.realpath(self.path)
        data, base = b"", None
        for attempt in range(1, MERGE_ATTEMPTS + 1):
            try:
                fd = _open_existing(target)
            except OSError as exc:
                raise FileWriteError(exc.errno, f"cannot read {path}: {exc.strerror}") from exc
            try:
                current = _read_fd(fd) if fd is not None else None
                base, carried = self._carried(current)
                data = merge(base)
                if data == current:
                    self._landed(carried)
                    return Merged(data, base, False, attempt)
                if attempt < MERGE_ATTEMPTS and not _unchanged(fd, target, current):
                    continue  # changed while we merged: merge again from the news
                _put(path, target, data, os.fstat(fd) if fd is not None else None,
                     self.default_mode)
                self._landed(carried)
                if fd is not None and current is not None and not _same_inode(fd, target):
                    self._hold(_Replaced(fd, current, data))
                    fd = None
                return Merged(data, base, True, attempt)
            except OSError as exc:
                if isinstance(exc, FileWriteError):
                    raise
                raise FileWriteError(exc.errno, f"cannot write {path}: {exc.strerror}") from exc
            finally:
                if fd is not None:
                    os.close(fd)
        raise AssertionError("the last attempt always returns")
