"""Fixtures for the real-guest tier (``make vmtest``; marker ``vm``).

Settings come from the environment so CI and a developer can size the run without editing
code: ``IMEX_VM_COUNT`` (members booted, default 3; CI may use 2), ``IMEX_VM_MEMORY``
(MiB per guest, default 640), ``IMEX_VM_GUESTS`` (which guests tests/vm/test_matrix.py
boots, default all), ``IMEX_VM_BOOT_TIMEOUT`` (seconds from qemu start to the
agent running, default 2400: TCG on 2 cores shared with other jobs took 15+ minutes),
``IMEX_VM_KEEP=1`` (keep the work directory even when the run
passes). Each run's work directory is ``tests/vm/artifacts/<test>-<time>`` (gitignored): on
failure it stays, with serial logs, the guests' status files, journals and the host side's
logs; disks are dropped (they are large and rebuilt from the cache).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from tests.vm.harness import HarnessSettings

ARTIFACTS = Path(__file__).resolve().parent / "artifacts"


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name, "")
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise pytest.UsageError(f"{name}={raw!r}: expected a positive integer")
    return int(raw)


@pytest.fixture
def vm_settings(request: pytest.FixtureRequest) -> HarnessSettings:
    if os.geteuid() != 0:
        pytest.skip("needs root: network namespace, tap devices, dnsmasq")
    name = request.node.name.replace("[", "-").replace("]", "")
    workdir = ARTIFACTS / f"{name}-{time.strftime('%Y%m%d-%H%M%S')}"
    return HarnessSettings(
        vms=_env_int("IMEX_VM_COUNT", 3),
        memory_mb=_env_int("IMEX_VM_MEMORY", 640),
        boot_timeout=float(_env_int("IMEX_VM_BOOT_TIMEOUT", 2400)),
        workdir=workdir,
        keep_artifacts=os.environ.get("IMEX_VM_KEEP") == "1",
    )


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    from tests.vm.verdicts import MATRIX_LINES

    if MATRIX_LINES:
        terminalreporter.write_sep("-", "vm-matrix")
        for line in MATRIX_LINES:
            terminalreporter.write_line(line)
