"""VMI -> member: every KubeVirt quirk of FACTS.md as a schema-checked fixture.

Each quirk is one VMI (validated against KubeVirt's OpenAPI schema) with the
exact endpoint it must produce in the EndpointSlice, or the problem an
operator reads instead. A final test puts all of them in one ensemble and
compares the whole slices, byte for byte as JSON.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import pytest

from host_agent.ensembles.members import derive_members, examine_vmi
from host_agent.ensembles.service_spec import parse_ensemble_service
from host_agent.ensembles.slices import desired_slices
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId
from tests.host_support.kubevirt import service, validate_vmi, vmi

ENS = EnsembleId("rack1", "gb200")
SPEC = EnsembleSpec(ENS, max_members=64, port=50000, uid="svc-uid-1")
SPEC_NET = EnsembleSpec(ENS, max_members=64, port=50000, network="imex-net", uid="svc-uid-1")


def _ref(name: str) -> dict[str, str]:
    return {
        "apiVersion": "kubevirt.io/v1",
        "kind": "VirtualMachineInstance",
        "name": name,
        "namespace": "rack1",
    }


def ep(
    index: int, ip: str, name: str | None = None, *, ready: bool = True, node: str | None = "node-a"
) -> dict[str, Any]:
    vmi_name = name or f"gb200-{index}"
    out: dict[str, Any] = {
        "addresses": [ip],
        "conditions": {"ready": ready},
        "hostname": ENS.slot(index),
    }
    if node:
        out["nodeName"] = node
    out["targetRef"] = _ref(vmi_name)
    return out


@dataclass(frozen=True)
class Quirk:
    id: str
    vmi: dict[str, Any]
    endpoint: dict[str, Any] | None = None  # exact endpoint expected, or
    problem: str | None = None  # a fragment of the problem expected (None: silent)
    spec: EnsembleSpec = SPEC


def _iface(name: str | None, ip: str | None, ips: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"mac": "02:00:00:00:00:02", "infoSource": "domain"}
    if name is not None:
        out["name"] = name
    if ip is not None:
        out["ipAddress"] = ip
    if ips is not None:
        out["ipAddresses"] = ips
    return out


def _migrating(name: str, ip: str, node: str) -> dict[str, Any]:
    obj = vmi(name, ip=ip, node=node)
    obj["status"]["activePods"] = {"uid-src": "node-a", "uid-dst": "node-b"}
    obj["status"]["migrationState"] = {
        "sourceNode": "node-a",
        "targetNode": "node-b",
        "completed": False,
        "migrationUid": "m-1",
    }
    return obj


QUIRKS = [
    Quirk("plain", vmi("gb200-0", ip="10.244.0.10"), ep(0, "10.244.0.10")),
    Quirk("prefix-stripped", vmi("gb200-1", ip="10.244.0.23/24"), ep(1, "10.244.0.23")),
    Quirk(
        "masquerade-flip-10.0.2.2",
        vmi("gb200-2", ip="10.0.2.2", ips=["10.0.2.2"]),
        problem="VMI gb200-2 reports only the guest-internal 10.0.2.2",
    ),
    Quirk(
        "masquerade-v6-guest-internal",
        vmi("gb200-3", ip="fd10:0:2::2", ips=["fd10:0:2::2"]),
        problem="VMI gb200-3 reports only the guest-internal fd10:0:2::2",
    ),
    Quirk(
        "ipAddress-internal-but-ipAddresses-has-pod-ip",
        vmi("gb200-4", ip="10.0.2.2", ips=["10.0.2.2", "10.244.1.4"]),
        ep(4, "10.244.1.4"),
    ),
    Quirk(
        "missing-ipAddress-on-first-start",
        vmi("gb200-5", interfaces=[_iface("default", None)]),
        problem="VMI gb200-5 has no IP address on network 'default' yet",
    ),
    Quirk(
        "running-without-interfaces",
        vmi("gb200-6"),
        problem="VMI gb200-6 has no interfaces in its status yet",
    ),
    Quirk(
        "dual-stack-first-is-v4",
        vmi("gb200-7", ip="10.244.0.7", ips=["10.244.0.7", "fd00:10:244::7"]),
        ep(7, "10.244.0.7"),
    ),
    Quirk(
        "ipv6-only-pod-network",
        vmi("gb200-8", ip="fd00:10:244::8/64", ips=["fd00:10:244::8/64"]),
        ep(8, "fd00:10:244::8"),
    ),
    Quirk(
        "secondary-network-from-annotation",
        vmi(
            "gb200-9",
            interfaces=[
                _iface("default", "10.244.0.9", ["10.244.0.9"]),
                _iface("imex-net", "192.168.50.9/24", ["192.168.50.9/24"]),
            ],
        ),
        ep(9, "192.168.50.9"),
        spec=SPEC_NET,
    ),
    Quirk(
        "annotation-network-missing-on-vmi",
        vmi("gb200-10", ip="10.244.0.10"),
        problem="VMI gb200-10 has no network 'imex-net'",
        spec=SPEC_NET,
    ),
    Quirk(
        "no-default-interface-first-wins",
        vmi(
            "gb200-11",
            interfaces=[
                _iface("nvlink", "192.168.60.11", ["192.168.60.11"]),
                _iface("mgmt", "172.16.0.11", ["172.16.0.11"]),
            ],
        ),
        ep(11, "192.168.60.11"),
    ),
    Quirk(
        "guest-agent-only-interface-without-name-skipped-for-default",
        vmi(
            "gb200-12",
            interfaces=[
                _iface(None, "172.17.0.1", ["172.17.0.1"]),
                _iface("default", "10.244.0.12", ["10.244.0.12"]),
            ],
        ),
        ep(12, "10.244.0.12"),
    ),
    Quirk(
        "link-local-and-loopback-refused",
        vmi("gb200-13", ip="169.254.1.13", ips=["169.254.1.13", "fe80::13", "127.0.0.1"]),
        problem="VMI gb200-13 has no usable IP address on network 'default': "
        "169.254.1.13 is a link-local address",
    ),
    Quirk(
        "phase-scheduling-holds-slot-silently",
        vmi("gb200-14", phase="Scheduling", ip=None, node=None, ready=None),
    ),
    Quirk("phase-pending", vmi("gb200-15", phase="Pending", ready=False)),
    Quirk("being-deleted", vmi("gb200-16", ip="10.244.0.16", deleting=True)),
    Quirk("succeeded", vmi("gb200-17", phase="Succeeded", ip="10.244.0.17", ready=False)),
    Quirk("failed", vmi("gb200-18", phase="Failed", ip="10.244.0.18", ready=False)),
    Quirk(
        "not-ready-published-not-ready",
        vmi("gb200-19", ip="10.244.0.19", ready=False),
        ep(19, "10.244.0.19", ready=False),
    ),
    Quirk(
        "no-conditions-not-ready",
        vmi("gb200-20", ip="10.244.0.20", ready=None),
        ep(20, "10.244.0.20", ready=False),
    ),
    Quirk(
        "no-nodeName",
        vmi("gb200-21", ip="10.244.0.21", node=None),
        ep(21, "10.244.0.21", node=None),
    ),
    Quirk(
        "live-migration-publishes-reported-ip",
        _migrating("gb200-22", "10.244.3.22", "node-a"),
        ep(22, "10.244.3.22"),
    ),
    Quirk(
        "index-label-wins-over-name",
        vmi("worker-x", index="23", ip="10.244.0.23"),
        ep(23, "10.244.0.23", name="worker-x"),
    ),
    Quirk(
        "index-label-leading-zero",
        vmi("gb200-24", index="024", ip="10.244.0.24"),
        problem="VMI gb200-24 label imex-ensemble.io/index='024' is not a slot number",
    ),
    Quirk(
        "index-label-not-numeric",
        vmi("gb200-25", index="three", ip="10.244.0.25"),
        problem="label imex-ensemble.io/index='three' is not a slot number",
    ),
    Quirk(
        "replicaset-random-suffix",
        vmi("gb200-rs-x7k2p", ip="10.244.0.26"),
        problem="VMI gb200-rs-x7k2p has no imex-ensemble.io/index label and its name does "
        "not end in -<n>",
    ),
    Quirk(
        "name-index-leading-zero",
        vmi("gb200-033", ip="10.244.0.33"),
        problem="its name does not end in -<n> (a number without leading zeros)",
    ),
    Quirk(
        "unnamed-guest-agent-interface-first-then-named",
        vmi(
            "gb200-34",
            interfaces=[
                _iface(None, "172.17.0.1", ["172.17.0.1"]),
                _iface("nvlink", "192.168.60.34", ["192.168.60.34"]),
            ],
        ),
        ep(34, "192.168.60.34"),
    ),
    Quirk(
        "only-unnamed-interface",
        vmi("gb200-35", interfaces=[_iface(None, "10.244.0.35", ["10.244.0.35"])]),
        ep(35, "10.244.0.35"),
    ),
    Quirk(
        "index-out-of-range",
        vmi("gb200-64", ip="10.244.0.64"),
        problem="slot index 64 is out of range: the ensemble has 64 slots",
    ),
    Quirk("no-status-at-all", vmi("gb200-27", status=False)),
    Quirk("empty-status", vmi("gb200-28", phase=None, node=None, ready=None)),
    Quirk(
        "name-not-a-dns-label",
        vmi("GB200_29", index="29", ip="10.244.0.29"),
        problem="VMI GB200_29: VMI name 'GB200_29' is not a lowercase RFC 1123 label",
    ),
    Quirk(
        "unparseable-address",
        vmi("gb200-30", ip="not-an-ip", ips=["not-an-ip"]),
        problem="'not-an-ip' is not an IP address",
    ),
    Quirk("phase-unknown-holds-slot", vmi("gb200-31", phase="Unknown", ip="10.244.0.31")),
    Quirk(
        "ipv4-mapped-v6-refused",
        vmi("gb200-32", ip="::ffff:10.244.0.32", ips=["::ffff:10.244.0.32"]),
        problem="IPv4-mapped",
    ),
]


@pytest.mark.parametrize("q", QUIRKS, ids=[q.id for q in QUIRKS])
def test_quirk_fixture_is_a_valid_kubevirt_vmi(q: Quirk) -> None:
    validate_vmi(q.vmi)


@pytest.mark.parametrize("q", QUIRKS, ids=[q.id for q in QUIRKS])
def test_quirk_gives_exact_endpoint_or_problem(q: Quirk) -> None:
    members, problems = derive_members(q.spec, [q.vmi])
    snap, _ = State().set(q.spec, members, problems)
    slices = desired_slices(snap)
    endpoints = [e for body in slices.values() if body for e in body["endpoints"]]
    if q.endpoint is not None:
        assert endpoints == [q.endpoint]
        assert problems == []
    else:
        assert endpoints == []
        assert all(body is None for body in slices.values())
        if q.problem is None:
            assert problems == []
        else:
            assert len(problems) == 1, problems
            assert q.problem in problems[0]


def test_all_quirks_in_one_ensemble_give_exact_slices() -> None:
    default_net = [q for q in QUIRKS if q.spec is SPEC]
    members, problems = derive_members(SPEC, [q.vmi for q in default_net])
    snap, _ = State().set(SPEC, members, problems)
    slices = desired_slices(snap)
    v4 = sorted(
        (q.endpoint for q in default_net if q.endpoint and ":" not in q.endpoint["addresses"][0]),
        key=lambda e: int(e["hostname"].rsplit("-", 1)[1]),
    )
    v6 = [q.endpoint for q in default_net if q.endpoint and ":" in q.endpoint["addresses"][0]]
    owner = [
        {
            "apiVersion": "v1",
            "kind": "Service",
            "name": "gb200",
            "uid": "svc-uid-1",
            "controller": True,
            "blockOwnerDeletion": True,
        }
    ]
    labels = {
        "kubernetes.io/service-name": "gb200",
        "endpointslice.kubernetes.io/managed-by": "host-agent.imex-ensemble.io",
    }
    port = [{"name": "imex", "port": 50000, "protocol": "TCP"}]
    expected = {
        "gb200-imex": {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "gb200-imex",
                "namespace": "rack1",
                "labels": labels,
                "ownerReferences": owner,
            },
            "addressType": "IPv4",
            "endpoints": v4,
            "ports": port,
        },
        "gb200-imex-v6": {
            "apiVersion": "discovery.k8s.io/v1",
            "kind": "EndpointSlice",
            "metadata": {
                "name": "gb200-imex-v6",
                "namespace": "rack1",
                "labels": labels,
                "ownerReferences": owner,
            },
            "addressType": "IPv6",
            "endpoints": v6,
            "ports": port,
        },
    }
    assert json.dumps(slices, sort_keys=True) == json.dumps(expected, sort_keys=True)
    expected_problems = sum(1 for q in default_net if q.problem)
    assert len(problems) == expected_problems


def test_duplicate_live_slot_publishes_neither_and_names_both() -> None:
    a = vmi("gb200-2", ip="10.244.0.2")
    b = vmi("other-vm", index="2", ip="10.244.0.99")
    c = vmi("gb200-3", ip="10.244.0.3")
    members, problems = derive_members(SPEC, [a, b, c])
    assert [m.index for m in members] == [3]
    assert problems == [
        "slot 2 is claimed by 2 live VMIs (gb200-2, other-vm); publishing neither until "
        "only one is left"
    ]


def test_duplicate_with_a_pending_vmi_still_blocks_the_slot() -> None:
    running = vmi("gb200-2", ip="10.244.0.2")
    pending = vmi("spare", index="2", phase="Pending", ready=False)
    members, problems = derive_members(SPEC, [running, pending])
    assert members == []
    assert "slot 2 is claimed by 2 live VMIs (gb200-2, spare)" in problems[0]


def test_duplicate_resolves_when_one_is_deleting_or_finished() -> None:
    running = vmi("gb200-2", ip="10.244.0.2")
    for other in (
        vmi("spare", index="2", ip="10.244.0.9", deleting=True),
        vmi("spare", index="2", phase="Failed", ip="10.244.0.9"),
    ):
        members, problems = derive_members(SPEC, [running, other])
        assert [(m.index, m.ip) for m in members] == [(2, "10.244.0.2")]
        assert problems == []


def test_live_migration_switches_ip_and_node_when_kubevirt_reports_it() -> None:
    state = State()
    before = _migrating("gb200-0", "10.244.1.5", "node-a")
    snap1, _ = state.set(SPEC, *derive_members(SPEC, [before]))
    after = vmi("gb200-0", ip="10.244.7.5", node="node-b")
    validate_vmi(after)
    snap2, changed = state.set(SPEC, *derive_members(SPEC, [after]))
    assert changed and snap2.generation == snap1.generation + 1
    (body,) = [b for b in desired_slices(snap2).values() if b]
    assert body["endpoints"] == [ep(0, "10.244.7.5", node="node-b")]


def test_member_fields() -> None:
    c = examine_vmi(vmi("gb200-4", ip="10.244.0.4/16", node="n9", ready=True), SPEC)
    assert c.member is not None
    assert (
        c.member.index,
        c.member.ip,
        c.member.vmi,
        c.member.node,
        c.member.phase,
        c.member.ready,
    ) == (4, "10.244.0.4", "gb200-4", "n9", "Running", True)


@pytest.mark.parametrize(
    ("mutate", "fragment"),
    [
        (lambda v: v["status"].update(interfaces="eth0"), "status.interfaces is not a list"),
        (lambda v: v["status"].update(interfaces=[None, 3, "x"]), "has no IP address"),
        (
            lambda v: v["status"]["interfaces"][0].update(ipAddress=None, ipAddresses="10.1.1.1"),
            "no IP address",
        ),
        (
            lambda v: v["status"]["interfaces"][0].update(ipAddress=17, ipAddresses=[17]),
            "17 (not a string)",
        ),
        (lambda v: v["status"].update(conditions="Ready"), None),
        (lambda v: v.update(status=None), None),
        (lambda v: v["metadata"].update(labels=None), "cannot tell which slot"),
        (
            lambda v: v["metadata"].update(labels={"imex-ensemble.io/index": 5}),
            "imex-ensemble.io/index=5 is not a string",
        ),
        (lambda v: v.update(metadata=[]), "<unnamed>"),
    ],
)
def test_malformed_vmis_become_problems_never_exceptions(mutate: Any, fragment: str | None) -> None:
    bad = vmi("oddball", index="1", ip="10.244.0.1")
    mutate(bad)
    good = vmi("gb200-0", ip="10.244.0.50")
    members, problems = derive_members(SPEC, [bad, good])
    assert 0 in [m.index for m in members]  # the rest is still published
    if fragment is None:
        assert problems == [] or all("oddball" in p for p in problems)
    else:
        assert any(fragment in p for p in problems), problems


def test_members_from_service_spec_roundtrip() -> None:
    spec, problems = parse_ensemble_service(
        service(annotations={"imex-ensemble.io/max-members": "4"})
    )
    assert spec is not None and problems == []
    members, problems = derive_members(
        spec, [vmi("gb200-3", ip="10.0.0.3"), vmi("gb200-4", ip="10.0.0.4")]
    )
    assert [m.index for m in members] == [3]
    assert "slot index 4 is out of range: the ensemble has 4 slots (0..3)" in problems[0]


def test_vmi_addresses_collects_every_usable_address_of_every_interface() -> None:
    from host_agent.ensembles.members import vmi_addresses

    vmi = {
        "metadata": {"name": "gb200-1"},
        "status": {
            "interfaces": [
                {
                    "name": "default",
                    "ipAddress": "10.244.1.7/24",
                    "ipAddresses": ["10.244.1.7", "fd00:10:244::7", "10.0.2.2"],
                },
                {"name": "imex", "ipAddress": "192.168.50.11", "ipAddresses": ["192.168.50.11"]},
                {"interfaceName": "lo", "ipAddresses": ["127.0.0.1", "fe80::1"]},
                "not-an-interface",
                {"name": "junk", "ipAddress": 17, "ipAddresses": ["garbage"]},
            ]
        },
    }
    assert vmi_addresses(vmi) == {"10.244.1.7", "fd00:10:244::7", "192.168.50.11"}
    assert vmi_addresses({"metadata": {"name": "x"}}) == frozenset()


def test_derive_gives_each_published_member_every_address_its_vmi_reports() -> None:
    """The registry accepts a member's report from any of its addresses; the pass takes
    them from the derivation (examined once per VMI version), and a VMI that is not
    published (a shared slot, no address) has none there."""
    from host_agent.ensembles.members import derive

    two = vmi("gb200-2", interfaces=[
        {"name": "default", "ipAddress": "10.0.0.2", "ipAddresses": ["10.0.0.2"]},
        {"name": "imex", "ipAddress": "192.168.50.2"}])
    derived = derive(SPEC, [vmi("gb200-1", ip="10.0.0.1"), two,
                            vmi("gb200-3", ip="10.0.0.3"),
                            vmi("other-3", index="3", ip="10.0.0.33"),
                            vmi("gb200-4", ip=None)])
    assert [m.index for m in derived.members] == [1, 2]
    assert derived.addresses == {1: {"10.0.0.1"}, 2: {"10.0.0.2", "192.168.50.2"}}


def test_examine_memo_reuses_a_verdict_only_for_the_same_object_and_spec() -> None:
    from dataclasses import replace as dc_replace

    from host_agent.ensembles.members import ExamineMemo, examine_vmi

    spec = EnsembleSpec(EnsembleId("rack1", "gb200"), 18, 50000)
    memo = ExamineMemo()
    a = vmi("gb200-1", ip="10.244.0.2")
    assert memo(a, spec) is not memo(a, spec)  # no resourceVersion: examined every time
    assert len(memo) == 0
    a["metadata"]["resourceVersion"] = "7"
    first = memo(a, spec)
    assert first == examine_vmi(a, spec)
    assert memo(dict(a), spec) is first  # same version, same spec: not re-examined
    moved = vmi("gb200-1", ip="10.244.9.2")  # a change comes with a new version
    moved["metadata"]["resourceVersion"] = "8"
    assert memo(moved, spec).member.ip == "10.244.9.2"  # type: ignore[union-attr]
    smaller = dc_replace(spec, max_members=1)  # slot 1 no longer fits
    assert memo(moved, smaller).member is None
    assert len(memo) == 1
    memo.forget("rack1", "gb200-1")
    assert len(memo) == 0
    vmis = [vmi(f"gb200-{i}", ip=f"10.244.0.{i + 1}") for i in range(4)] + [
        vmi("dup-2", index="2", ip="10.244.0.99")]
    for n, v in enumerate(vmis):
        v["metadata"]["resourceVersion"] = str(100 + n)
    assert derive_members(spec, vmis, memo) == derive_members(spec, vmis)
    assert derive_members(spec, vmis, memo) == derive_members(spec, vmis)  # from the memo
