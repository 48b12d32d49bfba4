"""The convergence benchmarks' watcher, on real files with its real watcher process: it
reports when the last VM's hosts file held a pin, on the reader's clock, however late
the benchmark's own threads get to look (tests.bench.hostswatch)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from imex_shared.hostsfile import merge_hosts
from imex_shared.model import EnsembleId
from tests.bench.hostswatch import HostsWatch

ENS = EnsembleId("bench", "gb200")
BASE = b"127.0.0.1 localhost\n"


def write_in_place(path: Path, pins: dict[int, str]) -> None:
    """As the guest agent writes a bind-mounted /etc/hosts: same inode, new bytes."""
    data = merge_hosts(BASE, ENS, 4, pins)
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
    finally:
        os.close(fd)


@pytest.fixture
def vms(tmp_path: Path) -> dict[str, Path]:
    paths = {}
    for name in ("vm-0", "vm-1", "vm-2"):
        d = tmp_path / name
        d.mkdir()
        paths[name] = d / "hosts"
        paths[name].write_bytes(merge_hosts(BASE, ENS, 4, {0: "10.0.0.1", 1: "10.0.0.2"}))
    return paths


@pytest.fixture
def watch(vms: dict[str, Path]) -> Iterator[HostsWatch]:
    w = HostsWatch(ENS)
    try:
        w.set_vms(vms)
        yield w
    finally:
        w.close()
    assert w._proc.returncode == 0  # the watcher exits at the end of stdin


def test_done_only_when_every_vm_holds_the_pin_and_timed_by_the_last_read(
        vms: dict[str, Path], watch: HostsWatch) -> None:
    started = time.monotonic()
    pending = watch.expect(1, "10.0.0.9", started)
    assert watch.realtime is (os.geteuid() == 0)  # SCHED_FIFO needs root
    write_in_place(vms["vm-0"], {0: "10.0.0.1", 1: "10.0.0.9"})
    write_in_place(vms["vm-1"], {0: "10.0.0.1", 1: "10.0.0.9"})
    assert not pending.done.wait(1.0)
    assert pending.waiting == {"vm-2"}
    before_last = time.monotonic()
    write_in_place(vms["vm-2"], {0: "10.0.0.1", 1: "10.0.0.9"})
    assert pending.done.wait(10)
    assert before_last <= pending.finished <= time.monotonic()
    # the mtime of the last write is on the same clock, never after the read
    assert started - 0.05 <= pending.written <= pending.finished


def test_a_busy_benchmark_thread_does_not_delay_the_time_recorded(
        vms: dict[str, Path], watch: HostsWatch) -> None:
    """The time is the watcher process's read: the parent, whose threads include the API
    double and the DNS stand-in, reading it late does not move it."""
    pending = watch.expect(0, "10.0.0.7", time.monotonic())
    hog_until = threading.Event()
    with watch._lock:  # the parent cannot look at any report meanwhile
        began = time.monotonic()
        for path in vms.values():
            write_in_place(path, {0: "10.0.0.7", 1: "10.0.0.2"})
        hog_until.wait(3.0)  # the watcher's inotify read takes milliseconds of this
        released = time.monotonic()
    assert pending.done.wait(10)
    assert began <= pending.finished < released  # read while the parent was blocked


def test_a_vm_already_holding_the_pin_counts_and_a_rename_is_seen(
        vms: dict[str, Path], watch: HostsWatch) -> None:
    pending = watch.expect(0, "10.0.0.1", time.monotonic())  # all three already hold it
    assert pending.done.is_set() and not pending.waiting
    pending = watch.expect(0, "10.0.0.4", time.monotonic())
    for name, path in vms.items():
        tmp = path.with_name("hosts.new")
        tmp.write_bytes(merge_hosts(BASE, ENS, 4, {0: "10.0.0.4"}))
        os.replace(tmp, path)  # IN_MOVED_TO, as a guest whose hosts file is its own
        if name != "vm-2":
            assert not pending.done.is_set()
    assert pending.done.wait(10)


def test_set_vms_narrows_what_is_waited_for(vms: dict[str, Path], watch: HostsWatch) -> None:
    watch.set_vms({k: v for k, v in vms.items() if k != "vm-2"})
    pending = watch.expect(1, "10.0.0.5", time.monotonic())
    assert pending.waiting == {"vm-0", "vm-1"}
    for name in ("vm-0", "vm-1"):
        write_in_place(vms[name], {1: "10.0.0.5"})
    assert pending.done.wait(10)


def test_a_vm_directory_that_does_not_exist_is_an_error_naming_it(
        vms: dict[str, Path], watch: HostsWatch, tmp_path: Path) -> None:
    with pytest.raises(OSError, match=r"inotify_add_watch .*/gone"):
        watch.set_vms({**vms, "vm-9": tmp_path / "gone" / "hosts"})
