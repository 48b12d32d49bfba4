"""The DNS stand-in answers as CoreDNS does for a headless Service (FACTS.md), over the wire.

Every socket test queries a real UDP/TCP server on loopback with dnspython's async resolver,
the same client the guest agent uses.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import dns.asyncquery
import dns.asyncresolver
import dns.exception
import dns.flags
import dns.message
import dns.rcode
import dns.rdatatype
import dns.resolver
import pytest

from tests.sandbox.dns_server import (
    BadFailModeError,
    ClusterDnsModel,
    DnsServer,
    ThreadedDnsServer,
    answer_query,
    endpoint_slice,
    follow_kubernetes,
)

ZONE = "cluster.local"
NS = "team-a"
SVC = "ens"
SLOT = "imex-1a2b3c4d"
BASE = f"{SVC}.{NS}.svc.{ZONE}"
SRV = f"_imex._tcp.{BASE}"


def slot(i: int) -> str:
    return f"{SLOT}-{i}.{BASE}"


def members(n: int, first: int = 1) -> dict[str, str | None]:
    return {f"{SLOT}-{i}": f"10.1.0.{first + i}" for i in range(n)}


@pytest.fixture
def model() -> ClusterDnsModel:
    m = ClusterDnsModel(ZONE)
    m.set_members(NS, SVC, members(3))
    return m


@pytest.fixture
async def server(model: ClusterDnsModel) -> AsyncIterator[DnsServer]:
    async with DnsServer(model) as srv:
        yield srv


def resolver(srv: DnsServer, lifetime: float = 2.0) -> dns.asyncresolver.Resolver:
    r = dns.asyncresolver.Resolver(configure=False)
    r.nameservers = [srv.host]
    r.port = srv.port
    r.lifetime = lifetime
    r.timeout = lifetime
    return r


def addrs(answer: dns.resolver.Answer) -> list[str]:
    return sorted(rd.to_text() for rd in answer)


async def test_slot_names_service_name_and_ttl(server: DnsServer) -> None:
    r = resolver(server)
    a = await r.resolve(slot(1), "A")
    assert addrs(a) == ["10.1.0.2"]
    assert a.rrset is not None and a.rrset.ttl == 5
    svc = await r.resolve(BASE, "A")
    assert addrs(svc) == ["10.1.0.1", "10.1.0.2", "10.1.0.3"]
    assert svc.response.flags & dns.flags.AA


async def test_srv_targets_slot_names_with_addresses_in_additional(server: DnsServer) -> None:
    a = await resolver(server).resolve(SRV, "SRV")
    targets = sorted((rd.target.to_text(), rd.port) for rd in a)
    assert targets == [(slot(i) + ".", 50000) for i in range(3)]
    extra = {rr.name.to_text(): [rd.to_text() for rd in rr] for rr in a.response.additional}
    assert extra == {slot(i) + ".": [f"10.1.0.{i + 1}"] for i in range(3)}


async def test_aaaa_from_ipv6_slice_and_nodata_for_other_family(
    model: ClusterDnsModel, server: DnsServer
) -> None:
    model.set_members(NS, SVC, {f"{SLOT}-0": "10.1.0.1", f"{SLOT}-1": "fd00:1::2"})
    r = resolver(server)
    assert addrs(await r.resolve(slot(1), "AAAA")) == ["fd00:1::2"]
    with pytest.raises(dns.resolver.NoAnswer):
        await r.resolve(slot(1), "A")
    srv = await r.resolve(SRV, "SRV")
    assert len(srv) == 2
    # the slices are the ones the host agent writes: one per address family
    names = sorted(s["metadata"]["name"] for s in model.slices())
    assert names == [f"{SVC}-imex", f"{SVC}-imex-v6"]


async def test_unknown_slot_is_nxdomain_with_soa(server: DnsServer) -> None:
    q = dns.message.make_query(slot(7), "A")
    resp = await dns.asyncquery.udp(q, server.host, port=server.port, timeout=2)
    assert resp.rcode() == dns.rcode.NXDOMAIN
    assert [rr.rdtype for rr in resp.authority] == [dns.rdatatype.SOA]
    assert resp.authority[0].ttl == 5


async def test_wrong_type_and_empty_non_terminal_are_nodata(server: DnsServer) -> None:
    for name, rdtype in ((slot(0), "TXT"), (f"{NS}.svc.{ZONE}", "A"), (f"svc.{ZONE}", "A")):
        q = dns.message.make_query(name, rdtype)
        resp = await dns.asyncquery.udp(q, server.host, port=server.port, timeout=2)
        assert resp.rcode() == dns.rcode.NOERROR, name
        assert resp.answer == []
        assert [rr.rdtype for rr in resp.authority] == [dns.rdatatype.SOA]


async def test_not_ready_endpoints_vanish_and_none_ready_is_nxdomain(
    model: ClusterDnsModel, server: DnsServer
) -> None:
    eps: list[dict[str, Any]] = [
        {"addresses": ["10.1.0.1"], "hostname": f"{SLOT}-0", "conditions": {"ready": True}},
        {"addresses": ["10.1.0.2"], "hostname": f"{SLOT}-1", "conditions": {"ready": False}},
        {"addresses": ["10.1.0.3"], "hostname": f"{SLOT}-2"},  # ready absent = ready
    ]
    model.set_endpoint_slices([endpoint_slice(NS, SVC, eps)])
    r = resolver(server)
    assert sorted(rd.target.to_text() for rd in await r.resolve(SRV, "SRV")) == [
        slot(0) + ".", slot(2) + "."]
    with pytest.raises(dns.resolver.NXDOMAIN):
        await r.resolve(slot(1), "A")
    for ep in eps:
        ep["conditions"] = {"ready": False}
    model.set_endpoint_slices([endpoint_slice(NS, SVC, eps)])
    for name, rdtype in ((SRV, "SRV"), (BASE, "A"), (slot(0), "A")):
        with pytest.raises(dns.resolver.NXDOMAIN):
            await r.resolve(name, rdtype)


async def test_endpoint_without_hostname_gets_dashed_name(
    model: ClusterDnsModel, server: DnsServer
) -> None:
    model.set_endpoint_slices([endpoint_slice(NS, SVC, [{"addresses": ["10.1.0.9"]}])])
    srv = await resolver(server).resolve(SRV, "SRV")
    assert [rd.target.to_text() for rd in srv] == [f"10-1-0-9.{BASE}."]


async def test_changes_at_runtime_are_answered_at_once(
    model: ClusterDnsModel, server: DnsServer
) -> None:
    r = resolver(server)
    assert addrs(await r.resolve(slot(2), "A")) == ["10.1.0.3"]
    model.set_members(NS, SVC, {**members(2), f"{SLOT}-2": "10.1.0.99"})
    assert addrs(await r.resolve(slot(2), "A")) == ["10.1.0.99"]
    model.set_members(NS, SVC, members(2))
    with pytest.raises(dns.resolver.NXDOMAIN):
        await r.resolve(slot(2), "A")


async def test_outside_zone_is_refused(server: DnsServer) -> None:
    q = dns.message.make_query("example.com", "A")
    resp = await dns.asyncquery.udp(q, server.host, port=server.port, timeout=2)
    assert resp.rcode() == dns.rcode.REFUSED


async def test_large_answer_truncated_over_udp_and_complete_over_tcp(
    model: ClusterDnsModel, server: DnsServer
) -> None:
    model.set_members(NS, SVC, members(18))
    q = dns.message.make_query(SRV, "SRV")  # no EDNS: 512 bytes
    udp = await dns.asyncquery.udp(q, server.host, port=server.port, timeout=2)
    assert udp.flags & dns.flags.TC
    assert udp.answer == []
    # the resolver sees TC and retries over TCP, as the guest agent relies on
    a = await resolver(server).resolve(SRV, "SRV")
    assert len(a) == 18
    assert len(a.response.additional) == 18
    assert server.transport_count("tcp") >= 1


async def test_edns_payload_size_is_honoured(model: ClusterDnsModel, server: DnsServer) -> None:
    model.set_members(NS, SVC, members(8))
    small = dns.message.make_query(SRV, "SRV")
    big = dns.message.make_query(SRV, "SRV", use_edns=0, payload=4096)
    r1 = await dns.asyncquery.udp(small, server.host, port=server.port, timeout=2)
    r2 = await dns.asyncquery.udp(big, server.host, port=server.port, timeout=2)
    assert r1.flags & dns.flags.TC
    assert not r2.flags & dns.flags.TC and len(r2.answer[0]) == 8


async def test_query_counter_per_name(server: DnsServer) -> None:
    r = resolver(server)
    for _ in range(3):
        await r.resolve(slot(0), "A")
    await r.resolve(SRV, "SRV")
    assert server.query_count(slot(0)) == 3
    assert server.query_count(slot(0) + ".", "A") == 3
    assert server.query_count(SRV, "SRV") == 1
    assert server.query_count(slot(1)) == 0
    assert server.query_counts() == {slot(0): 3, SRV: 1}
    server.reset_counts()
    assert server.total_queries() == 0


# ---- faults


async def test_servfail_and_refused(server: DnsServer) -> None:
    for mode, rcode in (("servfail", dns.rcode.SERVFAIL), ("refused", dns.rcode.REFUSED)):
        server.fail_mode = mode
        q = dns.message.make_query(slot(0), "A")
        resp = await dns.asyncquery.udp(q, server.host, port=server.port, timeout=2)
        assert resp.rcode() == rcode
    server.fail_mode = None
    assert addrs(await resolver(server).resolve(slot(0), "A")) == ["10.1.0.1"]


async def test_timeout_drops_queries(server: DnsServer) -> None:
    server.fail_mode = "timeout"
    with pytest.raises(dns.exception.Timeout):
        await resolver(server, lifetime=0.5).resolve(slot(0), "A")
    assert server.query_count(slot(0)) >= 1


async def test_delay_holds_answers(server: DnsServer) -> None:
    server.delay = 0.6
    with pytest.raises(dns.exception.Timeout):
        await resolver(server, lifetime=0.3).resolve(slot(0), "A")
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    assert addrs(await resolver(server, lifetime=3).resolve(slot(0), "A")) == ["10.1.0.1"]
    assert loop.time() - t0 >= 0.5


async def test_garbage_reply_is_unparseable(server: DnsServer) -> None:
    server.fail_mode = "garbage"
    q = dns.message.make_query(slot(0), "A")
    with pytest.raises(dns.exception.DNSException):
        await dns.asyncquery.udp(q, server.host, port=server.port, timeout=1)


async def test_hostile_addresses(server: DnsServer) -> None:
    r = resolver(server)
    server.fail_mode = "loopback"
    assert addrs(await r.resolve(slot(0), "A")) == ["127.0.0.1"]
    srv = await r.resolve(SRV, "SRV")
    assert {rd.to_text() for rr in srv.response.additional for rd in rr} == {"127.0.0.1"}
    server.fail_mode = "link_local"
    assert addrs(await r.resolve(slot(0), "A")) == ["169.254.1.1"]


async def test_hostile_names(server: DnsServer) -> None:
    r = resolver(server)
    server.fail_mode = "outside_zone"
    srv = await r.resolve(SRV, "SRV")
    assert "evil.example.net." in {rd.target.to_text() for rd in srv}
    server.fail_mode = "out_of_range"
    srv = await r.resolve(SRV, "SRV")
    assert f"{SLOT}-999.{BASE}." in {rd.target.to_text() for rd in srv}
    assert f"{SLOT}-999.{BASE}." in {rr.name.to_text() for rr in srv.response.additional}


async def test_fault_limited_to_some_names(server: DnsServer) -> None:
    server.set_fail_mode("servfail", names=[SRV])
    r = resolver(server)
    with pytest.raises(dns.resolver.NoNameservers):
        await r.resolve(SRV, "SRV")
    assert addrs(await r.resolve(slot(0), "A")) == ["10.1.0.1"]


def test_unknown_fail_mode_is_refused_by_name(model: ClusterDnsModel) -> None:
    srv = DnsServer(model)
    with pytest.raises(BadFailModeError, match="'flaky'"):
        srv.set_fail_mode("flaky")


# ---- data rules, without sockets


def _ask(model: ClusterDnsModel, name: str, rdtype: str) -> dns.message.Message:
    resp = answer_query(model.table, dns.message.make_query(name, rdtype))
    assert resp is not None
    return resp


def test_bad_slices_are_skipped_not_raised() -> None:
    m = ClusterDnsModel(ZONE)
    good = endpoint_slice(NS, SVC, [
        {"addresses": ["not-an-ip", "10.1.0.1"], "hostname": f"{SLOT}-0"},
        {"addresses": ["fd00::1"], "hostname": f"{SLOT}-1"},  # wrong family for the slice
        {"addresses": ["10.1.0.3"], "hostname": "Bad Host.Name"},
    ])
    unlabelled = endpoint_slice(NS, "other", [{"addresses": ["10.9.9.9"], "hostname": "x"}])
    del unlabelled["metadata"]["labels"]
    bad_port = endpoint_slice(NS, "third", [{"addresses": ["10.9.9.8"], "hostname": "y"}])
    bad_port["ports"] = [{"name": "imex", "port": "many"}]
    not_a_list = endpoint_slice(NS, "fourth", [])
    not_a_list["endpoints"] = 7
    m.set_endpoint_slices([good, unlabelled, bad_port, not_a_list])
    assert [rd.to_text() for rd in _ask(m, slot(0), "A").answer[0]] == ["10.1.0.1"]
    assert _ask(m, slot(1), "AAAA").rcode() == dns.rcode.NXDOMAIN
    assert _ask(m, f"x.other.{NS}.svc.{ZONE}", "A").rcode() == dns.rcode.NXDOMAIN
    assert _ask(m, f"y.third.{NS}.svc.{ZONE}", "A").rcode() == dns.rcode.NXDOMAIN
    # the hostname that is not an RFC 1123 label publishes nothing, not even its address
    assert [rd.to_text() for rd in _ask(m, BASE, "A").answer[0]] == ["10.1.0.1"]
    with pytest.raises(TypeError, match="not a Kubernetes object"):
        m.set_endpoint_slices([good, "oops"])  # type: ignore[list-item]
    # refused as a whole: the previous data stays
    assert [rd.to_text() for rd in _ask(m, slot(0), "A").answer[0]] == ["10.1.0.1"]


def test_the_model_keeps_its_own_copy() -> None:
    m = ClusterDnsModel(ZONE)
    eps: list[dict[str, Any]] = [{"addresses": ["10.1.0.1"], "hostname": f"{SLOT}-0"}]
    m.set_endpoint_slices([endpoint_slice(NS, SVC, eps)])
    eps[0]["addresses"] = ["10.6.6.6"]
    m.set_services(None)  # any rebuild
    assert [rd.to_text() for rd in _ask(m, slot(0), "A").answer[0]] == ["10.1.0.1"]


def test_known_services_gate_slices_and_clusterip_answers_vip() -> None:
    m = ClusterDnsModel(ZONE)
    m.set_members(NS, SVC, members(1))
    m.set_services([])  # CoreDNS serves nothing for a Service it does not know
    assert _ask(m, slot(0), "A").rcode() == dns.rcode.NXDOMAIN
    m.upsert_service({"metadata": {"name": SVC, "namespace": NS},
                      "spec": {"clusterIP": "None"}})
    assert _ask(m, slot(0), "A").rcode() == dns.rcode.NOERROR
    m.upsert_service({"metadata": {"name": "api", "namespace": NS},
                      "spec": {"clusterIP": "10.96.0.10",
                               "ports": [{"name": "http", "port": 80, "protocol": "TCP"}]}})
    vip = _ask(m, f"api.{NS}.svc.{ZONE}", "A")
    assert [rd.to_text() for rd in vip.answer[0]] == ["10.96.0.10"]
    srv = _ask(m, f"_http._tcp.api.{NS}.svc.{ZONE}", "SRV")
    assert [rd.to_text() for rd in srv.answer[0]] == [f"0 100 80 api.{NS}.svc.{ZONE}."]
    m.delete_service(NS, SVC)
    assert _ask(m, slot(0), "A").rcode() == dns.rcode.NXDOMAIN


def test_model_is_usable_from_other_threads() -> None:
    m = ClusterDnsModel(ZONE)
    with ThreadedDnsServer(m) as ts:
        m.set_members(NS, SVC, members(2))
        r = dns.resolver.Resolver(configure=False)
        r.nameservers = ["127.0.0.1"]
        r.port = ts.port
        r.lifetime = 2
        assert [rd.to_text() for rd in r.resolve(slot(1), "A")] == ["10.1.0.2"]
        ts.server.fail_mode = "refused"
        with pytest.raises(dns.resolver.NoNameservers):
            r.resolve(slot(1), "A")


# ---- the CLI


async def test_cli_serves_file_and_reloads_it(tmp_path: Path) -> None:
    slices = tmp_path / "slices.json"
    m = ClusterDnsModel(ZONE)
    m.set_members(NS, SVC, members(2))
    slices.write_text(json.dumps(m.slices()))
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "tests.sandbox.dns_server", "--listen", "127.0.0.1:0",
        "--zone", ZONE, "--slices", str(slices),
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
        assert line.startswith("listening 127.0.0.1:")
        port = int(line.rsplit(":", 1)[1])
        r = dns.asyncresolver.Resolver(configure=False)
        r.nameservers, r.port, r.lifetime = ["127.0.0.1"], port, 2
        assert addrs(await r.resolve(slot(1), "A")) == ["10.1.0.2"]
        m.set_members(NS, SVC, {f"{SLOT}-1": "10.1.0.77"})
        slices.write_text(json.dumps({"items": m.slices()}))
        deadline = asyncio.get_running_loop().time() + 10
        while True:
            got = addrs(await r.resolve(slot(1), "A"))
            if got == ["10.1.0.77"] or asyncio.get_running_loop().time() > deadline:
                break
            await asyncio.sleep(0.1)
        assert got == ["10.1.0.77"]
        proc.send_signal(signal.SIGTERM)
        assert await asyncio.wait_for(proc.wait(), 10) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# ---- fed from the Kubernetes API double, as CoreDNS's kubernetes plugin is


async def test_follows_endpointslices_and_services_from_the_api(tmp_path: Path) -> None:
    from lightkube import AsyncClient, KubeConfig
    from lightkube.codecs import from_dict
    from lightkube.resources.core_v1 import Service
    from lightkube.resources.discovery_v1 import EndpointSlice

    from tests.sandbox.kube_api.server import KubeApiServer

    async with KubeApiServer() as api:
        client = AsyncClient(KubeConfig.from_dict(api.kubeconfig()))
        await client.create(from_dict({"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": NS}}))
        await client.create(from_dict({
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": SVC, "namespace": NS},
            "spec": {"clusterIP": "None", "ports": [{"name": "imex", "port": 50000}]}}))
        builder = ClusterDnsModel(ZONE)
        builder.set_members(NS, SVC, members(2))
        await client.create(from_dict(builder.slices()[0]))

        model = ClusterDnsModel(ZONE)
        synced = asyncio.Event()
        async with DnsServer(model) as srv, asyncio.TaskGroup() as tg:
            feeder = tg.create_task(follow_kubernetes(model, client, synced=synced))
            await asyncio.wait_for(synced.wait(), 10)
            r = resolver(srv)
            assert addrs(await r.resolve(slot(1), "A")) == ["10.1.0.2"]

            async def wait_answer(name: str, want: list[str] | None) -> None:
                deadline = asyncio.get_running_loop().time() + 10
                while True:
                    try:
                        got: list[str] | None = addrs(await r.resolve(name, "A"))
                    except dns.resolver.NXDOMAIN:
                        got = None
                    if got == want:
                        return
                    assert asyncio.get_running_loop().time() < deadline, (name, got)
                    await asyncio.sleep(0.05)

            async def replace_slice() -> None:
                current = await client.get(EndpointSlice, f"{SVC}-imex", namespace=NS)
                assert current.metadata is not None
                body = builder.slices()[0]
                body["metadata"]["resourceVersion"] = current.metadata.resourceVersion
                await client.replace(from_dict(body))

            builder.set_members(NS, SVC, {f"{SLOT}-0": "10.1.0.1", f"{SLOT}-1": "10.1.0.50"})
            await replace_slice()
            await wait_answer(slot(1), ["10.1.0.50"])
            # a dropped watch is healed by a relist
            api.drop_watches(abort=True)
            builder.set_members(NS, SVC, {f"{SLOT}-0": "10.1.0.1"})
            await replace_slice()
            await wait_answer(slot(1), None)
            # without its Service CoreDNS serves nothing for the slice
            await client.delete(Service, SVC, namespace=NS)
            await wait_answer(slot(0), None)
            feeder.cancel()
        await client.close()


async def test_cli_follows_a_kubeconfig(tmp_path: Path) -> None:
    from lightkube import AsyncClient, KubeConfig
    from lightkube.codecs import from_dict

    from tests.sandbox.kube_api.server import KubeApiServer

    async with KubeApiServer() as api:
        kubeconfig = api.write_kubeconfig(tmp_path / "kubeconfig")
        client = AsyncClient(KubeConfig.from_dict(api.kubeconfig()))
        await client.create(from_dict({"apiVersion": "v1", "kind": "Namespace",
                                       "metadata": {"name": NS}}))
        await client.create(from_dict({
            "apiVersion": "v1", "kind": "Service", "metadata": {"name": SVC, "namespace": NS},
            "spec": {"clusterIP": "None", "ports": [{"name": "imex", "port": 50000}]}}))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "tests.sandbox.dns_server", "--listen", "127.0.0.1:0",
            "--kubeconfig", str(kubeconfig), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        try:
            assert proc.stdout is not None
            line = (await asyncio.wait_for(proc.stdout.readline(), 20)).decode()
            port = int(line.rsplit(":", 1)[1])
            r = dns.asyncresolver.Resolver(configure=False)
            r.nameservers, r.port, r.lifetime = ["127.0.0.1"], port, 2
            builder = ClusterDnsModel(ZONE)
            builder.set_members(NS, SVC, members(1))
            await client.create(from_dict(builder.slices()[0]))
            deadline = asyncio.get_running_loop().time() + 10
            got: list[str] | None = None
            while asyncio.get_running_loop().time() < deadline:
                try:
                    got = addrs(await r.resolve(slot(0), "A"))
                    break
                except dns.resolver.NXDOMAIN:
                    await asyncio.sleep(0.05)
            assert got == ["10.1.0.1"]
            proc.send_signal(signal.SIGTERM)
            assert await asyncio.wait_for(proc.wait(), 10) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            await client.close()


async def test_listens_on_ipv6_loopback(model: ClusterDnsModel) -> None:
    async with DnsServer(model, host="::1") as srv:
        assert srv.address == f"[::1]:{srv.port}"
        assert addrs(await resolver(srv).resolve(slot(0), "A")) == ["10.1.0.1"]
        q = dns.message.make_query(slot(0), "A")
        tcp = await dns.asyncquery.tcp(q, "::1", port=srv.port, timeout=2)
        assert [rd.to_text() for rd in tcp.answer[0]] == ["10.1.0.1"]
