"""18 namespace guests long-polling three electing host agents behind one Service address.

Real parts: the apiserver, three host agent processes, CoreDNS on the fabric gateway,
18 real guest agents (``imex-guest-agent run``, IMEX control off) in network namespaces,
and the kube-proxy stand-in (tests/sandbox/balancer.py: nftables DNAT to the ready
replicas, the guest's address kept). Two faults:

- a rolling restart of all three replicas, one by one as a Deployment with maxSurge 1
  and maxUnavailable 0 does it, while a VMI's IP keeps changing: no guest falls back to
  DNS, none misses a generation, none sees the generation go backwards;
- a replica's network disappears (every packet to and from it dropped: no FIN, no RST):
  the guests parked on it re-park on a live replica; the time it takes is printed.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from host_agent.persist.pair import PersistedView, from_service
from tests.guest_support.agent import write_config
from tests.realk8s.fixtures import ensemble_service, vmi
from tests.realk8s.hacluster import HaCluster
from tests.realk8s.harness import ControlPlane, free_port, wait_until
from tests.realk8s.kubeops import SERVICES, create_vmi, set_vmi_ip
from tests.sandbox.balancer import Backend, Balancer
from tests.sandbox.netns import Fabric
from tests.timing import measured

pytestmark = [pytest.mark.realk8s, pytest.mark.root, pytest.mark.timeout(900)]

GUESTS = 18
GHOST = 19  # a member no guest runs: its IP is what the tests change
TOKEN = "ha-guests-token"


@dataclass
class Guest:
    index: int
    popen: subprocess.Popen[bytes]
    log: Path

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log.read_text(errors="replace").splitlines():
            if line.startswith("{"):
                try:
                    out.append(json.loads(line))
                except ValueError:
                    continue
        return out

    def views(self, since: float = 0.0) -> list[tuple[float, str, int | None]]:
        """(time, source, generation) of every view the guest applied."""
        out = []
        for e in self.events():
            msg = str(e.get("msg", ""))
            if msg.startswith("view from ") and float(e.get("ts", 0)) >= since:
                source = msg.split()[2].rstrip(":")
                gen = msg.rsplit("generation ", 1)[-1]
                out.append((float(e["ts"]), source, int(gen) if gen.isdigit() else None))
        return out

    def dns_fallbacks(self, since: float = 0.0) -> list[str]:
        return [str(e["msg"]) for e in self.events() if float(e.get("ts", 0)) >= since and (
            "DNS takes over" in str(e.get("msg")) or "now using dns" in str(e.get("msg")))]


@dataclass
class Rig:
    cp: ControlPlane
    ns: str
    cluster: HaCluster
    lb: Balancer
    guests: list[Guest]
    vip_url: str
    generations: list[int] = field(default_factory=list)

    def pair(self) -> PersistedView | None:
        """The generation pair on the Service (None before the first pass)."""
        assert self.cp.admin is not None
        pair, problem = from_service(self.cp.admin.get(f"{SERVICES.format(ns=self.ns)}/ha"))
        assert problem is None, problem
        return pair

    def persisted(self) -> int:
        pair = self.pair()
        assert pair is not None, "no generation pair on the Service"
        return pair.generation

    def pinned(self) -> int:
        """How many members the persisted view pins (0 before the first pass)."""
        pair = self.pair()
        return len(pair.view.pins) if pair is not None else 0

    def flip(self, ip: str) -> int:
        """Change the ghost member's IP; the new persisted generation."""
        assert self.cp.admin is not None
        before = self.persisted()
        set_vmi_ip(self.cp.admin, self.ns, f"ha-{GHOST}", ip)
        wait_until(lambda: self.persisted() > before, "the next generation", 30)
        gen = self.persisted()
        self.generations.append(gen)
        return gen

    def all_at(self, gen: int, timeout: float = 30) -> None:
        def every() -> bool:
            return all(any(v[2] == gen for v in g.views()) for g in self.guests)
        wait_until(every, f"every guest at generation {gen}", timeout,
                   lambda: str({g.index: g.views()[-1:] for g in self.guests}))


@pytest.fixture(scope="module")
def rig(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    admin = control_plane.admin
    assert admin is not None
    work = tmp_path_factory.mktemp("ha-guests")
    with Fabric("rkha", nodes=GUESTS, gateway=True) as fabric:
        gw = fabric.gateway_ip
        assert gw is not None
        dns_name = f"coredns-{fabric.tag}"
        dns_port = control_plane.start_coredns(dns_name, gw)
        cluster = HaCluster(control_plane, work, lease=(4.0, 3.0, 0.5), listen_host=gw)
        lb: Balancer | None = None
        guests: list[Guest] = []
        ns = f"rk8s-hag-{uuid.uuid4().hex[:6]}"
        try:
            cluster.prepare()
            for _ in range(3):
                cluster.start()
            vip_port = free_port()
            lb = Balancer.over(gw, vip_port, [(gw, int(r.url.rsplit(":", 1)[1]))
                                              for r in cluster.replicas], period=0.2, timeout=0.5)
            lb.start()
            admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                "metadata": {"name": ns}})
            svc = ensemble_service(ns, "ha", max_members=GHOST + 1)
            svc["metadata"]["annotations"]["imex-ensemble.io/token-sha256"] = hashlib.sha256(
                TOKEN.encode()).hexdigest()
            admin.create(SERVICES.format(ns=ns), svc)
            for i, node in enumerate(fabric.nodes):
                create_vmi(admin, vmi(ns, f"ha-{i}", "ha", ip=node.ip, index=i))
            create_vmi(admin, vmi(ns, f"ha-{GHOST}", "ha", ip="10.77.0.1", index=GHOST))
            token = work / "token"
            token.write_text(TOKEN)
            vip_url = f"http://{gw}:{vip_port}"
            for i, node in enumerate(fabric.nodes):
                d = work / f"g{i}"
                d.mkdir()
                cfg = write_config(d / "config.toml", {
                    "ensemble": "ha", "namespace": ns, "max_members": GHOST + 1,
                    "registry_url": vip_url, "token_file": str(token),
                    "nameservers": [f"{gw}:{dns_port}"], "own_index": i,
                    "nodes_config": str(d / "nodes_config.cfg"),
                    "status_file": str(d / "status.json"), "imex_control": "none",
                    "poll_interval": 1.0, "dns_timeout": 0.5, "longpoll_timeout": 10.0})
                log = d / "agent.log"
                with log.open("ab") as out:
                    popen = node.popen([sys.executable, "-m", "guest_agent.cli", "run",
                                        "--config", str(cfg), "--json"],
                                       stdout=out, stderr=subprocess.STDOUT)
                guests.append(Guest(i, popen, log))
            r = Rig(control_plane, ns, cluster, lb, guests, vip_url)
            # every member pinned first: under load the leader publishes the 19 VMIs in
            # several passes, and a guest started after the last one never applies the
            # generation of an earlier pass (it waited for one and timed out, both tests
            # of this module then erroring in setup)
            wait_until(lambda: r.pinned() == GUESTS + 1, f"{GUESTS + 1} members pinned", 60,
                       lambda: f"{r.pinned()} pinned")
            r.all_at(r.persisted(), 120)
            yield r
        finally:
            for g in guests:
                g.popen.send_signal(signal.SIGTERM)
            for g in guests:
                try:
                    g.popen.wait(10)
                except subprocess.TimeoutExpired:
                    g.popen.kill()
            if lb is not None:
                lb.close()
            cluster.close()
            control_plane.stop_process(dns_name)
            admin.delete(f"/api/v1/namespaces/{ns}")


def test_rolling_restart_of_every_replica_under_18_long_polling_guests(rig: Rig) -> None:
    t0 = time.time()
    start_gen = rig.persisted()
    stop = threading.Event()
    errors: list[BaseException] = []

    def churn() -> None:
        k = 0
        try:
            while not stop.is_set():
                k += 1
                rig.flip(f"10.77.{k // 250}.{k % 250 + 2}")
                stop.wait(2.0)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    changer = threading.Thread(target=churn, daemon=True)
    changer.start()
    old = list(rig.cluster.live())
    for replica in old:  # maxSurge 1, maxUnavailable 0: the new one first
        new = rig.cluster.start()
        host, port = new.url.split("//")[1].rsplit(":", 1)
        rig.lb.backends.append(Backend(host, int(port)))
        wait_until(lambda: len(rig.lb.backends) - 1 in rig.lb.ready(), "new replica in", 30)
        rig.cluster.stop(replica)  # SIGTERM: readiness off, lease released, polls answered
        time.sleep(3.0)
    time.sleep(3.0)
    stop.set()
    changer.join(30)
    assert not errors, errors
    last = rig.generations[-1]
    rig.all_at(last, 30)
    assert len(rig.generations) >= 6, rig.generations
    problems = {}
    for g in rig.guests:
        views = g.views(since=t0)
        gens = [v[2] for v in views if v[1] == "registry"]
        fell_back = g.dns_fallbacks(since=t0)
        missed = [x for x in rig.generations if x not in gens]
        backwards = [(a, b) for a, b in itertools.pairwise(gens) if b <= a]
        dns_views = [v for v in views if v[1] != "registry"]
        if fell_back or missed or backwards or dns_views:
            problems[g.index] = {"dns": fell_back + [str(v) for v in dns_views],
                                 "missed": missed, "backwards": backwards}
    print(f"\nrealk8s ha: rolling restart of 3 replicas, 18 guests, generations "
          f"{start_gen}..{last} ({len(rig.generations)} changes): "
          f"{len(problems)} guests with DNS fallbacks, missed or backward generations")
    assert problems == {}, problems


def test_a_replica_whose_network_vanishes_loses_its_long_polls_within_seconds(rig: Rig) -> None:
    rig.all_at(rig.persisted(), 30)
    victim = len(rig.lb.backends) - 1
    while victim >= 0 and not rig.cluster.replicas[victim].alive():
        victim -= 1
    assert victim >= 0
    wait_until(lambda: sum(r.metric("imex_registry_longpoll_waiters") or 0
                           for r in rig.cluster.live()) >= len(rig.guests),
               "every guest parked somewhere", 30)
    # the scenario, not an event: the parked polls age 2 s, so those on the victim end
    # (longpoll_timeout 10 s) within 8 s of the partition and re-park on a live replica
    time.sleep(2.0)
    t0 = time.time()
    rig.lb.partition(victim)
    # keep changing: a guest parked on a live replica sees each change at once; one
    # parked on the dead replica only after its connection is given up and re-parked
    flips: list[tuple[float, int]] = []
    for k in range(12):
        flips.append((time.time(), rig.flip(f"10.78.0.{k + 2}")))
        time.sleep(1.0)
    rig.all_at(flips[-1][1], 30)
    first_seen = {}
    for g in rig.guests:
        views = [v for v in g.views(since=t0) if v[1] == "registry"]
        first_seen[g.index] = views[0][0] - t0 if views else float("inf")
    fallbacks = {g.index: g.dns_fallbacks(since=t0) for g in rig.guests if g.dns_fallbacks(t0)}
    stuck = sorted(t for t in first_seen.values() if t > 2.0)
    print(f"\nrealk8s ha: replica network gone: {len(stuck)} guests re-parked after "
          f"{', '.join(f'{t:.1f}' for t in stuck)} s (others within 2 s); "
          f"DNS fallbacks: {fallbacks or 'none'}")
    # measured max 7.8 s, 7.8 s beside stress-ng and 8.2 s beside stress-ng and another
    # test run (4 runs, 2026-12-02): 8 s of aged long-poll plus a re-park; bound 10 s
    assert measured("realk8s.ha.partitioned_reparked", max(first_seen.values())) <= 10.0, \
        first_seen
    rig.lb.partition(victim, on=False)
