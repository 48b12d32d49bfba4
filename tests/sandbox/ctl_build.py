"""Builds the ``nvidia-imex-ctl`` stand-in (``imex_ctl.c``) with the system's gcc, once.

Why a native binary (issue 27): the guest agent execs ``nvidia-imex-ctl`` for every
query, as it does the real one; the stand-in must cost what a small native program
costs, not an interpreter's start (imex_ctl.c says more). The binary lives in
``tests/sandbox/bin/.build/`` (ignored by git) and is built again whenever the source
is newer; ``tests/sandbox/bin/nvidia-imex-ctl`` builds it on first use and execs it.
The sandbox points each guest's ``imex_ctl`` straight at the binary.

``python -m tests.sandbox.ctl_build`` builds it and prints its path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("imex_ctl.c")
BINARY = Path(__file__).parent / "bin" / ".build" / "nvidia-imex-ctl"


class CtlBuildError(RuntimeError):
    """The stand-in could not be built (the message says what is missing)."""


def standin_ctl() -> Path:
    """The built stand-in, built first when missing or older than its source."""
    if BINARY.exists() and BINARY.stat().st_mtime_ns > SOURCE.stat().st_mtime_ns:
        return BINARY
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise CtlBuildError("no C compiler: the nvidia-imex-ctl stand-in (tests/sandbox/"
                            "imex_ctl.c) needs gcc (Debian: apt-get install gcc libc6-dev)")
    BINARY.parent.mkdir(parents=True, exist_ok=True)
    tmp = BINARY.with_name(f".{BINARY.name}.{os.getpid()}")
    errors = ""
    for extra in (["-static"], []):  # static when libc's archive is there
        done = subprocess.run([gcc, "-O2", "-Wall", *extra, "-o", str(tmp), str(SOURCE)],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            os.replace(tmp, BINARY)  # atomic: a concurrent build never leaves half a file
            return BINARY
        errors = done.stderr
    raise CtlBuildError(f"building {SOURCE} with {gcc} failed: {errors.strip()[-2000:]}")


if __name__ == "__main__":
    try:
        print(standin_ctl())
    except CtlBuildError as exc:
        print(f"ctl_build: {exc}", file=sys.stderr)
        sys.exit(1)
