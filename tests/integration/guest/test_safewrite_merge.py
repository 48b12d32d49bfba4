"""``SharedFile.merge`` against other writers of the same file: an admin's appends and a
whole-file re-render (cloud-init's ``update_etc_hosts``), at the worst moments and
from a real concurrent process.

The worst moments are made exact by doing the other writer's write from inside the
merge (between our read and our write) or just before our replace (after our last
check). The concurrent process shows the same with real timing: a child appends
distinct lines while the applier rewrites the block back and forth, and every line
must be there after the re-assert the file watcher makes. Before ``SharedFile``, a
line appended between the read and the rename went away with the replaced inode (a
vmtest run lost one that way).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from guest_agent.config import settings_from_mapping
from guest_agent.files import safewrite
from guest_agent.files.apply import Applier
from guest_agent.files.safewrite import MERGE_ATTEMPTS, SharedFile
from imex_shared.hostsfile import merge_hosts, read_block
from imex_shared.model import EnsembleId

ENS = EnsembleId("gpu", "rack-a")
START = b"127.0.0.1\tlocalhost\n"
ADMIN = b"10.99.0.7\tforeign-db.example  # added by an admin\n"


def _block(pins: dict[int, str]):  # type: ignore[no-untyped-def]
    return lambda existing: merge_hosts(existing or b"", ENS, 4, pins)


def test_an_append_made_while_we_merge_is_merged_again(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(START)
    calls: list[bytes | None] = []

    def merge(existing: bytes | None) -> bytes:
        calls.append(existing)
        if len(calls) == 1:
            with open(target, "ab") as f:  # the admin, between our read and our write
                f.write(ADMIN)
        return _block({0: "10.0.0.1"})(existing)

    done = SharedFile(target).merge(merge)
    text = target.read_bytes()
    assert ADMIN in text and read_block(text, ENS) is not None
    assert done.written and done.attempts == 2 and done.data == text
    assert calls == [START, START + ADMIN]


def test_an_append_to_the_replaced_inode_after_our_check_is_carried_by_the_next_merge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The admin's file handle is on the inode we rename over (opened before our rename,
    written after it): the next merge, which our own write's inotify event brings,
    carries the line over."""
    target = tmp_path / "hosts"
    target.write_bytes(START)
    real_put = safewrite._put
    appended: list[int] = []

    def put_after_an_append(*args, **kw) -> None:  # type: ignore[no-untyped-def]
        if not appended:
            with open(target, "ab") as f:
                f.write(ADMIN)
            appended.append(os.stat(target).st_ino)
        real_put(*args, **kw)

    monkeypatch.setattr(safewrite, "_put", put_after_an_append)
    pins = {0: "10.0.0.1", 1: "10.0.0.2"}
    hosts = SharedFile(target)
    first = hosts.merge(_block(pins))
    assert first.written and ADMIN not in target.read_bytes()  # it went to the old inode
    second = hosts.merge(_block(pins))  # the re-assert after our own write's event
    # carried as an append to what is there now: after our block, as if made a moment later
    assert target.read_bytes() == first.data + ADMIN
    assert second.written and second.base == first.data + ADMIN and len(appended) == 1
    third = hosts.merge(_block(pins))
    assert not third.written, "a carried line is carried once"
    hosts.close()


def test_an_append_to_an_inode_replaced_several_merges_ago_is_still_carried(
    tmp_path: Path,
) -> None:
    """An admin's ``>>`` opened the file, then stalled (a slow disk, a stopped shell)
    while the agent replaced it twice, and writes only now: the inode it holds is two
    renames old. The agent keeps the last ``REPLACED_KEPT`` inodes it replaced, so the
    line still lands, once; an append to one older than that is beyond the bound."""
    target = tmp_path / "hosts"
    target.write_bytes(START)
    hosts = SharedFile(target)
    stalled = open(target, "ab")  # noqa: SIM115  (held across the merges on purpose)
    try:
        hosts.merge(_block({0: "10.0.0.1"}))
        hosts.merge(_block({0: "10.0.0.2"}))
        assert os.fstat(stalled.fileno()).st_nlink == 0  # two renames over it
        stalled.write(ADMIN)
        stalled.flush()
        carried = hosts.merge(_block({0: "10.0.0.2"}))
        text = target.read_bytes()
        assert carried.written and text.count(ADMIN) == 1
        assert read_block(text, ENS) == read_block(carried.data, ENS)
        assert not hosts.merge(_block({0: "10.0.0.2"})).written, "carried once"
    finally:
        stalled.close()
        hosts.close()


def test_the_replaced_inodes_held_are_bounded(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(START)
    hosts = SharedFile(target)
    before = len(os.listdir("/proc/self/fd"))
    for n in range(safewrite.REPLACED_KEPT + 5):
        hosts.merge(_block({0: f"10.0.0.{n + 1}"}))
    assert len(os.listdir("/proc/self/fd")) - before == safewrite.REPLACED_KEPT
    hosts.close()
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_whole_file_rerender_while_we_merge_wins_over_our_stale_read(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(START + b"10.1.1.1\told-line\n")
    rerendered = b"# rendered by cloud-init\n127.0.0.1\tlocalhost\n127.0.1.1\tvm-0\n"
    seen: list[bytes | None] = []

    def merge(existing: bytes | None) -> bytes:
        seen.append(existing)
        if len(seen) == 1:
            target.write_bytes(rerendered)  # truncate and write, as cloud-init does
        return _block({0: "10.0.0.1"})(existing)

    SharedFile(target).merge(merge)
    text = target.read_bytes()
    assert text.startswith(rerendered) and b"old-line" not in text
    assert read_block(text, ENS) is not None


def test_unchanged_content_is_not_written_and_a_missing_file_is_created(
    tmp_path: Path,
) -> None:
    target = tmp_path / "hosts"
    made = SharedFile(target).merge(_block({0: "10.0.0.1"}))
    assert made.written and made.base is None and target.read_bytes() == made.data
    assert (target.stat().st_mode & 0o777) == 0o644
    inode = target.stat().st_ino
    os.utime(target, (1, 1))
    again = SharedFile(target).merge(_block({0: "10.0.0.1"}))
    assert not again.written and again.attempts == 1 and again.base == made.data
    assert target.stat().st_ino == inode and target.stat().st_mtime == 1


def test_a_writer_racing_every_merge_still_gets_the_block_after_the_bound(tmp_path: Path) -> None:
    target = tmp_path / "hosts"
    target.write_bytes(START)
    calls = 0

    def merge(existing: bytes | None) -> bytes:
        nonlocal calls
        calls += 1
        with open(target, "ab") as f:
            f.write(b"10.2.0.%d\tbusy-%d\n" % (calls, calls))
        return _block({0: "10.0.0.1"})(existing)

    hosts = SharedFile(target)
    done = hosts.merge(merge)
    text = target.read_bytes()
    assert calls == MERGE_ATTEMPTS and done.attempts == MERGE_ATTEMPTS and done.written
    assert read_block(text, ENS) is not None
    kept = [i for i in range(1, calls + 1) if b"\tbusy-%d\n" % i in text]
    assert kept == list(range(1, MERGE_ATTEMPTS)), kept  # the last race's line: old inode
    hosts.merge(_block({0: "10.0.0.1"}))  # the writer stopped; the next merge carries it
    text = target.read_bytes()
    assert all(b"\tbusy-%d\n" % i in text for i in range(1, calls + 1)), text


APPENDER = textwrap.dedent(
    """
    import sys, time
    path, count = sys.argv[1], int(sys.argv[2])
    print("ready", flush=True)
    for i in range(count):
        with open(path, "ab") as f:
            f.write(b"10.3.%d.%d\\tadmin-%d.example\\n" % (i // 250, i % 250, i))
        time.sleep(0.005)
    """
)


def test_a_concurrent_appender_loses_no_line_while_the_applier_rewrites(
    tmp_path: Path,
) -> None:
    settings = settings_from_mapping({
        "ensemble": ENS.name, "namespace": ENS.namespace, "max_members": 4,
        "hosts_file": str(tmp_path / "hosts"),
        "nodes_config": str(tmp_path / "imex" / "nodes_config.cfg"),
        "imex_control": "none",
    })
    (tmp_path / "hosts").write_bytes(START)
    applier = Applier(settings)
    lines = 400
    child = subprocess.Popen([sys.executable, "-c", APPENDER, str(tmp_path / "hosts"),
                              str(lines)], stdout=subprocess.PIPE)
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        flips = 0
        while child.poll() is None and flips < 20_000:
            applier.apply({0: "10.0.0.1", 1: f"10.0.0.{2 + flips % 2}"})
            flips += 1
        assert child.wait(timeout=60) == 0
        applier.assert_files()  # what the file watcher does after our last write
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        assert child.stdout is not None
        child.stdout.close()
    text = (tmp_path / "hosts").read_bytes()
    missing = [i for i in range(lines) if b"\tadmin-%d.example\n" % i not in text]
    assert flips > 20, f"the applier rewrote only {flips} times during the appends"
    assert missing == [], f"{len(missing)} appended lines lost, first {missing[:5]}"
    assert read_block(text, ENS) is not None
