"""A small client for the QEMU guest agent (qemu-ga) over its virtio-serial chardev socket.

TEST HARNESS. The harness reads guest files and runs commands in the guest through
qemu-ga, the channel KubeVirt itself uses for guest information, so the image needs no SSH
and the checks do not depend on the guest network the test is breaking.

Protocol: one JSON command per line, one JSON reply per line. The socket may hold stale
replies of an earlier client (a timed-out command answers later), so each connection
starts with ``guest-sync`` and a random id and reads until that id comes back. One command
at a time per VM (the chardev accepts one client); callers serialize.
"""

from __future__ import annotations

import base64
import json
import random
import socket
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class QgaError(Exception):
    """The guest agent did not answer, or answered with an error."""


@dataclass(frozen=True)
class ExecResult:
    exitcode: int
    out: str
    err: str


class Qga:
    def __init__(self, path: Path) -> None:
        self.path = path

    def _connect(self, timeout: float) -> tuple[socket.socket, Any]:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(str(self.path))
            f = s.makefile("rb")
            sync_id = random.randrange(1, 2**31)
            s.sendall(json.dumps({"execute": "guest-sync", "arguments": {"id": sync_id}})
                      .encode() + b"\n")
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                line = f.readline()
                if not line:
                    raise QgaError("qemu-ga socket closed during guest-sync")
                try:
                    msg = json.loads(line.lstrip(b"\xff"))
                except ValueError:
                    continue
                if isinstance(msg, dict) and msg.get("return") == sync_id:
                    return s, f
            raise QgaError("no guest-sync answer")
        except (OSError, QgaError) as e:
            s.close()
            raise QgaError(f"qemu-ga at {self.path}: {e}") from e

    def call(self, command: str, arguments: dict[str, Any] | None = None,
             timeout: float = 10.0) -> Any:
        s, f = self._connect(timeout)
        try:
            req: dict[str, Any] = {"execute": command}
            if arguments is not None:
                req["arguments"] = arguments
            s.sendall(json.dumps(req).encode() + b"\n")
            line = f.readline()
        except OSError as e:
            raise QgaError(f"qemu-ga {command}: {e}") from e
        finally:
            f.close()
            s.close()
        if not line:
            raise QgaError(f"qemu-ga {command}: connection closed")
        msg = json.loads(line)
        if "error" in msg:
            raise QgaError(f"qemu-ga {command}: {msg['error']}")
        return msg.get("return")

    def ping(self, timeout: float = 3.0) -> bool:
        try:
            self.call("guest-ping", timeout=timeout)
            return True
        except (QgaError, ValueError):
            return False

    def exec(self, argv: list[str], timeout: float = 30.0,
             input_data: bytes | None = None) -> ExecResult:
        """Run ``argv`` in the guest (no shell) and wait for it; output decoded as UTF-8."""
        args: dict[str, Any] = {"path": argv[0], "arg": argv[1:], "capture-output": True}
        if input_data is not None:
            args["input-data"] = base64.b64encode(input_data).decode()
        pid = self.call("guest-exec", args)["pid"]
        deadline = time.monotonic() + timeout
        while True:
            st = self.call("guest-exec-status", {"pid": pid})
            if st.get("exited"):
                out = base64.b64decode(st.get("out-data", "")).decode(errors="replace")
                err = base64.b64decode(st.get("err-data", "")).decode(errors="replace")
                return ExecResult(int(st.get("exitcode", -1)), out, err)
            if time.monotonic() > deadline:
                raise QgaError(f"{' '.join(argv)}: still running after {timeout:.0f}s")
            time.sleep(0.2)

    def sh(self, script: str, timeout: float = 30.0) -> ExecResult:
        return self.exec(["/bin/sh", "-c", script], timeout)

    def read_file(self, path: str, timeout: float = 10.0) -> bytes:
        r = self.exec(["/bin/cat", path], timeout)
        if r.exitcode != 0:
            raise QgaError(f"cat {path}: {r.err.strip() or r.exitcode}")
        return r.out.encode()
