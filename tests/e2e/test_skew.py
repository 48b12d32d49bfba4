"""Version skew, guests ahead: this release's guests against the 0.1.0 host agent.

docs/install.md "Upgrades": the host agent goes first, but a guest upgraded before it
must keep working for reports. The 0.1.0 host agent here is the real one, built from
commit 8503169's wheel into a venv of its own (tests/sandbox/releases.py, cached under
~/.cache/imex-ensemble/releases); the guests are this tree's. The other direction (0.1.0
guests against this host agent, over plain HTTP beside HTTPS) is in
test_registry_tls.py, which shares its sandbox with the TLS tests.

Each direction: the ensemble converges (every hosts block right, IMEX CONNECTED to every
peer), every guest's report is in the registry, and a crash and a rejoin with a new IP
converge again with the new VM reporting.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from functools import partial
from typing import Any

import pytest

from imex_shared.version import package_version
from tests.e2e.conftest import running
from tests.e2e.domain_support import wait_domain
from tests.e2e.skew_support import SkewRack, reports_in
from tests.sandbox.ensemble import Sandbox, SandboxSettings, Vm, wait_for
from tests.sandbox.releases import previous_release

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(300)]
VMS = 3


@pytest.fixture(scope="module")
def old_host() -> Iterator[SkewRack]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the e2e sandbox builds network namespaces and a bridge")
    release = previous_release()
    sbx = Sandbox(SandboxSettings(prefix="skewh", host_release=release))
    with running(sbx) as ctl:
        spec = ctl.create_ensemble("rack-k", "gb200", max_members=4)
        pool = ctl.pool(spec)
        pool.scale(VMS)
        yield SkewRack(sbx, ctl, spec, pool)


def _with_host_verdict(vm: Vm) -> dict[str, Any] | None:
    """The status file's ``registry`` section, once it holds the guest's verdict."""
    registry: dict[str, Any] = vm.status().get("registry") or {}
    return registry if registry.get("host") else None


#: the report fields 0.2 added, which a 0.1 registry refuses (422, extra forbidden)
NEW_IN_0_2 = {"registry_ca_sha256", "imex_channels", "preflight", "sent"}


def test_new_guests_converge_and_report_to_the_0_1_host_agent(old_host: SkewRack) -> None:
    rack = old_host
    assert package_version() != previous_release().version  # two releases, really
    status, _ = rack.sbx.registry_get("/version")
    assert status == 404  # the 0.1.0 host agent: no /version
    rack.settle()
    reports_in(rack, package_version())
    for vm in rack.vms():
        # the guest asks /version after its first delivered report, so the registry can
        # hold that report a moment before the guest's status file holds the verdict
        registry = wait_for(f"{vm.vmi}'s verdict on the host agent",
                            partial(_with_host_verdict, vm), 30, 0.2)
        # the guest knows whom it talks to, and left out the fields 0.1 refuses: 0.2's
        # own (preflight rides along only once its first run is done)
        assert registry.get("host", {}).get("skew") == "older_host", registry
        refused = set(registry.get("refused_fields") or ())
        assert {"registry_ca_sha256", "imex_channels"} <= refused <= NEW_IN_0_2, registry
        log = vm.log_tail(200_000)
        for name in refused:
            assert log.count(f"refuses report field {name!r}") == 1, log[-2000:]
        assert "status report not delivered" not in log
    # the guests send only their own entry of the -N -j view (imex_shared own_view), the
    # only part 0.1.0 keeps too: its domain view has every member's row
    doc, _ = wait_domain(rack.sbx, rack.spec, lambda d: d.get("status") == "UP", 60)
    assert doc["missing_links"] == [], doc


def test_crash_and_rejoin_under_the_0_1_host_agent(old_host: SkewRack) -> None:
    rack = old_host
    rack.settle()
    rack.pool.crash(1)
    rack.settle()  # the crashed slot is unpinned on every peer
    before = time.time()
    rack.pool.restore(1)  # a new VM, a new address
    rack.settle()
    got = reports_in(rack, package_version(), since=before)
    assert got[1]["from_ip"] == rack.sbx.vm(rack.spec, rack.pool.vmi_name(1)).ip
