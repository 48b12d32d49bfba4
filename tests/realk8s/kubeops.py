"""Small I/O helpers the realk8s tests share: writing VMIs as virt-controller does,
reading slices, and asking CoreDNS over the wire until it answers what is expected."""

from __future__ import annotations

import copy
from typing import Any

import dns.message
import dns.query
import dns.rdatatype

from tests.realk8s.harness import Api, wait_until

VMIS = "/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"
SLICES = "/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
SERVICES = "/api/v1/namespaces/{ns}/services"


def create_vmi(api: Api, body: dict[str, Any]) -> dict[str, Any]:
    """Create the VMI, then write its status through /status (the user creates the
    spec; virt-controller and virt-handler fill status through the subresource)."""
    ns = body["metadata"]["namespace"]
    spec_only = copy.deepcopy(body)
    status = spec_only.pop("status", None)
    created: dict[str, Any] = api.create(VMIS.format(ns=ns), spec_only)
    if status is None:
        return created
    created["status"] = status
    out: dict[str, Any] = api.ok(
        "PUT", f"{VMIS.format(ns=ns)}/{body['metadata']['name']}/status", created)
    return out


def set_vmi_ip(api: Api, ns: str, name: str, ip: str) -> None:
    """A migration or restart: the VMI's interface gets a new address (status patch)."""
    api.ok("PATCH", f"{VMIS.format(ns=ns)}/{name}/status",
           {"status": {"interfaces": [{"name": "default", "ipAddress": ip,
                                       "ipAddresses": [ip]}]}},
           content_type="application/merge-patch+json")


def dns_answer(port: int, name: str, rdtype: str, server: str = "127.0.0.1",
               tcp: bool = False) -> tuple[int, list[Any]]:
    """One query over UDP (or TCP): (rcode, answer rdatas of ``rdtype``)."""
    q = dns.message.make_query(name, rdtype)
    query = dns.query.tcp if tcp else dns.query.udp
    resp = query(q, server, port=port, timeout=2)
    want = dns.rdatatype.from_text(rdtype)
    return resp.rcode(), [rd for rrset in resp.answer if rrset.rdtype == want for rd in rrset]


def wait_dns(port: int, name: str, rdtype: str, want: set[str], timeout: float = 30,
             server: str = "127.0.0.1", tcp: bool = False) -> None:
    """Until CoreDNS answers ``name`` with exactly the rdatas ``want`` (text form);
    an empty ``want`` means: until the name has no such records."""
    seen: list[Any] = []

    def matches() -> bool:
        nonlocal seen
        _, seen = dns_answer(port, name, rdtype, server, tcp)
        return {rd.to_text() for rd in seen} == want

    wait_until(matches, f"{rdtype} {name} == {sorted(want)}", timeout,
               lambda: f"; last answer {[rd.to_text() for rd in seen]}")


def wait_namespace_absent(api: Api, ns: str, timeout: float = 90) -> None:
    """A namespace another test deleted may still be terminating (the namespace
    controller empties it first); nothing can be created in it until it is gone."""
    wait_until(lambda: api.request("GET", f"/api/v1/namespaces/{ns}").status_code == 404,
               f"namespace {ns} to finish terminating", timeout)
