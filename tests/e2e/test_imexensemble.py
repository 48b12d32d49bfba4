"""An ensemble declared as an ImexEnsemble beside a Service-only one, in one namespace.

The same real parts as test_ensemble.py (API double serving the CRD, DNS stand-in,
host agent process, namespace VMs with the real guest agent and the IMEX stand-in),
with two ensembles in ``rack-c``: ``gb200`` (6 VMs) declared by an ImexEnsemble, whose
Service the host agent creates, and ``gb300`` (3 VMs) declared by a hand-made Service.
Both go through the same story (boot, crash, rejoin, migration) and every step checks
the same guest results for both: the pins in every VM's /etc/hosts, IMEX CONNECTED to
every running peer, the nodes file, no IMEX restart. For the CR, after every step the
status is compared with the registry's JSON (they must agree field by field), Ready is
checked (False on the crash, True after the rejoin), each member's imexState is READY,
and the Events tell the story.

Tests run in file order and share the module's sandbox; each leaves both ensembles
converged.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from lightkube.core.exceptions import ApiError

from imex_shared.model import ABSENT_IP
from tests.e2e.conftest import TIMINGS, _children
from tests.host_support.ensembles import status_vs_registry
from tests.sandbox.ensemble import EnsembleSpec, Sandbox, SandboxSettings, wait_for
from tests.sandbox.netns import list_netns
from tests.sandbox.virt_controller import Pool, VirtController

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(240)]

NS = "rack-c"
CR_VMS = 6
SVC_VMS = 3


@dataclass
class Two:
    sbx: Sandbox
    ctl: VirtController
    cr: EnsembleSpec
    svc: EnsembleSpec
    pools: dict[str, Pool]

    def pool(self, spec: EnsembleSpec) -> Pool:
        return self.pools[spec.name]

    def both(self) -> tuple[EnsembleSpec, EnsembleSpec]:
        return self.cr, self.svc


@pytest.fixture(scope="module")
def two(request: pytest.FixtureRequest) -> Iterator[Two]:
    if os.geteuid() != 0:
        pytest.skip("needs root: the e2e sandbox builds network namespaces and a bridge")
    sbx = Sandbox(SandboxSettings(prefix="e2c"))
    tag = ""
    try:
        sbx.start()
        assert sbx.fabric is not None
        tag = sbx.fabric.tag
        ctl = VirtController(sbx)
        try:
            cr = ctl.create_ensemble(NS, "gb200", max_members=CR_VMS, form="cr")
            svc = ctl.create_ensemble(NS, "gb300", max_members=SVC_VMS)
            pools = {cr.name: ctl.pool(cr), svc.name: ctl.pool(svc)}
            # the CR's Service is the agent's: let it exist before VMs report
            wait_for("the ImexEnsemble's Service", lambda: sbx.registry_json(cr), 30, 0.1,
                     sbx.host_agent_log_tail)
            t0 = time.monotonic()
            pools[cr.name].scale(CR_VMS)
            pools[svc.name].scale(SVC_VMS)
            TIMINGS["CR + Service-only: VMIs created and VMs started"] = time.monotonic() - t0
            yield Two(sbx, ctl, cr, svc, pools)
        finally:
            ctl.close()
    finally:
        if request.session.testsfailed:
            sbx.keep_workdir = True
            print(f"\ne2e: sandbox logs kept in {sbx.workdir}")
        sbx.close()
        left = [n for n in list_netns() if tag and n.startswith(f"e2c-{tag}-")]
        kids = _children(os.getpid())
        assert not left, f"namespaces left behind: {left}"
        assert not kids, f"child processes left behind: {kids}"


def settle(t: Two, spec: EnsembleSpec, expect: dict[int, str] | None = None,
           timeout: float = 120.0) -> float:
    with t.sbx.diagnostics_on_failure():
        return t.sbx.wait_converged(spec, timeout, expect=expect)


def guest_results(t: Two, spec: EnsembleSpec, expect: dict[int, str],
                  moved: int | None = None) -> None:
    """What every running guest of ``spec`` must show, whichever form declared it.

    No IMEX restart anywhere (names mode: a moved peer costs a SIGUSR1), except on a
    member whose *own* address moved (``moved``): its listening socket must rebind.
    """
    sbx = t.sbx
    _, served = sbx.registry_get(f"/v1/ensembles/{spec.key}/nodes_config")
    assert served.decode().splitlines() == [spec.id.slot(i) for i in range(spec.max_members)]
    for vm in sbx.vms_of(spec):
        block = vm.hosts_block()
        assert block == {i: expect.get(i, ABSENT_IP) for i in range(spec.max_members)}, vm.vmi
        assert (vm.dir / "imex" / "nodes_config.cfg").read_bytes() == served
        # a SIGUSR1 held back by IMEX's 5 s window may still redial a moved peer
        wait_for(f"{vm.vmi}: IMEX CONNECTED to every peer",
                 lambda vm=vm: set(expect) - {vm.index} <= vm.connected_peers(), 15, 0.2)
        assert vm.status()["restarts"] == (1 if vm.index == moved else 0), vm.log_tail()
    assert {int(m["index"]): m["ip"] for m in sbx.registry_json(spec)["members"]} == expect


def status(t: Two) -> dict[str, Any]:
    return t.ctl.get_ensemble(t.cr).get("status") or {}


def condition(st: dict[str, Any], ctype: str) -> tuple[str, str] | None:
    for c in st.get("conditions") or ():
        if c["type"] == ctype:
            return c["status"], c["reason"]
    return None


def agreed(t: Two, timeout: float = 30.0) -> dict[str, Any]:
    """The CR status once it says what the registry says (it follows within a second
    or two of the registry: one coalesced write)."""
    last: list[list[str]] = [[]]

    def probe() -> dict[str, Any] | None:
        st = status(t)
        last[0] = status_vs_registry(st, t.sbx.registry_json(t.cr))
        return st if not last[0] else None

    return wait_for("CR status == registry JSON", probe, timeout, 0.25,
                    lambda: f"differences: {last[0]}")


def ready(t: Two, want: tuple[str, str], timeout: float = 60.0) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        st = status(t)
        return st if condition(st, "Ready") == want else None

    return wait_for(f"Ready {want}", probe, timeout, 0.25,
                    lambda: f"conditions: {status(t).get('conditions')}")


def reasons(t: Two, spec: EnsembleSpec, kind: str = "ImexEnsemble") -> list[str]:
    return [e["reason"] for e in t.ctl.events(spec, kind)]


def expected(t: Two, spec: EnsembleSpec) -> dict[int, str]:
    return {vm.index: vm.ip for vm in t.sbx.vms_of(spec)}


@pytest.mark.timeout(400)
def test_both_forms_boot_to_the_same_guest_results(two: Two) -> None:
    t = two
    t0 = time.monotonic()
    for spec in t.both():
        settle(t, spec, timeout=180)
        guest_results(t, spec, expected(t, spec))
    TIMINGS["CR + Service-only: all pinned and CONNECTED"] = time.monotonic() - t0
    svc = t.sbx.api.get("v1", "Service", t.cr.name, NS)  # type: ignore[union-attr]
    owner = svc["metadata"]["ownerReferences"][0]
    assert (owner["kind"], owner["name"], owner["controller"]) == ("ImexEnsemble", "gb200", True)
    st = ready(t, ("True", "AllMembersReady"))
    assert st["publishedSummary"] == f"{CR_VMS}/{CR_VMS}" and st["imexReady"] == CR_VMS
    assert [m["imexState"] for m in agreed(t)["members"]] == ["READY"] * CR_VMS
    assert condition(st, "Degraded") == ("False", "AsExpected")
    story: list[str] = wait_for(
        "the boot's Events", lambda: reasons(t, t.cr) if {"ServiceCreated", "MemberJoined",
                                                          "Ready"} <= set(reasons(t, t.cr))
        else None, 30, 0.5)
    assert story.count("MemberJoined") <= 6  # one per evaluation, not one per VM or pass
    assert "MemberJoined" in reasons(t, t.svc, kind="Service")  # the other form's Events
    with pytest.raises(ApiError) as err:  # the Service-only ensemble has no CR
        t.ctl.get_ensemble(t.svc)
    assert err.value.status.code == 404


def test_crash_unpins_and_flips_ready_false(two: Two) -> None:
    t = two
    victims = {t.cr.name: 2, t.svc.name: 1}
    want = {}
    for spec in t.both():
        settle(t, spec)
        t.pool(spec).crash(victims[spec.name])
        want[spec.name] = {i: ip for i, ip in expected(t, spec).items()
                           if i != victims[spec.name]}
    for spec in t.both():
        settle(t, spec, want[spec.name])
        guest_results(t, spec, want[spec.name])
    st = ready(t, ("False", "MemberNotRunning"))
    assert "gb200-2 (slot 2, Failed)" in next(
        c["message"] for c in st["conditions"] if c["type"] == "Ready")
    assert condition(st, "Degraded") == ("True", "MemberNotRunning")
    assert sorted(m["index"] for m in agreed(t)["members"]) == [0, 1, 3, 4, 5]
    wait_for("MemberLeft and ReadyLost", lambda: {"MemberLeft", "ReadyLost"}
             <= set(reasons(t, t.cr)), 30, 0.5)
    left = [e for e in t.ctl.events(t.cr) if e["reason"] == "MemberLeft"]
    assert left[-1]["type"] == "Warning" and "VMI Failed" in left[-1]["note"]


def test_rejoin_with_a_new_ip_flips_ready_true(two: Two) -> None:
    t = two
    victims = {t.cr.name: 2, t.svc.name: 1}
    for spec in t.both():
        if victims[spec.name] in expected(t, spec):
            t.pool(spec).crash(victims[spec.name])  # alone: the crash test did not run
    t0 = time.monotonic()
    for spec in t.both():
        t.pool(spec).restore(victims[spec.name])
    for spec in t.both():
        settle(t, spec)
        guest_results(t, spec, expected(t, spec))
    TIMINGS["CR + Service-only: rejoined, all CONNECTED"] = time.monotonic() - t0
    st = ready(t, ("True", "AllMembersReady"))
    assert st["imexReady"] == CR_VMS
    assert agreed(t)["members"][2]["ip"] == t.sbx.vm(t.cr, "gb200-2").ip
    wait_for("MemberJoined and ReadyRegained after the crash",
             lambda: "ReadyRegained" in reasons(t, t.cr), 30, 0.5)


def test_migration_moves_the_ip_in_status_and_guests(two: Two) -> None:
    t = two
    movers = {t.cr.name: 4, t.svc.name: 0}
    new_ips = {}
    for spec in t.both():
        settle(t, spec)
        new_ips[spec.name] = t.pool(spec).migrate(movers[spec.name])
    for spec in t.both():
        settle(t, spec)
        want = expected(t, spec)
        assert want[movers[spec.name]] == new_ips[spec.name]
        guest_results(t, spec, want, moved=movers[spec.name])
    st = agreed(t)
    assert st["members"][4]["ip"] == new_ips[t.cr.name]
    assert condition(ready(t, ("True", "AllMembersReady")), "Published") == (
        "True", "EndpointsPublished")
    moved = wait_for("MemberIPChanged", lambda: [e for e in t.ctl.events(t.cr)
                                                 if e["reason"] == "MemberIPChanged"], 30, 0.5)
    assert new_ips[t.cr.name] in moved[-1]["note"]


def test_the_story_in_events(two: Two) -> None:
    """What `kubectl describe imexensemble` prints, in order: the crash and the rejoin."""
    t = two
    story = reasons(t, t.cr)
    first = {r: story.index(r) for r in story}  # where each reason first appears
    assert first["ServiceCreated"] < first["MemberJoined"] < first["Ready"], story
    assert first["Ready"] < first["MemberLeft"] and first["Ready"] < first["ReadyLost"], story
    assert first["ReadyLost"] < first["ReadyRegained"], story
    assert first["MemberLeft"] < first["MemberIPChanged"], story
    for e in t.ctl.events(t.cr):
        assert e["reportingController"] == "imex-ensemble.io/host-agent"
        assert e["reportingInstance"] and e["action"] and e["reason"]
        # the server renders the deprecated fields empty; we never set them
        assert not e.get("deprecatedCount") and not e.get("deprecatedLastTimestamp")
    assert len(story) < 40  # bounded: not one per pass or report
