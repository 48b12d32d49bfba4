"""The DNS stand-in (tests/sandbox/dns_server.py) answers as the real CoreDNS does.

Both get the same Services and EndpointSlices (the stand-in the objects as the real
apiserver stored them), then the same queries over the wire; each answer is reduced to
what a resolver acts on: rcode, the TC bit, the answer records (name, type, TTL, data),
the additional records (name, type, data) and the authority section's record types.
A truncated UDP answer is compared by its TC bit only: its partial content (CoreDNS
sends what fits, the stand-in nothing) is not for use, and a client must ask over TCP.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import pytest

from imex_shared.model import EnsembleId
from tests.realk8s.fixtures import contract_slice, ensemble_service
from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import SERVICES, SLICES, dns_answer
from tests.sandbox.dns_server import ClusterDnsModel, ThreadedDnsServer

pytestmark = pytest.mark.realk8s


def reduce(resp: dns.message.Message, tcp: bool) -> Any:
    truncated = bool(resp.flags & dns.flags.TC)
    if truncated and not tcp:
        return ("TC",)

    def rrs(section: list[Any], ttl: bool) -> list[Any]:
        return sorted((rrset.name.to_text(), dns.rdatatype.to_text(rrset.rdtype),
                       rrset.ttl if ttl else None, rd.to_text())
                      for rrset in section if rrset.rdtype != dns.rdatatype.OPT
                      for rd in rrset)

    return (dns.rcode.to_text(resp.rcode()), truncated, rrs(resp.answer, True),
            rrs(resp.additional, False),
            sorted(dns.rdatatype.to_text(r.rdtype) for r in resp.authority))


def ask(server: str, port: int, name: str, rdtype: str, tcp: bool) -> Any:
    q = dns.message.make_query(name, rdtype)
    query = dns.query.tcp if tcp else dns.query.udp
    return reduce(query(q, server, port=port, timeout=3), tcp)


@pytest.fixture
def published(admin: Api, control_plane: ControlPlane) -> Iterator[tuple[str, list[Any],
                                                                         list[Any]]]:
    """Two ensembles in a fresh namespace: ``ens`` (two ready, one not) and ``big``
    (18 ready). Yields (namespace, services, slices) as stored by the apiserver."""
    ns = f"rk8s-dnsp-{uuid.uuid4().hex[:6]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    try:
        shapes = {"ens": [(0, True), (1, True), (2, False)],
                  "big": [(i, True) for i in range(18)]}
        for n, (name, members) in enumerate(shapes.items()):
            svc = admin.create(SERVICES.format(ns=ns),
                               ensemble_service(ns, name, max_members=18))
            admin.create(SLICES.format(ns=ns), contract_slice(
                EnsembleId(ns, name), svc["metadata"]["uid"],
                [{"index": i, "ip": f"10.50.{n}.{10 + i}", "vmi": f"{name}-{i}",
                  "node": "n", "ready": ready} for i, ready in members]))
        big_last = EnsembleId(ns, "big").slot_fqdn(17) + "."
        wait_until(lambda: dns_answer(control_plane.dns_port, big_last, "A")[1] != [],
                   "CoreDNS serves the fixtures", 30)
        services = admin.get(SERVICES.format(ns=ns))["items"]
        slices = admin.get(SLICES.format(ns=ns))["items"]
        yield ns, services, slices
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")


def test_dns_standin_answers_as_coredns(control_plane: ControlPlane,
                                        published: tuple[str, list[Any], list[Any]]) -> None:
    ns, services, slices = published
    model = ClusterDnsModel(ttl=5)
    model.set_services(services)
    model.set_endpoint_slices(slices)
    ens, big = EnsembleId(ns, "ens"), EnsembleId(ns, "big")
    queries = [
        (ens.slot_fqdn(0), "A"), (ens.slot_fqdn(1), "A"),
        (ens.slot_fqdn(2), "A"),          # not ready
        (ens.slot_fqdn(3), "A"),          # no such endpoint
        (ens.slot_fqdn(0), "AAAA"),       # served name, other type
        (ens.service_fqdn(), "A"),
        (ens.srv_name(), "SRV"),
        (f"_other._tcp.{ens.service_fqdn()}", "SRV"),
        (big.srv_name(), "SRV"),          # 18 records: truncated over UDP
        (big.service_fqdn(), "A"),
        (f"{ns}.svc.cluster.local", "A"),  # empty non-terminal
    ]
    with ThreadedDnsServer(model) as standin:
        diffs = []
        for name, rdtype in queries:
            for tcp in (False, True):
                real = ask("127.0.0.1", control_plane.dns_port, name + ".", rdtype, tcp)
                fake = ask("127.0.0.1", standin.port, name + ".", rdtype, tcp)
                if real != fake:
                    diffs.append(f"{rdtype} {name} over {'TCP' if tcp else 'UDP'}:\n"
                                 f"    CoreDNS:  {real}\n    stand-in: {fake}")
    assert not diffs, "the DNS stand-in disagrees with CoreDNS:\n" + "\n".join(diffs)
