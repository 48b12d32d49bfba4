"""Guest agents in network-namespace "VMs" learn their peers from the real CoreDNS.

Three namespaces on a bridge (tests/sandbox/netns.py, prefix ``rk8s``) stand for the
VMs; their VMIs carry the namespaces' addresses, the real host agent publishes the
ensemble's EndpointSlice, and a CoreDNS bound to the fabric's gateway address (the
only address both the namespaces and the apiserver's loopback side can use) serves
it. ``imex-guest-agent once`` runs inside each namespace with no registry, so DNS is
its only source: it must pin every peer in its own /etc/hosts (a bind mount inside
the namespace) and write the ensemble's nodes file.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import dns.flags
import dns.message
import dns.query
import pytest

from imex_shared.hostsfile import read_block
from imex_shared.model import ABSENT_IP, EnsembleId
from imex_shared.render import render_nodes_config
from tests.guest_support.agent import write_config
from tests.realk8s.agentproc import HostAgentProc
from tests.realk8s.fixtures import ensemble_service, vmi
from tests.realk8s.harness import ControlPlane
from tests.realk8s.kubeops import SERVICES, create_vmi, set_vmi_ip, wait_dns
from tests.sandbox.netns import Fabric

pytestmark = [pytest.mark.realk8s, pytest.mark.root]

MAX = 4


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with Fabric("rk8s", nodes=3, gateway=True) as fab:
        yield fab


@pytest.fixture
def gateway_dns(control_plane: ControlPlane, fabric: Fabric) -> Iterator[str]:
    """A CoreDNS of the same control plane, listening on the fabric gateway: "IP:PORT"."""
    assert fabric.gateway_ip is not None
    name = f"coredns-{fabric.tag}"
    try:
        port = control_plane.start_coredns(name, fabric.gateway_ip)
        yield f"{fabric.gateway_ip}:{port}"
    finally:
        control_plane.stop_process(name)


def test_guest_agents_pin_peers_learned_from_real_coredns(
        control_plane: ControlPlane, host_agent: HostAgentProc, fabric: Fabric,
        gateway_dns: str, tmp_path: Path) -> None:
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-guest-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        ens = EnsembleId(ns, "guests")
        admin.create(SERVICES.format(ns=ns), ensemble_service(ns, ens.name, max_members=MAX))
        ips = {i: node.ip for i, node in enumerate(fabric.nodes)}
        for i, ip in ips.items():
            create_vmi(admin, vmi(ns, f"guests-{i}", ens.name, ip=ip, node=f"node-{i}"))
        server, port = gateway_dns.split(":")
        for i, ip in ips.items():
            wait_dns(int(port), ens.slot_fqdn(i) + ".", "A", {ip}, server=server)

        def apply_all() -> None:
            """``once`` in every namespace at the same time; each must succeed."""
            exe = str(Path(sys.executable).with_name("imex-guest-agent"))
            runs = []
            for i, node in enumerate(fabric.nodes):
                cfg = write_config(tmp_path / f"guest-{i}.toml", {
                    "ensemble": ens.name, "namespace": ns, "max_members": MAX,
                    "nameservers": [gateway_dns],
                    "nodes_config": str(tmp_path / f"nodes-{i}.cfg"),
                    "status_file": str(tmp_path / f"status-{i}.json"),
                    "imex_control": "none",
                })
                runs.append(node.popen([exe, "once", "--config", str(cfg)],
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
            for run in runs:
                out, _ = run.communicate(timeout=60)
                assert run.returncode == 0, out

        apply_all()
        want = {**ips, 3: ABSENT_IP}
        for i, node in enumerate(fabric.nodes):
            assert read_block(node.read_hosts().encode(), ens) == want, node.read_hosts()
            nodes_file = (tmp_path / f"nodes-{i}.cfg").read_bytes()
            assert nodes_file == render_nodes_config(ens, MAX, "names", {})

        # A member moves (migration: new address in the fabric); the next pass follows.
        moved = fabric.allocate()
        fabric.nodes[2].set_address(moved)
        set_vmi_ip(admin, ns, "guests-2", moved)
        wait_dns(int(port), ens.slot_fqdn(2) + ".", "A", {moved}, server=server, timeout=60)
        apply_all()
        want[2] = moved
        for node in fabric.nodes:
            assert read_block(node.read_hosts().encode(), ens) == want
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")


def test_full_rack_of_18_through_truncated_udp(
        control_plane: ControlPlane, host_agent: HostAgentProc, tmp_path: Path) -> None:
    """An NVL72 rack is 18 members: CoreDNS's SRV answer no longer fits a plain UDP
    message, so it sets TC and a guest must ask again over TCP. The guest agent, in
    its namespace, must still learn and pin all 18."""
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-rack-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    with Fabric("rk8s", nodes=1, gateway=True) as fab:
        assert fab.gateway_ip is not None
        dns_name = f"coredns-{fab.tag}"
        try:
            ens = EnsembleId(ns, "nvl72")
            admin.create(SERVICES.format(ns=ns), ensemble_service(ns, ens.name, max_members=18))
            node = fab.nodes[0]
            # Member 0 is this namespace; the other 17 addresses are only resolved, never
            # contacted.
            ips = {0: node.ip, **{i: f"{fab.subnet.network_address + 100 + i}"
                                  for i in range(1, 18)}}
            for i, ip in ips.items():
                create_vmi(admin, vmi(ns, f"nvl72-{i}", ens.name, ip=ip, node=f"tray-{i}"))
            port = control_plane.start_coredns(dns_name, fab.gateway_ip)
            srv = ens.srv_name() + "."
            want = {f"0 5 50000 {ens.slot_fqdn(i)}." for i in range(18)}
            wait_dns(port, srv, "SRV", want, server=fab.gateway_ip, timeout=60, tcp=True)
            # Over plain UDP (no EDNS) CoreDNS sends what fits and sets TC.
            plain = dns.query.udp(dns.message.make_query(srv, "SRV"), fab.gateway_ip,
                                  port=port, timeout=2)
            assert plain.flags & dns.flags.TC, "18 SRV records fit a 512-byte answer?"
            assert len([rd for rrset in plain.answer for rd in rrset]) < 18

            cfg = write_config(tmp_path / "guest.toml", {
                "ensemble": ens.name, "namespace": ns, "max_members": 18,
                "nameservers": [f"{fab.gateway_ip}:{port}"],
                "nodes_config": str(tmp_path / "nodes.cfg"),
                "status_file": str(tmp_path / "status.json"),
                "imex_control": "none",
            })
            exe = str(Path(sys.executable).with_name("imex-guest-agent"))
            done = node.run([exe, "once", "--config", str(cfg)], check=False, timeout=60)
            assert done.returncode == 0, (done.stdout, done.stderr)
            assert read_block(node.read_hosts().encode(), ens) == ips
        finally:
            control_plane.stop_process(dns_name)
            admin.delete(f"/api/v1/namespaces/{ns}")
