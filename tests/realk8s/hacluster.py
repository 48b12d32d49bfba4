"""Several electing host agents as real processes against the real apiserver.

Shared by tests/realk8s/test_ha.py and the ``ha`` benchmark: every replica is
``python -m tests.sandbox.host_agent_proc`` (the real CLI; only the backoff is
test-sized) with ``--leader-elect``, as the base manifests' ServiceAccount, with the
base ClusterRole and the leader-election Role applied verbatim. Replicas can be
SIGKILLed, SIGSTOPped, SIGCONTed and SIGTERMed; their identities are unique per start
(``ha-<n>``), as pod names are.
"""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.realk8s.agentproc import (
    AGENT_MANIFESTS,
    AGENT_SA,
    AGENT_SA_NAMESPACE,
    apply_base_rbac,
)
from tests.realk8s.harness import ControlPlane, free_port, wait_until

REPO = Path(__file__).resolve().parents[2]
LEASE = f"/apis/coordination.k8s.io/v1/namespaces/{AGENT_SA_NAMESPACE}/leases/imex-host-agent"


def apply_leader_election_role(cp: ControlPlane) -> None:
    """manifests/agent/role-leader-election.yaml as committed (Role + RoleBinding)."""
    admin = cp.admin
    assert admin is not None
    for obj in yaml.safe_load_all((AGENT_MANIFESTS / "role-leader-election.yaml").read_text()):
        if not obj:
            continue
        plural = "roles" if obj["kind"] == "Role" else "rolebindings"
        admin.apply(f"/apis/rbac.authorization.k8s.io/v1/namespaces/{AGENT_SA_NAMESPACE}/"
                    f"{plural}/{obj['metadata']['name']}", obj)


@dataclass
class Replica:
    identity: str
    url: str
    popen: subprocess.Popen[bytes]
    log: Path

    def alive(self) -> bool:
        return self.popen.poll() is None

    def metric(self, name: str) -> float | None:
        try:
            text = httpx.get(f"{self.url}/metrics", timeout=2).text
        except httpx.HTTPError:
            return None
        for line in text.splitlines():
            head, _, value = line.rpartition(" ")
            if head == name:
                return float(value)
        return None

    def signal(self, sig: signal.Signals) -> None:
        if self.alive():
            os.kill(self.popen.pid, sig)


@dataclass
class HaCluster:
    cp: ControlPlane
    workdir: Path
    lease: tuple[float, float, float] = (15.0, 10.0, 2.0)
    listen_host: str = "127.0.0.1"
    extra_args: Sequence[str] = ()
    replicas: list[Replica] = field(default_factory=list)
    started: int = 0
    kubeconfig: Path | None = None

    def prepare(self) -> None:
        apply_base_rbac(self.cp)
        apply_leader_election_role(self.cp)
        token = self.cp.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
        self.kubeconfig = self.cp.write_kubeconfig(self.workdir / "ha.kubeconfig", token,
                                                   AGENT_SA)

    def start(self, port: int | None = None, wait_ready: bool = True) -> Replica:
        assert self.kubeconfig is not None
        self.started += 1
        identity = f"ha-{self.started}"
        port = port or free_port()
        log = self.workdir / f"{identity}.log"
        lease, renew, retry = self.lease
        argv = [sys.executable, "-m", "tests.sandbox.host_agent_proc",
                "--tune", "backoff_initial=0.1", "--tune", "backoff_max=1.0",
                "--kubeconfig", str(self.kubeconfig), "--listen", f"{self.listen_host}:{port}",
                "--json", "--leader-elect", "--identity", identity,
                "--agent-namespace", AGENT_SA_NAMESPACE,
                "--leader-elect-lease-duration", str(lease),
                "--leader-elect-renew-deadline", str(renew),
                "--leader-elect-retry-period", str(retry), *self.extra_args]
        with log.open("ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                     env={**os.environ, "PYTHONPATH": str(REPO)},
                                     start_new_session=True)
        r = Replica(identity, f"http://{self.listen_host}:{port}", popen, log)
        self.replicas.append(r)
        if wait_ready:
            wait_until(lambda: httpx.get(f"{r.url}/readyz", timeout=2).status_code == 200,
                       f"{identity} /readyz", 60, lambda: log.read_text()[-3000:])
        return r

    def live(self) -> list[Replica]:
        return [r for r in self.replicas if r.alive()]

    def holder(self) -> str:
        assert self.cp.admin is not None
        lease: dict[str, Any] = self.cp.admin.get(LEASE)
        return str(lease.get("spec", {}).get("holderIdentity") or "")

    def leader(self, timeout: float = 60) -> Replica:
        """The one live replica whose metric says it leads (and that holds the Lease)."""
        found: list[Replica] = []

        def one() -> bool:
            nonlocal found
            found = [r for r in self.live() if r.metric("imex_host_agent_leader") == 1.0]
            return len(found) == 1 and self.holder() == found[0].identity

        wait_until(one, "exactly one leader", timeout)
        return found[0]

    def stop(self, r: Replica, sig: signal.Signals = signal.SIGTERM, timeout: float = 20) -> None:
        r.signal(sig)
        try:
            r.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            r.signal(signal.SIGKILL)
            r.popen.wait(10)

    def close(self) -> None:
        for r in self.replicas:
            if r.alive():
                r.signal(signal.SIGCONT)
                self.stop(r, timeout=10)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    rank = max(1, min(len(ordered), round(q / 100 * len(ordered) + 0.5)))
    return ordered[rank - 1]


def summary(values: Sequence[float]) -> str:
    return (f"n={len(values)} p50={statistics.median(values):.2f}s "
            f"p99={percentile(values, 99):.2f}s max={max(values):.2f}s")


def now() -> float:
    return time.monotonic()
