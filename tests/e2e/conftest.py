"""The e2e sandbox: one 18-VM ensemble shared by the whole session (2 cores in CI).

Bringing 18 namespace VMs up costs most of the budget, so the session builds one
:class:`~tests.sandbox.ensemble.Sandbox` (prefix ``e2e``) with the ensemble ``rack-a/gb200``
and every test starts by waiting until it has converged again (each test leaves it whole;
a member a failed test left crashed is replaced first, by :meth:`Rack.make_whole`, so the
failure shows in that test, not in the next one). Teardown runs however the
session ends, then checks that no ``e2e-<tag>-*`` namespace and no child process is left.

Convergence times are collected in :data:`TIMINGS` and printed in the terminal summary.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.sandbox.ensemble import EnsembleSpec, Sandbox, SandboxSettings, Vm, wait_for
from tests.sandbox.netns import list_netns
from tests.sandbox.virt_controller import Pool, VirtController

VMS = 18
TIMINGS: dict[str, float] = {}


@dataclass
class Rack:
    """The shared sandbox, its controller, and ensemble A with its pool."""

    sbx: Sandbox
    ctl: VirtController
    spec: EnsembleSpec
    pool: Pool
    notes: list[str] = field(default_factory=list)

    def vm(self, index: int) -> Vm:
        return self.sbx.vm(self.spec, self.pool.vmi_name(index))

    def vms(self) -> list[Vm]:
        return self.sbx.vms_of(self.spec)

    def settle(self, timeout: float = 90.0) -> float:
        """Wait until every running VM pins every running VM and IMEX is all CONNECTED."""
        with self.sbx.diagnostics_on_failure():
            return self.sbx.wait_converged(self.spec, timeout)

    def make_whole(self) -> None:
        """All ``VMS`` members again: a crashed one replaced, a missing one created."""
        for index in sorted(self.pool.members):
            if not self.vm(index).running():
                self.pool.restore(index)
        self.pool.scale(VMS)

    def timed(self, what: str, seconds: float) -> float:
        TIMINGS[what] = seconds
        return seconds


@contextlib.contextmanager
def running(sbx: Sandbox) -> Iterator[VirtController]:
    """``sbx`` started with a VirtController over it; on the way out both are closed and
    a network namespace of this sandbox left behind fails the test."""
    tag = ""
    try:
        sbx.start()
        assert sbx.fabric is not None
        tag = sbx.fabric.tag
        ctl = VirtController(sbx)
        try:
            yield ctl
        finally:
            ctl.close()
    finally:
        sbx.close()
        left = [n for n in list_netns() if tag and n.startswith(f"{sbx.settings.prefix}-{tag}-")]
        assert not left, f"namespaces left behind: {left}"


def signals_quiet(vms: Callable[[], list[Vm]], window: float, timeout: float = 120.0) -> None:
    """Until no guest's IMEX receives a SIGUSR1 for a whole ``window`` (longer than the
    signal interval), so a signal held back by an earlier change has gone out. A held
    signal is not visible from outside: a quiet window is the event waited for, retried
    while a loaded machine sends late ones."""

    def still() -> bool:
        before = {vm.vmi: vm.imex_state().get("signals_received") for vm in vms()}
        time.sleep(window)
        return {vm.vmi: vm.imex_state().get("signals_received") for vm in vms()} == before

    wait_for("no SIGUSR1 for a whole signal window", still, timeout, 0.1)


def _children(pid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(d.name))
    return out


@pytest.fixture(scope="module")
def rack(request: pytest.FixtureRequest) -> Iterator[Rack]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the e2e sandbox builds network namespaces and a bridge")
    sbx = Sandbox(SandboxSettings(prefix="e2e"))
    tag = ""
    try:
        sbx.start()
        assert sbx.fabric is not None
        tag = sbx.fabric.tag
        ctl = VirtController(sbx)
        try:
            spec = ctl.create_ensemble("rack-a", "gb200", max_members=VMS)
            pool = ctl.pool(spec)
            t0 = time.monotonic()
            pool.scale(VMS)
            TIMINGS["boot: VMIs created and VMs started"] = time.monotonic() - t0
            yield Rack(sbx, ctl, spec, pool)
        finally:
            ctl.close()
    finally:
        if request.session.testsfailed:
            sbx.keep_workdir = True  # agent and host agent logs for the post-mortem
            print(f"\ne2e: sandbox logs kept in {sbx.workdir}")
        sbx.close()
        left = [n for n in list_netns() if tag and n.startswith(f"e2e-{tag}-")]
        kids = _children(os.getpid())
        assert not left, f"namespaces left behind: {left}"
        assert not kids, f"child processes left behind: {kids}"


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if not TIMINGS:
        return
    terminalreporter.write_sep("-", "e2e convergence times")
    for what, seconds in TIMINGS.items():
        terminalreporter.write_line(f"{seconds:7.2f} s  {what}")
