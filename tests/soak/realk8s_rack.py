"""The realk8s soak's rack: the real etcd and kube-apiserver, three electing host agents,
two ensembles of VMIs, and guests' reports sent as real PUTs.

TEST CODE for ``make soak-realk8s`` (tests/soak/realk8s.py). The control plane is
tests/realk8s/harness.py's (etcd, kube-apiserver with the audit log, the committed
ImexEnsemble CRD); the replicas are tests/realk8s/hacluster.py's (the real CLI as the
base manifests' ServiceAccount, RBAC applied verbatim, test-sized Lease 4 s / 3 s /
0.5 s). Ensemble ``a`` is a hand-made Service, ``b`` an ImexEnsemble. The VMIs are
written as virt-controller would (spec, then status through /status); there are no
guests, so :class:`Reporter` plays their reporting side: every member PUTs its status to
a live replica in turn, from its own address (``--trusted-proxy 127.0.0.1/32`` and
X-Forwarded-For, as tests/realk8s/test_imexensemble_agent.py), with ``signals`` counting
up so that every report is news and is stored in the API.
"""

from __future__ import annotations

import contextlib
import hashlib
import random
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.realk8s.agentproc import CRD_MANIFESTS
from tests.realk8s.crd import kubevirt_openapi
from tests.realk8s.fixtures import ensemble_service, vmi
from tests.realk8s.hacluster import HaCluster, Replica
from tests.realk8s.harness import Api, ControlPlane, build_binaries
from tests.realk8s.kubeops import SERVICES, VMIS, create_vmi, set_vmi_ip

NAMESPACE = "soak-rk8s"
NAMES = {"a": "gb200", "b": "gb300"}
#: members per ensemble (the slots are the agent's to assign)
SIZE = 3
LEASE_CFG = (4.0, 3.0, 0.5)
REPLICAS = 3
TOKEN = "soak-rk8s-guest-token"
TOKEN_SHA = hashlib.sha256(TOKEN.encode()).hexdigest()
ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"
MEMBERSHIP = "imex-ensemble.io/membership"
#: seconds after its 2xx answer by which every replica shows a report (docs/host-agent.md
#: "Guest reports across replicas": one watch event, 2 s in the quiet tests; loaded here)
REPORT_BOUND_S = 5.0
#: seconds between two reports of one member (a guest's report_interval is 10 s; this is
#: denser so that reports race the faults)
REPORT_EVERY_S = 3.0


def get_json(url: str, timeout: float = 2.0) -> Any:
    """A replica's JSON, or None when it does not answer 200."""
    try:
        r = httpx.get(url, timeout=timeout)
    except httpx.HTTPError:
        return None
    return r.json() if r.status_code == 200 else None


@dataclass
class Sent:
    """One member's reports: the last number sent, and the recent ones answered 2xx."""

    sent: int = 0
    #: (answered at, number, the address it came from), the newest last
    oks: list[tuple[float, int, str]] = field(default_factory=list)
    refused: int = 0

    def owed(self, ip: str, before: float) -> int | None:
        """The newest report from ``ip`` answered 2xx before ``before``: every replica
        must show it (or a later one) from then on."""
        return max((n for t, n, at in self.oks if at == ip and t <= before), default=None)


@dataclass
class Rack:
    workdir: Path
    cp: ControlPlane | None = None
    ha: HaCluster | None = None
    #: VMI name -> (ensemble key, current address; "" while deleted)
    vmis: dict[str, tuple[str, str]] = field(default_factory=dict)
    #: replicas the schedule stopped (SIGSTOP) or killed on purpose
    stopped: set[str] = field(default_factory=set)
    killed: set[str] = field(default_factory=set)
    addresses: int = 0

    @property
    def admin(self) -> Api:
        assert self.cp is not None and self.cp.admin is not None
        return self.cp.admin

    # ---- lifecycle
    def start(self) -> None:
        self.cp = ControlPlane(bin_dir=build_binaries(), vmi_openapi=kubevirt_openapi(),
                               workdir=self.workdir / "plane", audit_leases=True)
        self.cp.workdir.mkdir(parents=True, exist_ok=True)
        self.cp.start(api_only=True)
        self.cp.apply_crd(yaml.safe_load((CRD_MANIFESTS / "crd-imexensembles.yaml").read_text()))
        self.ha = HaCluster(self.cp, self.workdir, lease=LEASE_CFG,
                            extra_args=("--trusted-proxy", "127.0.0.1/32"))
        self.ha.prepare()
        for _ in range(REPLICAS):
            self.ha.start()
        self.admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                                 "metadata": {"name": NAMESPACE}})
        svc = ensemble_service(NAMESPACE, NAMES["a"], max_members=SIZE + 2)
        svc["metadata"]["annotations"]["imex-ensemble.io/token-sha256"] = TOKEN_SHA
        self.admin.create(SERVICES.format(ns=NAMESPACE), svc)
        self.admin.create(ENS.format(ns=NAMESPACE), {
            "apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": NAMES["b"], "namespace": NAMESPACE},
            "spec": {"maxMembers": SIZE + 2, "tokenSHA256": TOKEN_SHA}})
        for key, name in NAMES.items():
            for i in range(SIZE):
                self.create_vmi(f"{name}-{i}", key)

    def close(self) -> None:
        if self.ha is not None:
            for r in self.ha.replicas:
                r.signal(signal.SIGCONT)
            self.ha.close()
        if self.cp is not None:
            self.cp.stop()

    # ---- members
    def new_address(self, key: str) -> str:
        self.addresses += 1
        n = self.addresses
        return f"10.{40 + list(NAMES).index(key)}.{n // 250}.{n % 250 + 2}"

    def create_vmi(self, name: str, key: str) -> None:
        ip = self.new_address(key)
        create_vmi(self.admin, vmi(NAMESPACE, name, NAMES[key], ip=ip))
        self.vmis[name] = (key, ip)

    def migrate(self, name: str) -> None:
        key, _ = self.vmis[name]
        ip = self.new_address(key)
        set_vmi_ip(self.admin, NAMESPACE, name, ip)
        self.vmis[name] = (key, ip)

    def delete_vmi(self, name: str) -> None:
        key, _ = self.vmis[name]
        self.admin.ok("DELETE", f"{VMIS.format(ns=NAMESPACE)}/{name}")
        self.vmis[name] = (key, "")

    def expected(self, key: str) -> dict[str, str]:
        """VMI name -> address of the ensemble's running members."""
        return {n: ip for n, (k, ip) in self.vmis.items() if k == key and ip}

    # ---- replicas
    def running(self) -> list[Replica]:
        """Live replicas that are not SIGSTOPped."""
        assert self.ha is not None
        return [r for r in self.ha.live() if r.identity not in self.stopped]

    def holder(self) -> str:
        assert self.ha is not None
        try:
            return self.ha.holder()
        except Exception:
            return ""

    def view(self, r: Replica, key: str) -> dict[str, Any] | None:
        doc = get_json(f"{r.url}/v1/ensembles/{NAMESPACE}/{NAMES[key]}")
        return doc if isinstance(doc, dict) else None

    def api_generation(self, key: str) -> int | None:
        """The persisted generation: the Service's annotation (a), the CR's status (b);
        None when the API does not answer or holds none."""
        from host_agent.persist.pair import from_service, pair_from_status

        with contextlib.suppress(Exception):
            if key == "b":
                r = self.admin.request("GET", f"{ENS.format(ns=NAMESPACE)}/{NAMES['b']}")
                pair, _ = pair_from_status(r.json().get("status") if r.status_code == 200
                                           else None)
            else:
                r = self.admin.request("GET", f"{SERVICES.format(ns=NAMESPACE)}/{NAMES['a']}")
                if r.status_code != 200:
                    return None
                pair, _ = from_service(r.json())
            return pair.generation if pair is not None else None
        return None

    def cr_status(self) -> dict[str, Any] | None:
        r = self.admin.request("GET", f"{ENS.format(ns=NAMESPACE)}/{NAMES['b']}")
        return (r.json().get("status") or {}) if r.status_code == 200 else None

    def api_up(self) -> bool:
        try:
            return self.admin.request("GET", "/readyz").status_code == 200
        except Exception:
            return False


@dataclass
class Reporter:
    """The guests' reporting side, in a thread: each member in turn PUTs ``signals`` + 1
    to a random running replica, from its own address, and waits for the answer (as a
    guest does) before its next report."""

    rack: Rack
    seed: int
    sent: dict[str, Sent] = field(default_factory=dict)
    answers: dict[int, int] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="reporter", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)

    def _run(self) -> None:
        rnd = random.Random(f"{self.seed}:reports")
        with httpx.Client(timeout=8.0) as client:
            while not self._stop.is_set():
                t0 = time.monotonic()
                for name in sorted(self.rack.vmis):
                    if self._stop.is_set():
                        return
                    self._one(client, rnd, name)
                self._stop.wait(max(0.0, REPORT_EVERY_S - (time.monotonic() - t0)))

    def _one(self, client: httpx.Client, rnd: random.Random, name: str) -> None:
        key, ip = self.rack.vmis[name]
        replicas = self.rack.running()
        if not ip or not replicas:
            return
        r = rnd.choice(replicas)
        doc = self.rack.view(r, key) or {}
        index = next((m["index"] for m in doc.get("members") or () if m.get("vmi") == name
                      and m.get("ip") == ip), None)
        if index is None:
            return  # not published (yet) at this address: a guest would wait too
        s = self.sent.setdefault(name, Sent())
        n = s.sent + 1
        s.sent = n
        try:
            resp = client.put(
                f"{r.url}/v1/ensembles/{NAMESPACE}/{NAMES[key]}/members/{index}/status",
                headers={"Authorization": f"Bearer {TOKEN}", "X-Forwarded-For": ip},
                json={"imex_state": "READY", "generation_applied": doc.get("generation"),
                      "signals": n})
            code = resp.status_code
        except httpx.HTTPError:
            code = 0
        self.answers[code] = self.answers.get(code, 0) + 1
        if 200 <= code < 300 and self.rack.vmis[name][1] == ip:
            s.oks = [*s.oks[-7:], (time.time(), n, ip)]
        else:
            s.refused += 1
