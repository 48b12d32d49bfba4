"""inotify through libc for the test harnesses' file watchers (the soak's reader, the
benchmarks' hosts watcher): stdlib only, since both run as small processes of their own.

TEST CODE: the guest agent watches its files with watchfiles.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct

IN_MODIFY = 0x002
IN_ATTRIB = 0x004
IN_CLOSE_WRITE = 0x008
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
_EVENT = struct.Struct("iIII")


class Inotify:
    """One non-blocking inotify descriptor."""

    def __init__(self) -> None:
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.fd = self.libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")

    def add(self, path: str, mask: int) -> int:
        """Watch ``path``; its watch descriptor. OSError names the path."""
        wd = int(self.libc.inotify_add_watch(self.fd, path.encode(), mask))
        if wd < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {path}")
        return wd

    def remove(self, wd: int) -> None:
        self.libc.inotify_rm_watch(self.fd, wd)

    def events(self) -> list[tuple[int, bytes]]:
        """(watch descriptor, name) of every event waiting now; name is b"" for an event
        on the watched path itself."""
        out: list[tuple[int, bytes]] = []
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.fd, 65536):
                off = 0
                while off < len(data):
                    wd, _mask, _cookie, length = _EVENT.unpack_from(data, off)
                    start = off + _EVENT.size
                    out.append((wd, data[start:start + length].rstrip(b"\0")))
                    off = start + length
        return out

    def wait(self, timeout: float) -> bool:
        """Whether an event came within ``timeout`` seconds (all waiting are consumed)."""
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        self.events()
        return True
