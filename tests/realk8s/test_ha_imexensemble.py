"""Three electing host agents and ImexEnsembles against the real apiserver.

The generation of a CR ensemble lives in the CR's status (issue 16): every replica
serves exactly the pair the status holds; a leader SIGSTOPped past its lease is
replaced, the new leader moves the generation on in the status, and the woken one
writes nothing (the audit log, status subresource included) and serves the newer
pair; a CR adopting a Service that carries an annotation pair keeps its number and
the annotation goes. A sampler reads every replica's generation every 50 ms and
each must only ever go up. Timing is shortened (lease 4 s, renew deadline 3 s,
retry 0.5 s), as in test_ha.py.
"""

from __future__ import annotations

import hashlib
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.realk8s.agentproc import AGENT_USER
from tests.realk8s.fixtures import ensemble_service, vmi
from tests.realk8s.hacluster import HaCluster, Replica
from tests.realk8s.harness import Api, ControlPlane, wait_until
from tests.realk8s.kubeops import SERVICES, create_vmi, set_vmi_ip

pytestmark = pytest.mark.realk8s

LEASE_CFG = (4.0, 3.0, 0.5)
WRITE_VERBS = {"create", "update", "patch", "delete", "deletecollection"}
ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"
MEMBERSHIP = "imex-ensemble.io/membership"
TOKEN_SHA = hashlib.sha256(b"token").hexdigest()


@pytest.fixture(scope="module")
def cluster(control_plane: ControlPlane, imex_crd: dict[str, Any],
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[HaCluster]:
    c = HaCluster(control_plane, tmp_path_factory.mktemp("ha-cr"), lease=LEASE_CFG)
    c.prepare()
    try:
        for _ in range(3):
            c.start()
        yield c
    finally:
        c.close()


def cr_body(ns: str, name: str) -> dict[str, Any]:
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": name, "namespace": ns},
            "spec": {"maxMembers": 4, "tokenSHA256": TOKEN_SHA}}


def status(admin: Api, ns: str, name: str) -> dict[str, Any]:
    r = admin.request("GET", f"{ENS.format(ns=ns)}/{name}")
    return (r.json().get("status") or {}) if r.status_code == 200 else {}


def served(r: Replica, ns: str, name: str) -> int | None:
    try:
        resp = httpx.get(f"{r.url}/v1/ensembles/{ns}/{name}", timeout=2)
    except httpx.HTTPError:
        return None
    return int(resp.json()["generation"]) if resp.status_code == 200 else None


def annotation(admin: Api, ns: str, name: str) -> str | None:
    svc = admin.get(f"{SERVICES.format(ns=ns)}/{name}")
    value = (svc["metadata"].get("annotations") or {}).get(MEMBERSHIP)
    return value if isinstance(value, str) else None


class Sampler:
    """Every live replica's served generation every 50 ms, in a thread."""

    def __init__(self, cluster: HaCluster, ns: str, name: str) -> None:
        self.cluster, self.ns, self.name = cluster, ns, name
        self.seen: dict[str, list[int]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            for r in self.cluster.live():
                g = served(r, self.ns, self.name)
                seq = self.seen.setdefault(r.identity, [])
                if g is not None and (not seq or seq[-1] != g):
                    seq.append(g)
            time.sleep(0.05)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def backwards(self) -> dict[str, list[int]]:
        return {who: seq for who, seq in self.seen.items() if seq != sorted(seq)}


def _of(events: list[dict[str, Any]], identity: str) -> list[dict[str, Any]]:
    return [e for e in events if f"({identity})" in e.get("userAgent", "")]


def test_the_status_holds_the_generation_through_a_fenced_takeover(
        cluster: HaCluster, control_plane: ControlPlane, admin: Api, namespace: str) -> None:
    ns, name = namespace, "cr"
    admin.create(ENS.format(ns=ns), cr_body(ns, name))
    for i in range(3):
        create_vmi(admin, vmi(ns, f"cr-{i}", name, ip=f"10.60.0.{10 + i}"))
    wait_until(lambda: status(admin, ns, name).get("membersPublished") == 3,
               "the status with 3 members", 60)
    gen = status(admin, ns, name)["membershipGeneration"]
    for r in cluster.live():
        wait_until(lambda r=r: served(r, ns, name) == gen, f"{r.identity} serves it", 30)
    assert annotation(admin, ns, name) is None, "the pair lives in the status only"
    with Sampler(cluster, ns, name) as sampler:
        old = cluster.leader()
        mark = control_plane.audit_mark()
        old.signal(signal.SIGSTOP)
        try:
            wait_until(lambda: cluster.holder() not in ("", old.identity),
                       "a follower takes over", LEASE_CFG[0] + 10)
            new_holder = cluster.holder()
            set_vmi_ip(admin, ns, "cr-1", "10.60.1.1")
            wait_until(lambda: status(admin, ns, name).get("membershipGeneration") == gen + 1,
                       "the new leader's generation in status", 30)
            ips = {m["index"]: m["ip"] for m in status(admin, ns, name)["members"]}
            assert ips[1] == "10.60.1.1"
            for r in cluster.live():
                if r is not old:
                    wait_until(lambda r=r: served(r, ns, name) == gen + 1,
                               f"{r.identity} serves it", 30)
        finally:
            old.signal(signal.SIGCONT)
        # the woken replica catches up from the status and writes nothing
        wait_until(lambda: served(old, ns, name) == gen + 1, "the woken one serves it", 30)
        set_vmi_ip(admin, ns, "cr-2", "10.60.1.2")
        wait_until(lambda: status(admin, ns, name).get("membershipGeneration") == gen + 2,
                   "another change", 30)
        for r in cluster.live():
            wait_until(lambda r=r: served(r, ns, name) == gen + 2, f"{r.identity}", 30)
        time.sleep(LEASE_CFG[2] * 6)
    assert sampler.backwards() == {}
    events = control_plane.audit_events(AGENT_USER, after=mark)
    takeover = [e for e in _of(events, new_holder)
                if e["verb"] == "update" and e["objectRef"].get("resource") == "leases"
                and e.get("responseStatus", {}).get("code") == 200]
    assert takeover
    lost_at = takeover[0]["requestReceivedTimestamp"]
    late = [(e["verb"], e["objectRef"].get("resource"), e["objectRef"].get("subresource"))
            for e in _of(events, old.identity)
            if e["verb"] in WRITE_VERBS and e["requestReceivedTimestamp"] >= lost_at]
    assert late == [], f"writes from {old.identity} after it lost the lease"
    status_writes = [e for e in _of(events, new_holder)
                     if e["verb"] == "patch" and e["objectRef"].get("resource") == "imexensembles"
                     and e["objectRef"].get("subresource") == "status"]
    assert status_writes, "the new leader wrote the pair into the status"
    assert annotation(admin, ns, name) is None


def test_a_cr_adopting_an_annotated_service_keeps_its_generation(
        cluster: HaCluster, admin: Api, namespace: str) -> None:
    ns, name = namespace, "adopt"
    admin.create(SERVICES.format(ns=ns), ensemble_service(ns, name, max_members=4))
    for i in range(2):
        create_vmi(admin, vmi(ns, f"adopt-{i}", name, ip=f"10.61.0.{10 + i}"))
    wait_until(lambda: annotation(admin, ns, name) is not None, "the Service's pair", 60)
    wait_until(lambda: len({served(r, ns, name) for r in cluster.live()} - {None}) == 1,
               "one number on every replica", 30)
    gens = {served(r, ns, name) for r in cluster.live()}
    (gen,) = gens
    with Sampler(cluster, ns, name) as sampler:
        admin.create(ENS.format(ns=ns), cr_body(ns, name))
        wait_until(lambda: status(admin, ns, name).get("membershipGeneration") == gen,
                   "the same generation in status", 60)
        wait_until(lambda: annotation(admin, ns, name) is None, "the annotation removed", 30)
        assert {served(r, ns, name) for r in cluster.live()} == {gen}  # nobody woke up
        set_vmi_ip(admin, ns, "adopt-0", "10.61.1.1")
        for r in cluster.live():
            wait_until(lambda r=r: served(r, ns, name) == gen + 1, f"{r.identity}", 30)
        assert status(admin, ns, name)["membershipGeneration"] == gen + 1
    assert sampler.backwards() == {}
