"""The workload's side in the sandbox: ``wait --for domain`` and the IMEX channel nodes.

Three network-namespace VMs (the real guest agent, the IMEX stand-in, the real host
agent's registry; reports every second so a cycle is short):

- ``wait --for domain`` run inside VM 0 while only two of the three members exist does
  not return; it returns 0 once the third joins and the registry's domain view is UP, and
  the view is UP when it has returned (never before);
- with one link refused by the nftables rule the domain tests use, ``wait --timeout 3``
  exits 3 and names the link; lifted, a waiting ``wait`` returns 0. The time from the
  test seeing UP to ``wait`` returning is the benchmark's ``wait_return_ms``;
- without IMEX (no ctl) it exits 4 at once;
- a member whose channel node is removed gets it back within one poll: VM 2's agent
  runs in a private mount namespace (tests/guest_support/channels_wrap.sh: a tmpfs on
  /dev, a fake /proc/devices), and the test removes the node there with nsenter.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.e2e.conftest import running
from tests.e2e.domain_support import block_dials, domain, unblock_dials
from tests.sandbox.ensemble import (
    RACK_CLUSTER_UUID,
    REPO_ROOT,
    EnsembleSpec,
    Sandbox,
    SandboxSettings,
    Vm,
    child_env,
)
from tests.sandbox.virt_controller import Pool, VirtController

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(240)]

N = 3
WRAP = REPO_ROOT / "tests" / "guest_support" / "channels_wrap.sh"
CHANNEL = "/dev/nvidia-caps-imex-channels/channel0"
WAIT_RETURN_MS: list[float] = []


@dataclass
class Trio:
    sbx: Sandbox
    ctl: VirtController
    spec: EnsembleSpec
    pool: Pool

    def vm(self, index: int) -> Vm:
        return self.sbx.vm(self.spec, self.pool.vmi_name(index))


@pytest.fixture(scope="module")
def trio() -> Iterator[Trio]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the sandbox builds network namespaces and a bridge")
    sbx = Sandbox(SandboxSettings(prefix="bar", report_interval=1.0, report_stale_after=10.0))
    with running(sbx) as ctl:
        spec = ctl.create_ensemble("rack-w", "trio", max_members=N, form="cr")
        pool = ctl.pool(spec)
        pool.scale(N - 1)
        yield Trio(sbx, ctl, spec, pool)


def wait_argv(vm: Vm, *args: str, config: Path | None = None) -> list[str]:
    cfg = config or vm.dir / "config.toml"
    return vm.node.argv([vm.sandbox.settings.guest_python, "-m", "guest_agent.cli",
                         "--config", str(cfg), "wait", "--for", "domain", *args])


def start_wait(vm: Vm, timeout: float = 120) -> subprocess.Popen[str]:
    return subprocess.Popen(wait_argv(vm, "--timeout", str(timeout)), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=child_env(), cwd=REPO_ROOT)


def is_up(trio: Trio) -> bool:
    doc = domain(trio.sbx, trio.spec)
    return doc.get("status") == "UP" and not doc.get("silent") and \
        len(doc.get("members") or ()) == N


def until(what: str, probe: object, timeout: float, every: float = 0.05) -> float:
    t0 = time.monotonic()
    while not probe():  # type: ignore[operator]
        assert time.monotonic() - t0 < timeout, f"{what}: not within {timeout:g} s"
        time.sleep(every)
    return time.monotonic()


def returned_when_up(trio: Trio, proc: subprocess.Popen[str], timeout: float) -> None:
    """``proc`` returns 0 once the domain is UP (sample: UP seen -> returned, in ms), and
    the domain is UP when it has returned."""
    up_at = until("domain UP", lambda: is_up(trio), timeout)
    out, err = proc.communicate(timeout=30)
    returned_at = time.monotonic()
    assert proc.returncode == 0, (out, err)
    assert out.startswith("ready: domain (registry)"), out
    assert is_up(trio), "wait returned while the domain was not UP"
    WAIT_RETURN_MS.append((returned_at - up_at) * 1000)


def test_wait_returns_after_the_domain_is_up_never_before(trio: Trio) -> None:
    vm0 = trio.vm(0)
    until("VM 0 applied its members", lambda: vm0.status_file.exists()
          and len(vm0.status().get("members") or ()) == N - 1, 60, 0.2)
    proc = start_wait(vm0)
    try:
        time.sleep(3)
        assert proc.poll() is None, proc.communicate()  # 2 of 3: not a domain
        trio.pool.scale(N)
        returned_when_up(trio, proc, 90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_a_blocked_link_times_out_naming_it_then_the_barrier_returns(trio: Trio) -> None:
    a, b = trio.vm(0), trio.vm(1)
    for cycle in range(3):
        block_dials(a, b, trio.spec.port)
        try:
            until("DEGRADED", lambda: domain(trio.sbx, trio.spec).get("status") == "DEGRADED",
                  30, 0.1)
            if cycle == 0:
                done = subprocess.run(wait_argv(a, "--timeout", "3"), capture_output=True,
                                      text=True, env=child_env(), cwd=REPO_ROOT, timeout=60)
                assert done.returncode == 3, (done.stdout, done.stderr)
                assert done.stdout.startswith("timed out after 3 s: still missing: links not "
                                              "CONNECTED: 0->1"), done.stdout
            proc = start_wait(a)
            time.sleep(1.5)
            assert proc.poll() is None, proc.communicate()
        finally:
            unblock_dials(a)
        returned_when_up(trio, proc, 60)
    ms = sorted(WAIT_RETURN_MS)
    p99 = ms[min(len(ms) - 1, round(0.99 * (len(ms) - 1)))]
    print(f"\nwait_return_ms samples={len(ms)} p50={statistics.median(ms):.0f} "
          f"p99={p99:.0f} all={[round(x) for x in ms]} load={os.getloadavg()[0]:.1f}")


def test_without_imex_wait_does_not_apply(trio: Trio, tmp_path: Path) -> None:
    vm0 = trio.vm(0)
    text = (vm0.dir / "config.toml").read_text().splitlines()
    cfg = tmp_path / "config.toml"
    cfg.write_text("".join(f"{line}\n" for line in text if not line.startswith("imex_ctl"))
                   + 'imex_ctl = ["/nonexistent/nvidia-imex-ctl"]\n')
    done = subprocess.run(wait_argv(vm0, config=cfg), capture_output=True, text=True,
                          env=child_env(), cwd=REPO_ROOT, timeout=60)
    assert done.returncode == 4, done.stderr
    assert "IMEX is not installed" in done.stderr


def conditions(trio: Trio, spec: EnsembleSpec) -> dict[str, dict[str, str]]:
    status = trio.ctl.get_ensemble(spec).get("status") or {}
    return {c["type"]: c for c in status.get("conditions") or ()}


def test_guest_checks_and_a_shared_clique_with_the_real_host_agent(trio: Trio) -> None:
    """The condition, the metric and the page column from the guests' own preflight; then
    an ensemble in another namespace whose member reports the same clique: CliqueShared
    on both (informational), an Event, and gone when it moves."""
    sbx, spec = trio.sbx, trio.spec
    until("GuestChecks judged", lambda: conditions(trio, spec).get(
        "GuestChecks", {}).get("status") in ("True", "False"), 60, 0.5)
    checks = conditions(trio, spec)["GuestChecks"]
    # the sandbox has no /etc/nvidia-imex/config.cfg: the guests say so
    assert (checks["status"], checks["reason"]) == ("False", "ImexConfigFailed"), checks
    assert "imex_config FAIL on members 0, 1, 2" in checks["message"]
    _, metrics = sbx.registry_get("/metrics")
    assert ('imex_ensemble_guest_checks{check="imex_config",ensemble="trio",'
            'namespace="rack-w",result="FAIL"} 3.0') in metrics.decode()
    _, page = sbx.registry_get("/ui/ensembles/rack-w/trio")
    assert "<th>checks</th>" in page.decode() and "FAIL: imex_config" in page.decode()

    degraded = conditions(trio, spec)["Degraded"]["status"]
    restarts = {vm.index: vm.status()["restarts"] for vm in trio.sbx.vms_of(spec)}
    other = trio.ctl.create_ensemble("rack-x", "solo", max_members=1, form="cr")
    pool = trio.ctl.pool(other)
    pool.scale(1)
    until("CliqueShared on both", lambda: all(
        conditions(trio, s).get("CliqueShared", {}).get("status") == "True"
        for s in (spec, other)), 60, 0.5)
    shared = conditions(trio, spec)["CliqueShared"]
    assert "an ensemble in another namespace" in shared["message"]
    assert "solo" not in shared["message"] and "rack-x" not in shared["message"]
    assert conditions(trio, spec)["Degraded"]["status"] == degraded
    until("the CliqueShared Event", lambda: "CliqueShared" in
          [e["reason"] for e in trio.ctl.events(spec)], 30, 0.5)
    problems = sbx.registry_json(spec, strict=True)["problems"]
    assert any(p.startswith(f"NVLink clique {RACK_CLUSTER_UUID}.1") for p in problems)
    # the other one moves to another clique: both lose it
    vm = sbx.vm(other, pool.vmi_name(0))
    vm.stop()
    sbx.fabrics[(other.namespace, vm.vmi)] = {"cluster_uuid": RACK_CLUSTER_UUID,
                                              "clique_id": 2}
    vm.start()
    until("CliqueShared gone", lambda: all(
        conditions(trio, s).get("CliqueShared", {}).get("status") == "False"
        for s in (spec, other)), 60, 0.5)
    assert conditions(trio, spec)["Degraded"]["status"] == degraded
    assert {vm.index: vm.status()["restarts"] for vm in trio.sbx.vms_of(spec)} == restarts
    pool.scale(0)


def test_a_removed_channel_node_is_back_within_one_poll(trio: Trio) -> None:
    vm = trio.vm(N - 1)
    vm.stop()
    fd, devices = tempfile.mkstemp(prefix="bar-devices-")
    os.write(fd, b"Character devices:\n  1 mem\n195 nvidia\n"
                 b"234 nvidia-caps-imex-channels\n\nBlock devices:\n  8 sd\n")
    os.close(fd)
    try:
        vm.channels = [0]
        vm.start(wrap=["unshare", "-m", "--propagation", "private", "sh", str(WRAP), devices])
        assert vm.agent is not None
        pid = vm.agent.pid

        def present() -> bool:
            return subprocess.run(["nsenter", "-t", str(pid), "-m", "test", "-c", CHANNEL],
                                  check=False).returncode == 0

        until("channel0 made", present, 60, 0.1)
        assert not os.path.exists(CHANNEL)  # the host's /dev is untouched
        subprocess.run(["nsenter", "-t", str(pid), "-m", "rm", CHANNEL], check=True)
        removed = time.monotonic()
        back = until("channel0 back", present, 10, 0.02)
        poll = trio.sbx.settings.poll_interval
        print(f"\nchannel node back after {back - removed:.2f} s (poll_interval {poll:g} s)")
        assert back - removed <= poll + 0.5
        until("status names channel 0", lambda: vm.status().get("imex_channels") == [0],
              10, 0.1)
    finally:
        vm.stop()
        os.unlink(devices)
