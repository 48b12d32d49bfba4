"""When does every guest's /etc/hosts hold a pin? inotify on each VM's etc directory.

Each sandbox VM sees ``/etc/netns/<ns>/hosts`` as its ``/etc/hosts`` (a bind
mount, so the guest agent rewrites it in place; a rename would show as
IN_MOVED_TO). One inotify descriptor watches every VM's directory; a
background thread re-reads only the file an event names and checks it
against the pending expectations ``(slot, ip) -> VMs still to see it``. A
slow safety sweep (every 0.5 s) re-reads every file in case an event was
coalesced away, so a result is never lost, only possibly later.

Times are CLOCK_MONOTONIC at detection: the latency includes this thread's
wake-up, so it errs on the long side.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import select
import struct
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from imex_shared.hostsfile import read_block
from imex_shared.model import EnsembleId

IN_MODIFY = 0x002
IN_CLOSE_WRITE = 0x008
IN_MOVED_TO = 0x080
IN_CREATE = 0x100
_EVENT = struct.Struct("iIII")


@dataclass
class Pending:
    slot: int
    ip: str
    started: float
    waiting: set[str]
    done: threading.Event = field(default_factory=threading.Event)
    finished: float = 0.0


class HostsWatch:
    def __init__(self, ens: EnsembleId) -> None:
        self._ens = ens
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._fd = self._libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self._fd < 0:
            raise OSError(ctypes.get_errno(), "inotify_init1")
        self._paths: dict[str, Path] = {}  # vm -> hosts file
        self._wds: dict[int, str] = {}
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hosts-watch", daemon=True)
        self._thread.start()

    def set_vms(self, paths: dict[str, Path]) -> None:
        """Watch exactly these VMs (name -> hosts file)."""
        with self._lock:
            for wd in list(self._wds):
                self._libc.inotify_rm_watch(self._fd, wd)
            self._wds.clear()
            self._paths = dict(paths)
            for vm, path in paths.items():
                wd = self._libc.inotify_add_watch(
                    self._fd, str(path.parent).encode(),
                    IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE)
                if wd < 0:
                    raise OSError(ctypes.get_errno(), f"inotify_add_watch {path.parent}")
                self._wds[wd] = vm

    def expect(self, slot: int, ip: str, started: float) -> Pending:
        """Track the moment every watched VM pins ``slot`` to ``ip``."""
        with self._lock:
            p = Pending(slot, ip, started, set(self._paths))
            self._pending.append(p)
        self._check(list(self._paths))
        return p

    def _check(self, vms: list[str]) -> None:
        now = time.monotonic()
        with self._lock:
            if not self._pending:
                return
            blocks: dict[str, dict[int, str] | None] = {}
            for vm in vms:
                path = self._paths.get(vm)
                if path is None:
                    continue
                try:
                    blocks[vm] = read_block(path.read_bytes(), self._ens)
                except OSError:
                    blocks[vm] = None
            for p in list(self._pending):
                for vm, block in blocks.items():
                    if vm in p.waiting and block is not None and block.get(p.slot) == p.ip:
                        p.waiting.discard(vm)
                if not p.waiting:
                    p.finished = now
                    p.done.set()
                    self._pending.remove(p)

    def _run(self) -> None:
        last_sweep = time.monotonic()
        while not self._stop.is_set():
            ready, _, _ = select.select([self._fd], [], [], 0.1)
            vms: set[str] = set()
            if ready:
                with contextlib.suppress(BlockingIOError):
                    data = os.read(self._fd, 65536)
                    off = 0
                    while off < len(data):
                        wd, _mask, _cookie, length = _EVENT.unpack_from(data, off)
                        name = data[off + _EVENT.size: off + _EVENT.size + length].rstrip(b"\0")
                        off += _EVENT.size + length
                        vm = self._wds.get(wd)
                        if vm is not None and name in (b"hosts", b""):
                            vms.add(vm)
            if time.monotonic() - last_sweep > 0.5:
                vms = set(self._paths)
                last_sweep = time.monotonic()
            if vms:
                self._check(sorted(vms))

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        os.close(self._fd)
