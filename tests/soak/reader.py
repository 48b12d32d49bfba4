"""A reader of one VM's two managed files, as IMEX and glibc read them: invariant 2.

``python -m tests.soak.reader --hosts PATH --nodes PATH --namespace NS --name NAME
--max-members N --boot-file PATH --out FILE.jsonl``

It reads both files whenever inotify says either changed (the hosts file is written in
place, so its own inode is watched; the nodes file is replaced by rename, so its
directory is) and every ``--interval`` seconds besides, and judges each read with
:mod:`tests.soak.files`. It appends JSON lines to ``--out``:

- ``{"t", "file", "torn": why, "sample"}`` for every read that does not parse;
- ``{"t", "file": "hosts", "mtime", "block"}`` whenever the hosts block's pins change
  (``mtime``: the file's, taken before the read, so never later than the write it
  shows), which invariant 3 times the agent's SIGUSR1s against;
- ``{"t", "reads"}`` every 10 s, so a reader that stopped reading is noticed.

The boot file is rewritten by the soak just before it boots the VM (the sandbox then
writes the image's empty nodes file); an empty nodes file read after it changed, and
before the agent's first whole one, is no violation. It is read after each nodes read,
so a boot between the two is seen, and before it too: only a whole file read with no
announcement around it ends the boot's allowance. Exits on SIGTERM; stdlib and imex_shared only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import sys
import time
from pathlib import Path

from imex_shared.model import EnsembleId
from tests.inotify import IN_ATTRIB, IN_CLOSE_WRITE, IN_CREATE, IN_MODIFY, IN_MOVED_TO, Inotify
from tests.soak.files import check_hosts, check_nodes


def _read(path: Path) -> tuple[bytes | None, float]:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None, 0.0
    try:
        mtime = os.fstat(fd).st_mtime
        chunks = []
        while True:
            b = os.read(fd, 65536)
            if not b:
                break
            chunks.append(b)
        return b"".join(chunks), mtime
    finally:
        os.close(fd)


def _marker(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.soak.reader")
    p.add_argument("--hosts", type=Path, required=True)
    p.add_argument("--nodes", type=Path, required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--name", required=True)
    p.add_argument("--max-members", type=int, required=True)
    p.add_argument("--boot-file", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--interval", type=float, default=0.25)
    a = p.parse_args(argv)
    ens = EnsembleId(a.namespace, a.name)
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    out = open(a.out, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 (lives as long as we do)

    def emit(doc: dict[str, object]) -> None:
        out.write(json.dumps(doc, separators=(",", ":")) + "\n")

    ino = Inotify()
    watched: set[str] = set()

    def watch(path: str, mask: int) -> None:
        # again on every turn until it takes: the file may not exist yet
        if path not in watched:
            with contextlib.suppress(OSError):
                ino.add(path, mask)
                watched.add(path)

    marker = _marker(a.boot_file)
    booting = True
    last_block: dict[int, str] | None = None
    reads = 0
    next_beat = time.monotonic() + 10
    while not stop:
        watch(str(a.hosts), IN_MODIFY | IN_CLOSE_WRITE | IN_ATTRIB)
        watch(str(a.nodes.parent), IN_MOVED_TO | IN_CLOSE_WRITE | IN_CREATE | IN_MODIFY)
        hosts, mtime = _read(a.hosts)
        now = time.time()
        if hosts is not None:
            reads += 1
            verdict = check_hosts(hosts, ens, a.max_members)
            if not verdict.ok:
                emit({"t": now, "file": "hosts", "torn": verdict.why,
                      "sample": hosts[:2000].decode(errors="replace")})
            elif verdict.block is not None and verdict.block != last_block:
                last_block = verdict.block
                emit({"t": now, "file": "hosts", "mtime": mtime, "block": verdict.block})
        before = _marker(a.boot_file)
        nodes, nodes_mtime = _read(a.nodes)
        if nodes is not None:
            reads += 1
            after = _marker(a.boot_file)
            if after != marker:
                marker, booting = after, True
            why = check_nodes(nodes, ens, a.max_members, booting)
            if why:
                emit({"t": time.time(), "file": "nodes", "torn": why,
                      "sample": nodes[:2000].decode(errors="replace")})
            elif nodes and before == after and nodes_mtime >= _mtime(a.boot_file):
                # a whole file written after the boot was announced: the new agent's. The
                # old VM's file can still be read after the announcement, before the boot
                # writes the image's empty one (CI, seed 1: that read ended the allowance)
                booting = False
        if time.monotonic() >= next_beat:
            emit({"t": time.time(), "reads": reads})
            next_beat += 10
        ino.wait(a.interval)
    out.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())

