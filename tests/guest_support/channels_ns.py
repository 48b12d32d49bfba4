"""Runs IMEX channel passes inside a private mount namespace (root only), for the tests.

Started as ``unshare -m --propagation private python -m tests.guest_support.channels_ns``
with a JSON list of steps on stdin. It mounts a fresh tmpfs on ``/dev`` (so
``/dev/nvidia-caps-imex-channels`` starts missing and nothing reaches the host's /dev;
``/dev/null`` is made again) and bind-mounts a file of its own over ``/proc/devices``,
which each step rewrites in place (same inode, so the bind mount shows the new text).
Then it runs the product's own pass, ``channels_io.keep_channels`` with its fixed paths:
the product has no test-only setting. Everything dies with the namespace.

A step: ``{"devices": TEXT | null (keep), "prepare": [[op, name, ...]], "channels": [..],
"mode": "0666", "group": null, "cli": [argv] | null}``; ops: ``rm``, ``file``,
``symlink``, ``dir``, ``blk MAJOR MINOR``, ``chr MAJOR MINOR``. A step with ``cli`` runs
that command (the agent's console script) instead of a pass. The answer, one JSON line:
per step the pass's state and a listing of the directory (name -> kind, major, minor,
mode).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
import tempfile
from typing import Any

from guest_agent.imex.channels import CHANNEL_DIR, PROC_DEVICES
from guest_agent.imex.channels_io import keep_channels


def listing() -> dict[str, Any]:
    out: dict[str, Any] = {}
    if not os.path.isdir(CHANNEL_DIR):
        return {"<dir>": "missing" if not os.path.lexists(CHANNEL_DIR) else "not a dir"}
    for name in sorted(os.listdir(CHANNEL_DIR)):
        st = os.lstat(f"{CHANNEL_DIR}/{name}")
        kind = ("chr" if stat.S_ISCHR(st.st_mode) else "blk" if stat.S_ISBLK(st.st_mode)
                else "symlink" if stat.S_ISLNK(st.st_mode) else "dir"
                if stat.S_ISDIR(st.st_mode) else "reg")
        out[name] = {"kind": kind, "major": os.major(st.st_rdev), "minor": os.minor(st.st_rdev),
                     "mode": f"{stat.S_IMODE(st.st_mode):04o}", "ino": st.st_ino,
                     "gid": st.st_gid}
    return out


def prepare(ops: list[list[Any]]) -> None:
    for op, name, *args in ops:
        path = f"{CHANNEL_DIR}/{name}" if not name.startswith("/") else name
        if op == "rm":
            if os.path.isdir(path) and not os.path.islink(path):
                os.rmdir(path)
            elif os.path.lexists(path):
                os.unlink(path)
        elif op == "mkdir":
            os.makedirs(path, exist_ok=True)
        elif op == "file":
            with open(path, "w") as f:
                f.write("not a device\n")
        elif op == "symlink":
            os.symlink("/dev/null", path)
        elif op == "dir":
            os.mkdir(path)
        elif op in ("chr", "blk"):
            kind = stat.S_IFCHR if op == "chr" else stat.S_IFBLK
            os.mknod(path, kind | 0o600, os.makedev(int(args[0]), int(args[1])))
        else:
            raise SystemExit(f"unknown op {op!r}")


def main() -> int:
    steps = json.load(sys.stdin)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0755", "tmpfs", "/dev"], check=True)
    os.mknod("/dev/null", stat.S_IFCHR | 0o666, os.makedev(1, 3))
    os.chmod("/dev/null", 0o666)
    fd, fake = tempfile.mkstemp(prefix="proc-devices-")
    os.close(fd)
    subprocess.run(["mount", "--bind", fake, PROC_DEVICES], check=True)
    results = []
    for step in steps:
        if step.get("devices") is not None:
            with open(fake, "r+") as f:  # in place: the bind mount shows the same inode
                f.truncate(0)
                f.write(step["devices"])
        prepare(step.get("prepare") or [])
        if step.get("cli"):
            proc = subprocess.run(step["cli"], capture_output=True, text=True, timeout=60,
                                  stdin=subprocess.DEVNULL)
            results.append({"rc": proc.returncode, "stdout": proc.stdout,
                            "stderr": proc.stderr[-4000:], "listing": listing()})
            continue
        mode = int(step.get("mode", "0666"), 8)
        state = keep_channels(step["channels"], mode, step.get("group"),
                              act=step.get("act", True))
        results.append({"present": state.present, "waiting": state.waiting,
                        "errors": state.errors, "changed": state.changed,
                        "major": state.major, "listing": listing()})
    os.unlink(fake)
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
