"""A whole 18-VM ensemble on one machine, through every failure the design promises to ride out.

Real parts throughout: the API double spoken to with lightkube by the scripted
virt-controller and the host agent (a real process), the DNS stand-in fed from the
EndpointSlices the host agent writes, the registry over HTTP, 18 network-namespace VMs each
with its own /etc/hosts running the real guest agent and the IMEX stand-in as its child.

The tests share one sandbox (see conftest.py) and run in file order; each starts from a
converged ensemble and leaves one behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import time
from collections.abc import Iterator
from typing import Any

import dns.message
import dns.query
import dns.rdatatype
import pytest

from imex_shared.hostsfile import merge_hosts
from imex_shared.model import ABSENT_IP
from tests.e2e.conftest import VMS, Rack, signals_quiet
from tests.e2e.domain_support import (
    block_dials,
    browser,
    browser_missing,
    screenshot,
    unblock_dials,
    wait_domain,
    wait_page,
)
from tests.sandbox.ensemble import RACK_CLUSTER_UUID, EnsembleSpec, Sandbox, wait_for
from tests.sandbox.imex_standin import CONNECT_TIMEOUT_S, PEER_TIMEOUT_S, RETRY_MAX_S
from tests.timing import measured

pytestmark = [pytest.mark.e2e, pytest.mark.root, pytest.mark.timeout(180)]

#: How long a live IMEX link may be down before a test calls it lost: the stand-in's
#: keepalive timeout (a loaded machine can starve a peer that long), then two redials at
#: its longest backoff, each with its connect timeout, and a second to spare (14 s).
LINK_BACK_S = PEER_TIMEOUT_S + 2 * (RETRY_MAX_S + CONNECT_TIMEOUT_S) + 1


def srv_targets(sbx: Sandbox, spec: EnsembleSpec) -> dict[str, str]:
    """The DNS stand-in's SRV answer for the ensemble: slot name -> address."""
    name = spec.id.srv_name("cluster.local")
    q = dns.message.make_query(name, dns.rdatatype.SRV)
    r = dns.query.tcp(q, sbx.dns_ip, port=sbx.dns.port if sbx.dns else 53, timeout=10)
    addrs = {rr.name.to_text().split(".")[0]: rr[0].address
             for rr in r.additional if rr.rdtype == dns.rdatatype.A}
    return {rd.target.to_text().split(".")[0]: addrs.get(rd.target.to_text().split(".")[0], "")
            for rrset in r.answer for rd in rrset}


def registry_members(sbx: Sandbox, spec: EnsembleSpec) -> dict[int, str]:
    doc = sbx.registry_json(spec, strict=True)
    return {int(m["index"]): str(m["ip"]) for m in doc["members"]}


def expected(rack: Rack) -> dict[int, str]:
    return {vm.index: vm.ip for vm in rack.vms()}


@pytest.fixture
def settled(rack: Rack) -> Iterator[Rack]:
    """The shared rack, whole and converged before the test starts.

    A test that fails between crashing a member and restoring it leaves the member down;
    the pool replaces it here, so that failure is reported once, by its own test, and
    the next test does not fail on its remains (CI, 2026-12-05)."""
    rack.make_whole()
    rack.settle()
    yield rack


@pytest.mark.timeout(300)
def test_boot_18_vms_all_connected(rack: Rack) -> None:
    t0 = time.monotonic()
    rack.settle(150)
    rack.timed("boot: 18 VMs all pinned and CONNECTED", time.monotonic() - t0)
    sbx, spec = rack.sbx, rack.spec
    ips = expected(rack)
    assert sorted(ips) == list(range(VMS))
    assert registry_members(sbx, spec) == ips
    assert srv_targets(sbx, spec) == {spec.id.slot(i): ip for i, ip in ips.items()}
    _, served = sbx.registry_get(f"/v1/ensembles/{spec.key}/nodes_config")
    for vm in rack.vms():
        st = vm.status()
        assert st["own_index"] == vm.index and st["own_ip"] == vm.ip
        assert st["restarts"] == 0, vm.log_tail()
        nodes = (vm.dir / "imex" / "nodes_config.cfg").read_bytes()
        assert nodes == served  # identical everywhere, exactly what the registry serves
        assert nodes.decode().splitlines() == [spec.id.slot(i) for i in range(VMS)]
    # IMEX's own view, through nvidia-imex-ctl -N -j inside VMs (the state files of all
    # of them were checked by settle(); each ctl run is a process start on 2 cores)
    for vm in [rack.vm(0), rack.vm(VMS // 2), rack.vm(VMS - 1)]:
        view = vm.domain()
        assert view.get("status") == "UP", (vm.vmi, view)
        own = view["nodes"][str(vm.index)]
        assert {c["status"] for c in own["connections"].values()} == {"CONNECTED"}
        assert len(own["connections"]) == VMS - 1


def test_crash_unpins_the_slot_on_every_peer(settled: Rack) -> None:
    rack = settled
    victim = 5
    old_ip = rack.vm(victim).ip
    t0 = time.monotonic()
    rack.pool.crash(victim)
    want = {i: ip for i, ip in expected(rack).items() if i != victim}
    with rack.sbx.diagnostics_on_failure():
        rack.sbx.wait_converged(rack.spec, 60, expect=want)
    rack.timed("crash: 17 peers pin the slot to 127.0.0.2", time.monotonic() - t0)
    assert rack.ctl.get_vmi(rack.spec, rack.pool.vmi_name(victim))["status"]["phase"] == "Failed"
    for vm in rack.vms():
        assert vm.index != victim
        assert vm.hosts_block()[victim] == ABSENT_IP  # type: ignore[index]
        # IMEX notices the dead peer on its own (EOF, then failed redials); its
        # state file follows within a few seconds of the hosts file.
        deadline = time.monotonic() + 15
        while victim in vm.connected_peers():
            assert time.monotonic() < deadline, f"{vm.vmi}: IMEX still CONNECTED to {victim}"
            time.sleep(0.2)
    assert victim not in registry_members(rack.sbx, rack.spec)
    assert old_ip not in srv_targets(rack.sbx, rack.spec).values()


def test_rejoin_with_a_new_ip_all_connected_again(rack: Rack) -> None:
    victim = 5
    if victim in {vm.index for vm in rack.vms()}:
        rack.pool.crash(victim)  # alone: the crash test did not run first
    old_ip = rack.vm(victim).ip
    signals_before = {vm.index: vm.status().get("signals", 0) for vm in rack.vms()}
    t0 = time.monotonic()
    rack.pool.restore(victim)
    new_ip = rack.vm(victim).ip
    assert new_ip != old_ip
    rack.settle(90)
    rack.timed("rejoin: new IP pinned everywhere, all CONNECTED", time.monotonic() - t0)
    for vm in rack.vms():
        assert vm.hosts_block()[victim] == new_ip  # type: ignore[index]
        if vm.index == victim:
            continue
        # IMEX's own redials may connect before our SIGUSR1: one that fell inside the
        # 5 s window after the crash's signal is sent when the window ends.
        deadline = time.monotonic() + 15
        while vm.status().get("signals", 0) <= signals_before[vm.index]:
            assert time.monotonic() < deadline, f"{vm.vmi}: no SIGUSR1 for the rejoin"
            time.sleep(0.2)
        st = vm.status()
        assert st["restarts"] == 0  # names mode: a moved peer costs a SIGUSR1, not a restart
        assert vm.imex_state()["peers"][str(victim)]["ip"] == new_ip
        assert vm.imex_state()["signals_ignored"] == 0


def test_live_migration_new_ip(settled: Rack) -> None:
    rack = settled
    mover = 7
    old_ip = rack.vm(mover).ip
    t0 = time.monotonic()
    new_ip = rack.pool.migrate(mover)
    assert new_ip != old_ip
    rack.settle(90)
    rack.timed("migration: new IP pinned everywhere, all CONNECTED", time.monotonic() - t0)
    vmi = rack.ctl.get_vmi(rack.spec, rack.pool.vmi_name(mover))
    assert vmi["status"]["migrationState"]["completed"] is True
    assert vmi["status"]["interfaces"][0]["ipAddress"] == new_ip
    assert registry_members(rack.sbx, rack.spec)[mover] == new_ip
    for vm in rack.vms():
        assert vm.hosts_block()[mover] == new_ip  # type: ignore[index]


def test_host_agent_restart_loses_nothing(settled: Rack) -> None:
    rack = settled
    sbx, spec = rack.sbx, rack.spec
    assert sbx.api is not None
    # a SIGUSR1 held back by the previous test's last change goes out within one window
    signals_quiet(rack.vms, sbx.settings.signal_interval + 0.5)
    before = sbx.registry_json(spec)
    blocks = {vm.index: vm.hosts_block() for vm in rack.vms()}
    signals = {vm.index: vm.imex_state().get("signals_received") for vm in rack.vms()}
    restarts = {vm.index: vm.status().get("restarts") for vm in rack.vms()}
    sbx.api.reset_counters()
    sbx.stop_host_agent()
    try:
        # The gap: DNS still serves the published slice and every guest keeps every member,
        # also once its registry long-poll has failed and DNS views take over (the gap
        # lasts past poll_interval + longpoll_timeout, the guests' failover deadline).
        assert srv_targets(sbx, spec) == {spec.id.slot(m["index"]): m["ip"]
                                          for m in before["members"]}
        s = sbx.settings
        gap_end = time.monotonic() + s.poll_interval + s.longpoll_timeout + 2
        while time.monotonic() < gap_end:
            changed = {vm.vmi: {i: (ip, (vm.hosts_block() or {}).get(i))
                                for i, ip in blocks[vm.index].items()  # type: ignore[union-attr]
                                if (vm.hosts_block() or {}).get(i) != ip}
                       for vm in rack.vms() if vm.hosts_block() != blocks[vm.index]}
            assert not changed, f"pins changed during the host agent's gap (slot: " \
                f"(registry's IP, guest's pin)): {changed}"
            time.sleep(0.2)
    finally:  # the later tests need a host agent whatever happened here
        sbx.start_host_agent(timeout=90)
    t0 = time.monotonic()
    def whole() -> dict[str, Any] | None:
        d = sbx.registry_json(spec)
        return d if d and len(d["members"]) == VMS else None

    doc = wait_for("the restarted registry to publish all members", whole, 30, 0.1)
    rack.timed("host agent restart: registry whole again", time.monotonic() - t0)
    gen = doc["generation"]
    # restart rule (issue 16): the (generation, membership) pair persisted in the API is
    # served again under the same number, so a guest holding it has nothing to wait for
    assert gen == before["generation"]
    assert {m["index"]: m["ip"] for m in doc["members"]} == \
        {m["index"]: m["ip"] for m in before["members"]}
    # every guest stays on that generation without touching a file or IMEX
    wait_for("every guest on the generation",
             lambda: all(vm.status().get("generation_applied") == gen for vm in rack.vms()),
             30, 0.25)
    time.sleep(2.0)  # a spurious bump would show up now; there is no event for "nothing"
    assert sbx.registry_json(spec)["generation"] == gen
    assert sbx.api.writes("endpointslices") == 0  # the slice was already right
    for vm in rack.vms():
        assert vm.hosts_block() == blocks[vm.index]
        assert vm.status().get("restarts") == restarts[vm.index]
    spurious = {vm.vmi: vm.imex_state().get("signals_received", 0) - (signals[vm.index] or 0)
                for vm in rack.vms()
                if vm.imex_state().get("signals_received") != signals[vm.index]}
    assert not spurious, f"SIGUSR1 sent although no pin changed: {spurious}"
    rack.settle(30)


def test_api_outage_removes_no_member_and_reconverges(settled: Rack) -> None:
    rack = settled
    sbx, spec = rack.sbx, rack.spec
    assert sbx.api is not None
    ips = expected(rack)
    blocks = {vm.index: vm.hosts_block() for vm in rack.vms()}
    sbx.api.outage("refuse")
    try:
        deadline = time.monotonic() + 6.0
        while time.monotonic() < deadline:  # sample the whole outage
            assert registry_members(sbx, spec) == ips
            assert srv_targets(sbx, spec) == {spec.id.slot(i): ip for i, ip in ips.items()}
            time.sleep(1.0)
        for vm in rack.vms():
            assert vm.hosts_block() == blocks[vm.index]
    finally:
        sbx.api.recover()
    # after the outage the watches are back: a scale-down and up is followed
    t0 = time.monotonic()
    rack.pool.scale(VMS - 1)
    want = {i: ip for i, ip in ips.items() if i != VMS - 1}
    with sbx.diagnostics_on_failure():
        sbx.wait_converged(spec, 60, expect=want)
    rack.timed("after API outage: scale-down followed", time.monotonic() - t0)
    t0 = time.monotonic()
    rack.pool.scale(VMS)
    rack.settle(90)
    rack.timed("after API outage: scale-up followed", time.monotonic() - t0)


def test_registry_down_dns_path_converges(settled: Rack) -> None:
    rack = settled
    sbx, spec = rack.sbx, rack.spec
    victim = 11
    sbx.block_registry()
    try:
        t0 = time.monotonic()
        rack.pool.crash(victim)
        want = {i: ip for i, ip in expected(rack).items() if i != victim}
        with sbx.diagnostics_on_failure():
            sbx.wait_converged(spec, 60, expect=want)
        rack.timed("registry down: crash followed through DNS", time.monotonic() - t0)
        t0 = time.monotonic()
        rack.pool.restore(victim)
        rack.settle(90)
        rack.timed("registry down: rejoin followed through DNS", time.monotonic() - t0)
        # the changes can only have come through DNS
        assert {vm.vmi: vm.status().get("source") for vm in rack.vms()} == \
            {vm.vmi: "dns" for vm in rack.vms()}
    finally:
        sbx.block_registry(False)
    wait_for("every guest back on the registry",
             lambda: all(vm.status().get("source") == "registry" for vm in rack.vms()), 40, 0.25)


def test_dns_down_too_keeps_last_known_good(settled: Rack) -> None:
    rack = settled
    sbx, spec = rack.sbx, rack.spec
    victim = 13
    victim_ip = rack.vm(victim).ip
    sbx.block_registry()
    sbx.block_dns()
    try:
        blocks = {vm.index: vm.hosts_block() for vm in rack.vms()}
        nodes = {vm.index: (vm.dir / "imex" / "nodes_config.cfg").read_bytes()
                 for vm in rack.vms()}
        rack.pool.crash(victim)  # published as gone, but no guest can hear it
        wait_for("the host agent to drop the crashed member",
                 lambda: victim not in registry_members(sbx, spec), 20, 0.1)
        time.sleep(4 * sbx.settings.poll_interval + 1)  # several failed passes: nothing to await
        for vm in rack.vms():
            assert vm.running(), vm.log_tail()
            assert vm.hosts_block() == blocks[vm.index]  # last-known-good, victim still pinned
            assert vm.hosts_block()[victim] == victim_ip  # type: ignore[index]
            assert (vm.dir / "imex" / "nodes_config.cfg").read_bytes() == nodes[vm.index]
        # Every live link is up, or comes back on its own over the pinned names, DNS down
        # or not. Up at one instant is not the claim (CI, 2026-12-05: one of 17 x 16
        # links was down at the look): see LINK_BACK_S.
        wait_for("every live member connected to every other", lambda: not _unconnected(rack),
                 LINK_BACK_S, 0.25, lambda: _links_detail(rack))
        for vm in rack.vms():  # and the agents still held last-known-good meanwhile
            assert vm.hosts_block() == blocks[vm.index]
    finally:
        sbx.block_dns(False)
        sbx.block_registry(False)
    t0 = time.monotonic()
    want = {i: ip for i, ip in expected(rack).items() if i != victim}
    with sbx.diagnostics_on_failure():
        sbx.wait_converged(spec, 60, expect=want)
    rack.timed("registry+DNS back: crash caught up", time.monotonic() - t0)
    rack.pool.restore(victim)
    rack.settle(90)


def _unconnected(rack: Rack) -> dict[int, list[int]]:
    """Each running member's running peers it has no CONNECTED link to (empty: none)."""
    live = set(expected(rack))
    gaps = {vm.index: sorted(live - {vm.index} - vm.connected_peers()) for vm in rack.vms()}
    return {i: g for i, g in gaps.items() if g}


def _links_detail(rack: Rack) -> str:
    """The unconnected links' stand-in entries and their members' last signals."""
    lines = []
    for index, gaps in _unconnected(rack).items():
        st = rack.vm(index).imex_state()
        peers = st.get("peers") or {}
        lines.append(f"vm {index}: state {st.get('state')}, "
                     f"signals {st.get('signal_log', [])[-3:]}, "
                     f"links {[(g, peers.get(str(g))) for g in gaps]}")
    return "\n".join(lines)


def test_clobbered_hosts_file_is_restored(settled: Rack) -> None:
    rack = settled
    vm = rack.vm(2)
    block = vm.hosts_block()
    clobber = "127.0.0.1\tlocalhost\n127.0.1.1\tgb200-2.cluster gb200-2\n"
    before = vm.status().get("reasserts", 0)
    restarts = vm.status()["restarts"]
    t0 = time.monotonic()
    vm.node.write_hosts(clobber)  # in place, as cloud-init's manage_etc_hosts does
    wait_for("the block restored", lambda: vm.hosts_block() == block, 10, 0.02)
    rack.timed("clobbered /etc/hosts restored", time.monotonic() - t0)
    assert vm.hosts_path.read_text().startswith(clobber)  # the rest of the file is kept
    wait_for("the reassert counted", lambda: vm.status().get("reasserts", 0) > before, 5, 0.1)
    assert vm.status()["restarts"] == restarts  # a file repair never costs an IMEX restart


def test_two_ensembles_side_by_side_never_mix(settled: Rack) -> None:
    rack = settled
    sbx = rack.sbx
    # same Service name in another namespace: another domain id, another nodes file
    spec_b = rack.ctl.create_ensemble("rack-b", "gb200", max_members=4)
    pool_b = rack.ctl.pool(spec_b)
    try:
        t0 = time.monotonic()
        pool_b.scale(3)
        with sbx.diagnostics_on_failure():
            sbx.wait_converged(spec_b, 90)
        rack.timed("second ensemble (3 VMs) converged", time.monotonic() - t0)
        rack.settle(30)
        a_ips = set(expected(rack).values())
        b_vms = sbx.vms_of(spec_b)
        b_ips = {vm.ip for vm in b_vms}
        assert spec_b.id.domain_id != rack.spec.id.domain_id
        assert set(registry_members(sbx, spec_b).values()) == b_ips
        assert set(registry_members(sbx, rack.spec).values()) == a_ips
        b_header = f"imex-ensemble {spec_b.key}".encode()
        a_header = f"imex-ensemble {rack.spec.key}".encode()
        for vm in rack.vms():
            text = vm.hosts_path.read_bytes()
            assert b_header not in text and not any(ip.encode() in text for ip in b_ips)
            assert {p["ip"] for p in vm.imex_state()["peers"].values()} <= a_ips | {ABSENT_IP}
        b_nodes = {hashlib.sha256((vm.dir / "imex" / "nodes_config.cfg").read_bytes())
                   .hexdigest() for vm in b_vms}
        assert len(b_nodes) == 1
        b_index = {v.index for v in b_vms}  # each connected to exactly its own peers
        wait_for("B's members connected to exactly each other", lambda: all(
            v.connected_peers() == b_index - {v.index} for v in b_vms), LINK_BACK_S, 0.25)
        for vm in b_vms:
            text = vm.hosts_path.read_bytes()
            assert a_header not in text and not any(ip.encode() in text for ip in a_ips)
            lines = (vm.dir / "imex" / "nodes_config.cfg").read_text().splitlines()
            assert lines == [spec_b.id.slot(i) for i in range(4)]
    finally:
        pool_b.scale(0)


# ---- the IMEX domain view (issue 17): links, cliques, the page ----------------------


def _up(doc: dict[str, Any]) -> bool:
    return doc.get("status") == "UP" and not doc.get("silent")


@pytest.mark.timeout(240)
def test_domain_up_a_one_way_loss_degraded_then_up_in_the_browser(settled: Rack) -> None:
    rack = settled
    sbx, spec = rack.sbx, rack.spec
    interval = sbx.settings.report_interval
    doc, _ = wait_domain(sbx, spec, _up, interval * 2 + 5)
    assert doc["missing_links"] == [] and doc["partitions"] == [list(range(VMS))]
    assert len(doc["links"]) == VMS * (VMS - 1)
    _, matrix = sbx.registry_get(f"/v1/ensembles/{spec.key}/domain?format=matrix")
    assert matrix.decode().splitlines()[-1] == "Domain State: UP"
    a, b = rack.vm(3), rack.vm(7)
    restarts = {vm.index: (vm.status()["restarts"], vm.imex_state()["starts"])
                for vm in rack.vms()}
    why = browser_missing()
    page = contextlib.ExitStack()
    driver = None if why else page.enter_context(browser())
    with page:
        if driver is not None:
            driver.get(f"{sbx.registry_url}/ui/ensembles/{spec.namespace}/{spec.name}")
            rows = driver.find_elements("css selector", "#members tbody tr")
            assert len(rows) == VMS
            driver.execute_script("window.__sameDocument = 1;")
            cell = driver.find_element("css selector", '#matrix td[data-from="3"][data-to="7"]')
            status = driver.find_element("id", "status")
            assert (cell.text, status.text) == ("C", "UP")
            screenshot(driver, "1-up")
        block_dials(a, b, spec.port)
        blocked_at = time.monotonic()
        try:
            # the next report (every report_interval, 10 s) carries the lost link, after
            # its -N -j collection (a Python stand-in): measured 10.65 s at load average 25
            # from other jobs, 2026-12-02, against the interval + 1 s this had; a missed
            # report would show at 20 s: bound interval + 5 s
            doc, took = wait_domain(
                sbx, spec, lambda d: d.get("status") == "DEGRADED", interval + 5)
            rack.timed("one-way loss: DEGRADED in /domain", measured("e2e.domain.degraded", took))
            assert doc["missing_links"] == [[3, 7]], doc["problems"]
            assert doc["asymmetric_links"] == [[7, 3]]
            assert doc["partitions"] == [list(range(VMS))]
            if driver is not None:
                wait_page(driver, "the blocked link not connected",
                          lambda d: d.find_element(
                              "css selector", '#matrix td[data-from="3"][data-to="7"]'
                          ).text not in ("C", "?"), 3)
                wait_page(driver, "DEGRADED", lambda d: d.find_element(
                    "id", "status").text == "DEGRADED", 3)
                cell = driver.find_element(
                    "css selector", '#matrix td[data-from="3"][data-to="7"]')
                assert "s-C" not in cell.get_attribute("class")
                back = driver.find_element(
                    "css selector", '#matrix td[data-from="7"][data-to="3"]')
                assert back.text == "C"
                assert driver.execute_script("return window.__sameDocument") == 1
                screenshot(driver, "2-degraded")
        finally:
            unblock_dials(a)
        # A's IMEX redials on its own (backing off to 3 s); the next report says so
        doc, took = wait_domain(sbx, spec, _up, 2 * interval + 5)
        rack.timed("one-way loss lifted: UP again in /domain",
                   measured("e2e.domain.up_again", took))
        if driver is not None:
            wait_page(driver, "UP again", lambda d: d.find_element(
                "id", "status").text == "UP" and d.find_element(
                "css selector", '#matrix td[data-from="3"][data-to="7"]').text == "C", 3)
            assert driver.execute_script("return window.__sameDocument") == 1  # no reload
            screenshot(driver, "3-up-again")
    # measured 23.0 s at load average 25 (2026-12-02); the waits above add up to 49 s
    assert measured("e2e.domain.whole_scenario", time.monotonic() - blocked_at) < 6 * interval
    for vm in rack.vms():  # a lost link is IMEX's business: no restart anywhere
        assert (vm.status()["restarts"], vm.imex_state()["starts"]) == restarts[vm.index]
    if why:
        pytest.skip(f"domain view checked; the browser part could not run: {why}")


@pytest.mark.timeout(300)
def test_six_vms_in_another_clique_pin_only_their_own_peers(settled: Rack) -> None:
    rack = settled
    sbx, spec = rack.sbx, rack.spec
    other = {"cluster_uuid": RACK_CLUSTER_UUID, "clique_id": 2}
    moved = list(range(12, VMS))
    stay = {vm.index: vm.imex_state()["starts"] for vm in rack.vms() if vm.index < 12}
    # restarts so far (the migration test restarts its mover once: its own address moved)
    restarts = {vm.index: vm.status()["restarts"] for vm in rack.vms() if vm.index < 12}
    key_a, key_b = f"{RACK_CLUSTER_UUID}.1", f"{RACK_CLUSTER_UUID}.2"
    cliques = {i: key_b if i in moved else key_a for i in range(VMS)}
    try:
        t0 = time.monotonic()
        for i in moved:  # the pool replaces them on another rack
            sbx.fabrics[(spec.namespace, rack.pool.vmi_name(i))] = other
            rack.pool.crash(i)
            rack.pool.restore(i)
        with sbx.diagnostics_on_failure():
            sbx.wait_converged(spec, 150, cliques=cliques)
        rack.timed("six VMs on another clique: each group pins only its own",
                   time.monotonic() - t0)
        for vm in rack.vms():
            block = vm.hosts_block() or {}
            mine = {i for i, c in cliques.items() if c == cliques[vm.index]}
            assert {i for i, ip in block.items() if ip != ABSENT_IP} == mine
            # the moved ones are new VMs; the others' IMEX was told by SIGUSR1, never restarted
            assert vm.status()["restarts"] == restarts.get(vm.index, 0)
            if vm.index in stay:
                assert vm.imex_state()["starts"] == stay[vm.index]
        problems = sbx.registry_json(spec, strict=True)["problems"]
        assert (f"the members span 2 NVLink cliques ({key_a}: members 0-11; {key_b}: "
                f"members 12-17); IMEX works only within a clique, so each member pins only "
                f"its own clique's peers") in problems
        doc, _ = wait_domain(sbx, spec, _up, 2 * sbx.settings.report_interval + 5)
        assert doc["cliques"] == {key_a: list(range(12)), key_b: moved}
        assert doc["partitions"] == [list(range(12)), moved]
        _, served = sbx.registry_get(f"/v1/ensembles/{spec.key}/hosts?member=13")
        assert served == merge_hosts(b"", spec.id, VMS, rack.vm(13).hosts_block() or {})
    finally:
        for i in moved:
            sbx.fabrics.pop((spec.namespace, rack.pool.vmi_name(i)), None)
            rack.pool.crash(i)
            rack.pool.restore(i)
        rack.settle(150)
