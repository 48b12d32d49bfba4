"""The base Deployment's pods on a real kubelet (issue 25 part 2; `make realnode`).

The base kustomization is rendered by the pinned kubectl and applied as rendered, with
two changes only: the image is ``localhost/imex-host-agent:<version>`` (``make image``,
imported into containerd) and ``imagePullPolicy: Never`` (nothing can be pulled here).
The checks, in order: 2 replicas Running and Ready with exactly one leader; the
kubelet enforces the security context (non-root user, read-only root, runAsNonRoot
refusing a root user) and both probes; a ``kubectl rollout restart`` while a client
polls the registry through the Service's cluster IP: no failed request; deleting the
leader's pod: another leads within lease duration + 1.2 x retry period.
"""

from __future__ import annotations

import contextlib
import http.client
import os
import signal
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.realk8s.agentproc import MANIFESTS
from tests.realk8s.harness import Api, wait_until
from tests.realnode.host import sh
from tests.realnode.node import Node

pytestmark = [pytest.mark.realnode, pytest.mark.root]

NS = "imex-system"
NAME = "imex-host-agent"
SELECTOR = "app.kubernetes.io/name=imex-host-agent"
#: the agent's defaults (host_agent/cli.py), which the base Deployment keeps
LEASE_DURATION, RETRY_PERIOD = 15.0, 2.0


def render(node: Node, image: str) -> list[dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(node.cp.kubectl("kustomize", str(MANIFESTS)).stdout)
            if d]
    for doc in docs:
        if doc["kind"] == "Deployment":
            for c in doc["spec"]["template"]["spec"]["containers"]:
                c["image"] = image
                c["imagePullPolicy"] = "Never"
    return docs


def api(node: Node) -> Api:
    assert node.cp.admin is not None
    return node.cp.admin


def pods(node: Node) -> list[dict[str, Any]]:
    items = api(node).ok("GET", f"/api/v1/namespaces/{NS}/pods",
                         params={"labelSelector": SELECTOR})["items"]
    return [p for p in items if not p["metadata"].get("deletionTimestamp")]


def is_ready(pod: dict[str, Any]) -> bool:
    conds = pod.get("status", {}).get("conditions", [])
    return pod.get("status", {}).get("phase") == "Running" and any(
        c["type"] == "Ready" and c["status"] == "True" for c in conds)


def holder(node: Node) -> str:
    lease = api(node).request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{NS}/leases/{NAME}")
    return str(lease.json().get("spec", {}).get("holderIdentity") or "") \
        if lease.status_code == 200 else ""


def leader_metric(pod: dict[str, Any]) -> float:
    text = httpx.get(f"http://{pod['status']['podIP']}:8080/metrics", timeout=3).text
    for line in text.splitlines():
        if line.startswith("imex_host_agent_leader "):
            return float(line.split()[-1])
    return -1.0


def two_ready_one_leader(node: Node) -> bool:
    ps = pods(node)
    if len(ps) != 2 or not all(is_ready(p) for p in ps):
        return False
    names = {p["metadata"]["name"] for p in ps}
    return holder(node) in names and sorted(leader_metric(p) for p in ps) == [0.0, 1.0]


def task_pid(node: Node, pod: dict[str, Any]) -> int:
    """The host PID of the pod's agent process (containerd's task of its container)."""
    cid = pod["status"]["containerStatuses"][0]["containerID"].split("://", 1)[1]
    for line in sh(*node.ctr, "tasks", "ls").stdout.splitlines()[1:]:
        parts = line.split()
        if parts and parts[0] == cid:
            return int(parts[1])
    raise AssertionError(f"no containerd task for {cid}")


@pytest.fixture(scope="module")
def deployed(node: Node, agent_image: str) -> Iterator[Node]:
    docs = render(node, agent_image)
    node.cp.kubectl("apply", "--server-side", "--force-conflicts", "-f", "-",
                    stdin=yaml.safe_dump_all(docs), timeout=120)
    try:
        def why() -> str:
            states = [(p["metadata"]["name"], p.get("status")) for p in pods(node)]
            return f"\npods: {states}{node.procs['kubelet'].tail(30)}"

        wait_until(lambda: two_ready_one_leader(node), "2 replicas Ready, one leader", 240, why)
        yield node
    finally:
        node.cp.kubectl("delete", "-n", NS, "deployment", NAME, "--wait=false", check=False)


def test_two_replicas_running_ready_exactly_one_leads(deployed: Node) -> None:
    ps = pods(deployed)
    assert len(ps) == 2 and all(is_ready(p) for p in ps)
    leaders = [p["metadata"]["name"] for p in ps if leader_metric(p) == 1.0]
    assert leaders == [holder(deployed)]
    print(f"\nrealnode: pods {[(p['metadata']['name'], p['status']['podIP']) for p in ps]}, "
          f"leader {leaders[0]}")


def test_kubelet_enforces_the_security_context(deployed: Node, agent_image: str) -> None:
    pod = pods(deployed)[0]
    name = pod["metadata"]["name"]
    status = Path(f"/proc/{task_pid(deployed, pod)}/status").read_text()
    uid_line = next(line for line in status.splitlines() if line.startswith("Uid:"))
    assert uid_line.split()[1:] == ["65532"] * 4, uid_line
    # readOnlyRootFilesystem: / refuses a write, the /tmp emptyDir takes it
    write = ("import sys\nfor p in sys.argv[1:]:\n"
             "    try:\n        open(p, 'w').write('x'); print(p, 'ok')\n"
             "    except OSError as e:\n        print(p, e.strerror)\n")
    out = deployed.cp.kubectl("exec", "-n", NS, name, "-c", "host-agent", "--", "python",
                              "-c", write, "/probe", "/tmp/probe").stdout
    assert "/probe Read-only file system" in out and "/tmp/probe ok" in out, out
    # runAsNonRoot: the kubelet refuses to start a container asked to run as root. In
    # imex-system Pod Security admission ("restricted") refuses such a pod before any
    # kubelet sees it, so this one goes to a namespace without that label.
    a = api(deployed)
    a.apply("/api/v1/namespaces/realnode-kubelet-check", {
        "apiVersion": "v1", "kind": "Namespace",
        "metadata": {"name": "realnode-kubelet-check"}})
    ns = "realnode-kubelet-check"
    bad = {"apiVersion": "v1", "kind": "Pod",
           "metadata": {"name": "root-refused", "namespace": ns},
           "spec": {"securityContext": {"runAsNonRoot": True, "runAsUser": 0},
                    "containers": [{"name": "c", "image": agent_image,
                                    "imagePullPolicy": "Never", "args": ["--version"]}]}}
    in_ns = {**bad, "metadata": {"name": "root-refused", "namespace": NS}}
    refused_by_admission = a.request("POST", f"/api/v1/namespaces/{NS}/pods", in_ns)
    assert refused_by_admission.status_code == 403, refused_by_admission.text
    assert "PodSecurity" in refused_by_admission.text
    a.create(f"/api/v1/namespaces/{ns}/pods", bad)
    try:
        def refused() -> bool:
            p = a.get(f"/api/v1/namespaces/{ns}/pods/root-refused")
            st = (p.get("status", {}).get("containerStatuses") or [{}])[0]
            waiting = st.get("state", {}).get("waiting", {})
            return waiting.get("reason") == "CreateContainerConfigError" and \
                "non-root" in waiting.get("message", "")
        wait_until(refused, "the kubelet refusing root under runAsNonRoot", 60)
    finally:
        a.request("DELETE", f"/api/v1/namespaces/{ns}/pods/root-refused",
                  params={"gracePeriodSeconds": "0"})


def test_kubelet_enforces_readiness_and_liveness_probes(deployed: Node) -> None:
    """The follower's process stopped (SIGSTOP): readiness goes within a probe period,
    the kubelet restarts the container on liveness; resumed, it is Ready again."""
    ps = pods(deployed)
    follower = next(p for p in ps if p["metadata"]["name"] != holder(deployed))
    name, pid = follower["metadata"]["name"], task_pid(deployed, follower)
    a = api(deployed)
    path = f"/api/v1/namespaces/{NS}/pods/{name}"
    t0 = time.monotonic()
    os.kill(pid, signal.SIGSTOP)
    try:
        wait_until(lambda: not is_ready(a.get(path)), "readiness off", 20)
        not_ready = time.monotonic() - t0

        def liveness_restart() -> bool:
            evs = a.ok("GET", f"/api/v1/namespaces/{NS}/events",
                       params={"fieldSelector": f"involvedObject.name={name}"})["items"]
            return any("liveness probe" in e.get("message", "").lower() and
                       "restart" in e.get("message", "").lower() for e in evs)
        wait_until(liveness_restart, "the kubelet restarting on liveness", 90)
        killed = time.monotonic() - t0
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)  # it then handles the kubelet's SIGTERM
    wait_until(lambda: is_ready(a.get(path)) and
               a.get(path)["status"]["containerStatuses"][0]["restartCount"] >= 1,
               "restarted and Ready", 90)
    print(f"\nrealnode: SIGSTOP -> NotReady {not_ready:.1f}s, -> liveness restart "
          f"{killed:.1f}s, Ready again {time.monotonic() - t0:.1f}s")
    wait_until(lambda: two_ready_one_leader(deployed), "2 Ready, one leader", 60)


class Poller(threading.Thread):
    """GET /v1/ensembles through the Service's cluster IP, a new TCP connection each time
    (so kube-proxy picks an endpoint for every request), every 20 ms."""

    def __init__(self, ip: str, port: int) -> None:
        super().__init__(daemon=True)
        self.ip, self.port, self.stop_event = ip, port, threading.Event()
        self.ok, self.failed = 0, Counter[str]()

    def run(self) -> None:
        while not self.stop_event.is_set():
            conn = http.client.HTTPConnection(self.ip, self.port, timeout=5)
            try:
                conn.request("GET", "/v1/ensembles")
                resp = conn.getresponse()
                resp.read()
                if resp.status == 200:
                    self.ok += 1
                else:
                    self.failed[f"HTTP {resp.status}"] += 1
            except OSError as exc:
                self.failed[type(exc).__name__] += 1
            finally:
                conn.close()
            time.sleep(0.02)


def test_rollout_restart_fails_no_request_through_the_cluster_ip(deployed: Node) -> None:
    svc = api(deployed).get(f"/api/v1/namespaces/{NS}/services/{NAME}")
    poller = Poller(svc["spec"]["clusterIP"], 8080)
    poller.start()
    t0 = time.monotonic()
    try:
        wait_until(lambda: poller.ok > 5, "the poller answered through the cluster IP", 20)
        deployed.cp.kubectl("rollout", "restart", "-n", NS, f"deployment/{NAME}")
        deployed.cp.kubectl("rollout", "status", "-n", NS, f"deployment/{NAME}",
                            "--timeout=300s", timeout=320)
        wait_until(lambda: two_ready_one_leader(deployed), "2 Ready, one leader", 60)
        time.sleep(3)
    finally:
        poller.stop_event.set()
        poller.join(10)
    print(f"\nrealnode: rollout restart: {poller.ok} requests answered, failed "
          f"{dict(poller.failed) or 0}, {time.monotonic() - t0:.0f}s")
    assert not poller.failed, dict(poller.failed)


def test_deleting_the_leaders_pod_hands_over_within_the_bound(deployed: Node) -> None:
    old = holder(deployed)
    others = {p["metadata"]["name"] for p in pods(deployed)} - {old}
    assert old and len(others) == 1
    bound = LEASE_DURATION + 1.2 * RETRY_PERIOD
    t0 = time.monotonic()
    api(deployed).delete(f"/api/v1/namespaces/{NS}/pods/{old}")
    wait_until(lambda: holder(deployed) in others, "the follower leads", bound + 10)
    took = time.monotonic() - t0
    print(f"\nrealnode: leader pod deleted -> {holder(deployed)} leads after {took:.2f}s "
          f"(bound {bound:.1f}s)")
    assert took <= bound
    wait_until(lambda: two_ready_one_leader(deployed), "2 Ready, one leader again", 120)
