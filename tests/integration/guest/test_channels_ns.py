"""IMEX channel nodes, for real: ``mknod`` as root in a private mount namespace.

Each test hands a list of steps to tests/guest_support/channels_ns.py, which runs under
``unshare -m`` with a tmpfs on /dev and a fake /proc/devices bind-mounted over the real
one, and runs the product's own pass (``channels_io.keep_channels``) against the fixed
paths. Covered: creation (with the directory), a wrong existing node, a regular file, a
symlink, a directory, a block device, a missing major then the major appearing, the
major changing (a driver reload), a channel list change, mode and group, bad
/proc/devices text, and ``once`` making the node.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[3]
pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="needs root and unshare (mknod in a mount namespace)")


def devices(major: int | None, extra: str = "") -> str:
    lines = ["Character devices:", "  1 mem", "  4 /dev/vc/0", "195 nvidia"]
    if major is not None:
        lines.append(f"{major} nvidia-caps-imex-channels")
    lines += [extra] if extra else []
    return "\n".join(lines) + "\n\nBlock devices:\n  7 loop\n  8 sd\n"


def run(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    proc = subprocess.run(
        ["unshare", "-m", "--propagation", "private", sys.executable, "-m",
         "tests.guest_support.channels_ns"],
        input=json.dumps(steps), capture_output=True, text=True, timeout=120, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    out: list[dict[str, Any]] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def test_creates_the_directory_and_the_node() -> None:
    [r] = run([{"devices": devices(234), "channels": [0]}])
    assert r["present"] == [0] and r["errors"] == [] and r["waiting"] is None
    node = r["listing"]["channel0"]
    assert (node["kind"], node["major"], node["minor"], node["mode"]) == ("chr", 234, 0, "0666")
    assert r["changed"] == ["created channel0 (234:0, mode 0666)"]


def test_a_correct_node_is_never_touched() -> None:
    first, second = run([{"devices": devices(234), "channels": [0]},
                         {"channels": [0]}])
    assert second["changed"] == [] and second["present"] == [0]
    assert second["listing"]["channel0"]["ino"] == first["listing"]["channel0"]["ino"]


def test_a_wrong_node_is_replaced_through_a_temporary_name() -> None:
    [r] = run([{"devices": devices(234), "prepare": [["mkdir", "/dev/nvidia-caps-imex-channels"],
                                                     ["chr", "channel0", 100, 7]],
                "channels": [0]}])
    assert r["present"] == [0]
    assert r["changed"] == ["replaced channel0 (device 100:7, want 234:0)"]
    assert set(r["listing"]) == {"channel0"}  # no temporary file left
    assert (r["listing"]["channel0"]["major"], r["listing"]["channel0"]["minor"]) == (234, 0)


@pytest.mark.parametrize(("op", "what"), [("file", "a regular file"), ("symlink", "a symlink"),
                                          ("dir", "a directory"),
                                          ("blk", "a block device")])
def test_anything_but_a_character_device_is_refused_and_left_alone(op: str, what: str) -> None:
    args = [8, 0] if op == "blk" else []
    [r] = run([{"devices": devices(234), "prepare": [["mkdir", "/dev/nvidia-caps-imex-channels"],
                                                     [op, "channel0", *args]],
                "channels": [0, 1]}])
    assert r["present"] == [1]
    [error] = r["errors"]
    assert "/dev/nvidia-caps-imex-channels/channel0" in error and what in error
    assert r["listing"]["channel0"]["kind"] == {"file": "reg"}.get(op, op)


def test_waits_for_the_major_then_creates() -> None:
    waiting, ready = run([{"devices": devices(None), "channels": [0]},
                          {"devices": devices(511), "channels": [0]}])
    assert waiting["present"] == [] and waiting["errors"] == []
    assert "has not registered nvidia-caps-imex-channels" in waiting["waiting"]
    assert waiting["listing"] == {"<dir>": "missing"}  # nothing made while waiting
    assert ready["present"] == [0] and ready["listing"]["channel0"]["major"] == 511


def test_a_driver_reload_with_a_new_major_replaces_every_node() -> None:
    before, after = run([{"devices": devices(234), "channels": [0, 5]},
                         {"devices": devices(240), "channels": [0, 5]}])
    assert before["present"] == [0, 5] and after["present"] == [0, 5]
    assert [(n["major"], n["minor"]) for n in after["listing"].values()] == [(240, 0),
                                                                             (240, 5)]
    assert len(after["changed"]) == 2 and all(c.startswith("replaced") for c in after["changed"])


def test_a_channel_list_change_adds_the_new_channel() -> None:
    one, two = run([{"devices": devices(234), "channels": [0]},
                    {"channels": [0, 3]}])
    assert one["present"] == [0] and two["present"] == [0, 3]
    assert two["changed"] == ["created channel3 (234:3, mode 0666)"]


def test_mode_and_group_are_set_in_place() -> None:
    made, narrowed = run([{"devices": devices(234), "channels": [0]},
                          {"channels": [0], "mode": "0660", "group": "daemon"}])
    node = narrowed["listing"]["channel0"]
    assert node["ino"] == made["listing"]["channel0"]["ino"]
    assert node["mode"] == "0660" and node["gid"] == 1  # Debian's daemon group
    [change] = narrowed["changed"]
    assert change.startswith("set channel0's mode 0666, want 0660")


@pytest.mark.parametrize(("text", "says"), [
    ("garbage\x01\x02 no header", 'no "Character devices:" line'),
    (devices(234, "235 nvidia-caps-imex-channels"), "lists nvidia-caps-imex-channels 2 times"),
    ("Character devices:\n" + "  9 x" * 20000, "over 65536 bytes"),
    ("Character devices:\n234 nvidia-caps-imex-channels\nnot a line\n", "line 3"),
])
def test_bad_proc_devices_makes_no_node(text: str, says: str) -> None:
    [r] = run([{"devices": text, "channels": [0]}])
    assert r["present"] == [] and r["listing"] == {"<dir>": "missing"}
    assert len(r["errors"]) == 1 and says in r["errors"][0]


def test_preflight_look_changes_nothing() -> None:
    [r] = run([{"devices": devices(234), "channels": [0], "act": False}])
    assert r["present"] == [] and r["listing"] == {"<dir>": "missing"}


def test_once_makes_the_node_even_when_it_learns_nothing(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text('ensemble = "e"\nnamespace = "ns"\nimex_channels = [0, 2]\n'
                      'nameservers = ["127.0.0.1:9"]\ndns_timeout = 0.2\n'
                      f'nodes_config = "{tmp_path}/nodes"\nhosts_file = "{tmp_path}/hosts"\n'
                      f'status_file = "{tmp_path}/status.json"\n')
    agent = str(Path(sys.executable).with_name("imex-guest-agent"))
    [r] = run([{"devices": devices(234), "cli": [agent, "--config", str(config), "once"]}])
    assert r["rc"] == 3, r["stderr"]  # nothing learned: files left alone, channels made
    assert "imex channels: present: 0, 2 of 0, 2" in r["stdout"]
    assert sorted(r["listing"]) == ["channel0", "channel2"]
