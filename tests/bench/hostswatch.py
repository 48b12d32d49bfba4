"""When does every guest's /etc/hosts hold a pin? inotify, in a watcher process of its own.

Each sandbox VM sees ``/etc/netns/<ns>/hosts`` as its ``/etc/hosts`` (a bind
mount, so the guest agent rewrites it in place; a rename would show as
IN_MOVED_TO). A child process (``python -m tests.bench.hostswatch``) holds one
inotify descriptor on every VM's directory, re-reads only the file an event names,
and reports each VM's hosts block whenever it differs from the last one reported,
with the CLOCK_MONOTONIC time of that read (one clock for the whole machine). A slow
safety sweep (every 0.5 s) re-reads every file in case an event was coalesced away, so
a result is never lost, only possibly later.

Why a process, and why a real-time one: the file holds the pin from the guest's write,
and the figure should not include the observer's own wait for a CPU. A watcher thread
beside the harness's API double and DNS stand-in also waited for their GIL; a plain
process waits in the run queue behind 18 guests and 18 IMEX stand-ins on two cores. In
the full ``make bench`` of 2026-12-07 such a process still read the last guest's write
45 ms (p50) after the write (p50 114.9 ms against 69.6 by mtime), about what the thread
lost. So the watcher runs SCHED_FIFO (priority ``RT_PRIORITY``, root only; it blocks in
``select`` between events, and each wake-up reads a few small files): it preempts the
VMs' processes on each inotify event, as a latency instrument should. Without the
privilege it runs as a plain process and says so (``HostsWatch.realtime``). The parent
matches the child's times against the expectations, however late it reads them.

Each report also carries the file's mtime on the same clock: ``Pending.written`` (the
last guest's write) is printed beside the reader's figure. The kernel stamps mtimes
from a coarse clock (one tick, 4 ms at HZ=250, behind), so it errs on the early side.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from imex_shared.hostsfile import read_block
from imex_shared.model import EnsembleId
from tests.inotify import IN_CLOSE_WRITE, IN_CREATE, IN_MODIFY, IN_MOVED_TO, Inotify

SWEEP_S = 0.5
#: SCHED_FIFO priority of the watcher process: any real-time priority runs before every
#: normal process; 10 leaves room below for anything that needs it more
RT_PRIORITY = 10
REPO = Path(__file__).resolve().parents[2]


@dataclass
class Pending:
    slot: int
    ip: str
    started: float
    waiting: set[str]
    done: threading.Event = field(default_factory=threading.Event)
    #: when the last waited-for VM's file was read holding the pin (the figure)
    finished: float = 0.0
    #: the latest mtime among those reads: when the last guest wrote it
    written: float = 0.0


class HostsWatch:
    """The parent side: expectations in, times from the watcher process out."""

    def __init__(self, ens: EnsembleId) -> None:
        self._ens = ens
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "tests.bench.hostswatch", ens.namespace, ens.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, cwd=REPO, text=True, bufsize=1)
        self._vms: set[str] = set()
        #: the last block the watcher reported per VM
        self._blocks: dict[str, dict[int, str]] = {}
        self._pending: list[Pending] = []
        self._lock = threading.Lock()
        self._acked = threading.Condition(self._lock)
        self._ack = 0
        self._error: str | None = None
        self._seq = 0
        #: whether the watcher got its real-time priority (None: not yet known; it is
        #: known once ``set_vms`` returns)
        self.realtime: bool | None = None
        self._thread = threading.Thread(target=self._run, name="hosts-watch", daemon=True)
        self._thread.start()

    def set_vms(self, paths: dict[str, Path], timeout: float = 30.0) -> None:
        """Watch exactly these VMs (name -> hosts file); returns once the watcher has
        read every one of them, so an ``expect`` after it knows what they hold."""
        assert self._proc.stdin is not None
        with self._lock:
            self._seq += 1
            seq = self._seq
            self._vms = set(paths)
            self._blocks = {vm: b for vm, b in self._blocks.items() if vm in paths}
        self._proc.stdin.write(json.dumps({"seq": seq, "vms": {
            vm: str(path) for vm, path in paths.items()}}) + "\n")
        self._proc.stdin.flush()
        with self._acked:
            if not self._acked.wait_for(lambda: self._ack >= seq, timeout):
                raise TimeoutError(f"the hosts watcher did not read {len(paths)} files "
                                   f"in {timeout:g} s (exit status {self._proc.poll()})")
            if self._error is not None:
                raise OSError(f"the hosts watcher cannot watch them: {self._error}")

    def expect(self, slot: int, ip: str, started: float) -> Pending:
        """Track the moment every watched VM pins ``slot`` to ``ip``."""
        with self._lock:
            p = Pending(slot, ip, started, set(self._vms))
            now = time.monotonic()
            for vm in list(p.waiting):
                if self._blocks.get(vm, {}).get(slot) == ip:
                    self._seen(p, vm, now, now)
            if p.waiting:
                self._pending.append(p)
        return p

    @staticmethod
    def _seen(p: Pending, vm: str, at: float, written: float) -> None:
        p.waiting.discard(vm)
        p.finished = max(p.finished, at, p.started)
        p.written = max(p.written, min(written, at))
        if not p.waiting:
            p.done.set()

    def _run(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._lock:
                if "realtime" in msg:
                    self.realtime = msg["realtime"]
                    continue
                if "ack" in msg:
                    self._ack, self._error = msg["ack"], msg.get("error")
                    self._acked.notify_all()
                    continue
                vm, block = msg["vm"], {int(k): v for k, v in msg["block"].items()}
                if vm not in self._vms:
                    continue
                self._blocks[vm] = block
                for p in list(self._pending):
                    if vm in p.waiting and block.get(p.slot) == p.ip:
                        self._seen(p, vm, msg["t"], msg["w"])
                        if not p.waiting:
                            self._pending.remove(p)

    def close(self) -> None:
        if self._proc.stdin is not None:
            with contextlib.suppress(OSError):
                self._proc.stdin.close()
        try:
            self._proc.wait(5)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(5)
        self._thread.join(5)


# ------------------------------------------------------------------ the watcher process


class _Watcher:
    def __init__(self, ens: EnsembleId, out: IO[str]) -> None:
        self.ens = ens
        self.out = out
        self.ino = Inotify()
        self.paths: dict[str, Path] = {}
        self.wds: dict[int, str] = {}
        self.last: dict[str, dict[int, str] | None] = {}

    def set_vms(self, paths: dict[str, str]) -> None:
        for wd in list(self.wds):
            self.ino.remove(wd)
        self.wds.clear()
        self.paths = {vm: Path(p) for vm, p in paths.items()}
        self.last = {vm: b for vm, b in self.last.items() if vm in paths}
        for vm, path in self.paths.items():
            wd = self.ino.add(str(path.parent),
                              IN_MODIFY | IN_CLOSE_WRITE | IN_MOVED_TO | IN_CREATE)
            self.wds[wd] = vm
        self.check(sorted(self.paths))

    def check(self, vms: list[str]) -> None:
        lines = []
        for vm in vms:
            path = self.paths.get(vm)
            if path is None:
                continue
            try:  # one descriptor: the mtime is the inode's whose bytes were read
                with open(path, "rb") as f:
                    data = f.read()
                    at = time.monotonic()
                    mtime = os.fstat(f.fileno()).st_mtime_ns / 1e9 - (time.time() - at)
            except OSError:
                continue
            block = read_block(data, self.ens)
            if block is None or block == self.last.get(vm):
                continue
            self.last[vm] = block
            lines.append(json.dumps({"vm": vm, "t": at, "w": mtime,
                                     "block": {str(k): v for k, v in block.items()}}))
        if lines:
            self.out.write("\n".join(lines) + "\n")
            self.out.flush()

    def events(self) -> set[str]:
        return {vm for wd, name in self.ino.events()
                if (vm := self.wds.get(wd)) is not None and name in (b"hosts", b"")}


def main(argv: list[str]) -> int:
    """Commands on stdin (``{"seq": N, "vms": {name: path}}``), reports on stdout;
    exits at the end of stdin."""
    try:
        os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(RT_PRIORITY))
        realtime = True
    except OSError:  # not root (or no RT budget): a plain process, and the parent knows
        realtime = False
    sys.stdout.write(json.dumps({"realtime": realtime}) + "\n")
    sys.stdout.flush()
    watcher = _Watcher(EnsembleId(argv[0], argv[1]), sys.stdout)
    stdin = sys.stdin.fileno()
    buf = b""
    last_sweep = time.monotonic()
    while True:
        ready, _, _ = select.select([watcher.ino.fd, stdin], [], [], 0.1)
        if stdin in ready:
            chunk = os.read(stdin, 65536)
            if not chunk:
                return 0
            buf += chunk
            while b"\n" in buf:
                line, buf = buf.split(b"\n", 1)
                cmd: dict[str, Any] = json.loads(line)
                try:
                    watcher.set_vms(cmd["vms"])
                    reply: dict[str, Any] = {"ack": cmd["seq"]}
                except OSError as exc:
                    reply = {"ack": cmd["seq"], "error": str(exc)}
                sys.stdout.write(json.dumps(reply) + "\n")
                sys.stdout.flush()
        vms = watcher.events() if watcher.ino.fd in ready else set()
        if time.monotonic() - last_sweep > SWEEP_S:
            vms = set(watcher.paths)
            last_sweep = time.monotonic()
        if vms:
            watcher.check(sorted(vms))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
