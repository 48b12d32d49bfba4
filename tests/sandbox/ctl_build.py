"""Builds the sandbox's native stand-ins with the system's gcc, once per source change.

* ``nvidia-imex-ctl`` (``imex_ctl.c``). Why a native binary (issue 27): the guest agent
  execs ``nvidia-imex-ctl`` for every query, as it does the real one; the stand-in must
  cost what a small native program costs, not an interpreter's start (imex_ctl.c says
  more). ``tests/sandbox/bin/nvidia-imex-ctl`` builds it on first use and execs it; the
  sandbox points each guest's ``imex_ctl`` straight at the binary.
* ``nvidia-imex`` (``imex_standin.c``, :func:`standin_daemon`): the IMEX daemon stand-in
  in C, the same daemon as ``imex_standin.py`` for plain TCP. Why: benchmarks run 18
  stand-ins on 2 cores, and the Python daemon's interpreter start (~90 CPU-ms on every
  restart) and per-SIGUSR1 work dwarfed what the real C++ daemon costs.
  ``tests/sandbox/bin/nvidia-imex`` runs it when ``IMEX_STANDIN_IMPL=c``, building it
  first when it is missing or older than its source. Linked dynamically: its resolver
  (getaddrinfo, getaddrinfo_a) needs glibc's NSS modules.

The binaries live in ``tests/sandbox/bin/.build/`` (ignored by git), each built again
whenever its source is newer, and replaced atomically.

The VM images carry the ctl, built for the guest's architecture by :func:`guest_ctl`
(static, so a guest's glibc never has to match the builder's; arm64 with Debian's
``gcc-aarch64-linux-gnu``). Until they did, they carried the Python copy
(``imex_ctl.py``), whose interpreter start cost an idle TCG guest most of its CPU
(tests/vm/README.md, "Where an idle guest's CPU goes").

``python -m tests.sandbox.ctl_build [ARCH...]`` builds both for the host (and the ctl for
each Debian architecture named) and prints the paths.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("imex_ctl.c")
BINARY = Path(__file__).parent / "bin" / ".build" / "nvidia-imex-ctl"
DAEMON_SOURCE = Path(__file__).with_name("imex_standin.c")
DAEMON_BINARY = BINARY.with_name("nvidia-imex")
#: Debian architecture -> (GNU triplet, package that brings its compiler and static libc)
CROSS = {"amd64": ("x86_64-linux-gnu", "gcc-x86-64-linux-gnu libc6-dev-amd64-cross"),
         "arm64": ("aarch64-linux-gnu", "gcc-aarch64-linux-gnu libc6-dev-arm64-cross")}
#: platform.machine() -> Debian architecture, for the host's own compiler
HOST_ARCH = {"x86_64": "amd64", "aarch64": "arm64"}


class CtlBuildError(RuntimeError):
    """The stand-in could not be built (the message says what is missing)."""


def _build(out: Path, cc: str, variants: tuple[list[str], ...], what: str,
           source: Path = SOURCE) -> Path:
    """``out`` compiled from ``source`` with the first flag variant that links, once per
    change."""
    if out.exists() and out.stat().st_mtime_ns > source.stat().st_mtime_ns:
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.{os.getpid()}")
    errors = ""
    for extra in variants:
        # the flags before the source, the libraries (a variant's -l...) after it
        flags = [f for f in extra if not f.startswith("-l")]
        libs = [f for f in extra if f.startswith("-l")]
        done = subprocess.run([cc, "-O2", "-Wall", *flags, "-o", str(tmp), str(source), *libs],
                              capture_output=True, text=True, check=False)
        if done.returncode == 0:
            os.replace(tmp, out)  # atomic: a concurrent build never leaves half a file
            return out
        errors = done.stderr
    tmp.unlink(missing_ok=True)
    raise CtlBuildError(f"building {source} {what} with {cc} failed: {errors.strip()[-2000:]}")


def _host_gcc(what: str) -> str:
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise CtlBuildError(f"no C compiler: {what} needs gcc (Debian: apt-get install gcc "
                            "libc6-dev)")
    return gcc


def standin_ctl() -> Path:
    """The built stand-in, built first when missing or older than its source."""
    if BINARY.exists() and BINARY.stat().st_mtime_ns > SOURCE.stat().st_mtime_ns:
        return BINARY
    gcc = _host_gcc("the nvidia-imex-ctl stand-in (tests/sandbox/imex_ctl.c)")
    return _build(BINARY, gcc, (["-static"], []), "for this host")  # static when libc.a is there


def standin_daemon() -> Path:
    """The C IMEX daemon stand-in (``bin/.build/nvidia-imex``), built first when missing or
    older than its source. Dynamic: getaddrinfo needs NSS; ``-lanl`` only where glibc (before
    2.34) keeps getaddrinfo_a outside libc."""
    if DAEMON_BINARY.exists() and \
            DAEMON_BINARY.stat().st_mtime_ns > DAEMON_SOURCE.stat().st_mtime_ns:
        return DAEMON_BINARY
    gcc = _host_gcc("the nvidia-imex stand-in (tests/sandbox/imex_standin.c)")
    return _build(DAEMON_BINARY, gcc, (["-Wextra"], ["-Wextra", "-lanl"]), "for this host",
                  source=DAEMON_SOURCE)


def _compiler(arch: str) -> str:
    """The compiler that targets ``arch``: the host's own, or Debian's cross gcc."""
    if arch not in CROSS:
        raise CtlBuildError(f"no known compiler for architecture {arch!r} "
                            f"(known: {', '.join(sorted(CROSS))})")
    triplet, packages = CROSS[arch]
    if HOST_ARCH.get(platform.machine()) == arch:
        names = ["gcc", "cc", f"{triplet}-gcc"]
    else:
        names = [f"{triplet}-gcc"]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise CtlBuildError(f"no C compiler for {arch}: the guest image's nvidia-imex-ctl "
                        f"stand-in needs {names[0]} (Debian: apt-get install {packages})")


def guest_ctl(arch: str) -> bytes:
    """The stand-in as a static ``arch`` binary, built once per source change.

    Static because the guest's glibc may be older than the builder's (a Debian 13 host
    building for a Debian 12 guest); the program asks only numeric addresses, so the
    static getaddrinfo never loads the guest's NSS modules.
    """
    out = BINARY.with_name(f"nvidia-imex-ctl-{arch}")
    if not (out.exists() and out.stat().st_mtime_ns > SOURCE.stat().st_mtime_ns):
        _build(out, _compiler(arch), (["-static"],), f"for {arch} (-static)")
    return out.read_bytes()


if __name__ == "__main__":
    try:
        print(standin_ctl())
        print(standin_daemon())
        for a in sys.argv[1:]:
            guest_ctl(a)
            print(BINARY.with_name(f"nvidia-imex-ctl-{a}"))
    except CtlBuildError as exc:
        print(f"ctl_build: {exc}", file=sys.stderr)
        sys.exit(1)
