"""The shared cluster of the peers benchmark: real control plane, real CoreDNS, one fabric.

TEST HARNESS, never product code. Both sides of issue 18 run on this one cluster in one
run, one after the other:

* etcd, kube-apiserver and the VMI CRD as tests/realk8s builds them
  (:class:`tests.realk8s.harness.ControlPlane`), with an audit policy that records only
  what the clocks need: status writes and deletions of pods and VMIs, with the time each
  request reached the apiserver (``requestReceivedTimestamp``, microseconds);
* kube-controller-manager with issue 18's three controllers, endpointslice,
  garbage-collector and namespace (:data:`CONTROLLERS`, the names v1.37 takes): the
  EndpointSlice controller publishes the recipe's pods, and no node lifecycle controller
  taints the Node objects (:meth:`Cluster.ensure_nodes`) that nothing heartbeats;
* CoreDNS with kubeadm's Corefile, verbatim from kubeadm's source at the pinned
  Kubernetes version (:mod:`tests.bench.peers.corefile`), the one deviation being
  ``forward`` to a local sink (:class:`DnsSink`). It runs in a network namespace of its
  own on the fabric, so ``.:53``, ``:8080``, ``:8181`` and ``:9153`` are kubeadm's
  ports, and it reaches the apiserver as a pod does: in-cluster configuration
  (``KUBERNETES_SERVICE_HOST``/``PORT``, a ServiceAccount token and CA under
  ``/var/run/secrets/kubernetes.io/serviceaccount`` in a private mount namespace), the
  RBAC being kubeadm's ``system:coredns`` ClusterRole from the same source file; the
  apiserver's loopback port is relayed into the namespace (:class:`TcpRelay`);
* a network-namespace fabric (:class:`tests.sandbox.netns.Fabric`) whose gateway in the
  root namespace also carries the registry of the host agent, when a side runs one.

Teardown (:meth:`Cluster.close`) runs every step even when one fails.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import select
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdatatype
import httpx

from tests.bench.peers.corefile import KubeadmCoreDNS, load_kubeadm_coredns, with_forward_to
from tests.bench.peers.measure import AuditEvent, parse_audit
from tests.realk8s.agentproc import AGENT_SA, AGENT_SA_NAMESPACE, apply_base_rbac
from tests.realk8s.crd import kubevirt_openapi
from tests.realk8s.hacluster import apply_leader_election_role
from tests.realk8s.harness import (
    Api,
    ControlPlane,
    HarnessError,
    Proc,
    build_binaries,
    free_port,
    wait_until,
)
from tests.sandbox.netns import Fabric, Node, in_netns

log = logging.getLogger("bench.peers")

#: issue 18's controller list (endpointslice, garbage-collector, namespace) as
#: kube-controller-manager v1.37 names them: it refuses the short names
#: ("garbage-collector" is not in the list of known controllers)
CONTROLLERS = "endpointslice-controller,garbage-collector-controller,namespace-controller"
#: where the forward deviation sends names outside the cluster zone (inside CoreDNS's netns)
SINK = ("127.0.0.1", 1053)
SA_DIR = "/var/run/secrets/kubernetes.io/serviceaccount"
HOST_AGENT = Path(sys.executable).with_name("imex-host-agent")


class PeersControlPlane(ControlPlane):
    """The realk8s control plane with an audit log of exactly the clock events."""

    def _audit_policy(self) -> Path:
        path = self.workdir / "audit-policy.json"
        path.write_text(json.dumps({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived", "ResponseStarted"],
            "rules": [
                {"level": "Metadata", "verbs": ["update", "patch", "delete"],
                 "resources": [
                     {"group": "", "resources": ["pods", "pods/status"]},
                     {"group": "kubevirt.io",
                      "resources": ["virtualmachineinstances",
                                    "virtualmachineinstances/status"]}]},
                {"level": "None"},
            ]}))
        return path


class TcpRelay:
    """Accept TCP connections on ``listen`` inside network namespace ``netns`` and relay
    each to ``target`` in the root namespace (the apiserver on loopback), byte for byte.

    Threads: one accepting, two per connection; the listening socket is created inside
    the namespace and keeps it, the outgoing ones are created by threads that never
    entered it.
    """

    def __init__(self, netns: str, listen: tuple[str, int], target: tuple[str, int]) -> None:
        self.target = target
        with in_netns(netns):
            self.sock = socket.create_server(listen)
        self._stop = threading.Event()
        self._conns: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, name="api-relay", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.sock], [], [], 0.2)
            if not ready:
                continue
            try:
                inner, _ = self.sock.accept()
                outer = socket.create_connection(self.target, timeout=10)
                outer.settimeout(None)
            except OSError as e:
                log.warning("api relay: %s", e)
                continue
            self._conns += [inner, outer]
            for a, b in ((inner, outer), (outer, inner)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                dst.sendall(data)
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                dst.shutdown(socket.SHUT_WR)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.sock.close()
        for c in self._conns:
            with contextlib.suppress(OSError):
                c.close()


class DnsSink:
    """The stated deviation's target: a DNS server that answers NXDOMAIN to everything
    (an upstream that knows none of the names), on UDP and TCP inside CoreDNS's netns,
    and counts what reached it (names outside the cluster zone)."""

    def __init__(self, netns: str, addr: tuple[str, int]) -> None:
        with in_netns(netns):
            self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.udp.bind(addr)
            self.tcp = socket.create_server(addr)
        self.queries = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="dns-sink", daemon=True)
        self._thread.start()

    @staticmethod
    def answer(wire: bytes) -> bytes | None:
        try:
            q = dns.message.from_wire(wire)
        except Exception:
            return None
        r = dns.message.make_response(q)
        r.set_rcode(dns.rcode.NXDOMAIN)
        r.flags |= dns.flags.RA
        return r.to_wire()

    def _serve(self) -> None:
        while not self._stop.is_set():
            ready, _, _ = select.select([self.udp, self.tcp], [], [], 0.2)
            for s in ready:
                with contextlib.suppress(OSError):
                    if s is self.udp:
                        wire, peer = self.udp.recvfrom(65535)
                        self.queries += 1
                        out = self.answer(wire)
                        if out:
                            self.udp.sendto(out, peer)
                    else:
                        conn, _ = self.tcp.accept()
                        with conn:
                            conn.settimeout(2)
                            n = int.from_bytes(conn.recv(2), "big")
                            wire = conn.recv(n)
                            self.queries += 1
                            out = self.answer(wire)
                            if out:
                                conn.sendall(len(out).to_bytes(2, "big") + out)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.udp.close()
        self.tcp.close()


class Cluster:
    """Control plane + CoreDNS + fabric for one benchmark run (see the module docstring)."""

    def __init__(self, prefix: str = "prs", keep_logs: Path | None = None) -> None:
        self.prefix = prefix
        #: copy the components' logs (apiserver, controller manager, CoreDNS, host agent)
        #: here at close, before the control plane's work directory goes
        self.keep_logs = keep_logs
        self.cp: PeersControlPlane | None = None
        self.fabric: Fabric | None = None
        self.dns_node: Node | None = None
        self.relay: TcpRelay | None = None
        self.sink: DnsSink | None = None
        self.coredns: Proc | None = None
        self.kubeadm: KubeadmCoreDNS | None = None
        self.corefile = ""
        self.host_agent: Proc | None = None
        self.registry_port = 0
        self.startup: dict[str, float] = {}
        self._audit_pos = 0
        self._audit_events: list[AuditEvent] = []

    # ---- lifecycle
    def __enter__(self) -> Cluster:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        t0 = time.monotonic()
        self.kubeadm = load_kubeadm_coredns()
        bin_dir = build_binaries()
        self.cp = PeersControlPlane(bin_dir=bin_dir, vmi_openapi=kubevirt_openapi(),
                                    controllers=CONTROLLERS)
        self.cp.start(api_only=True)
        t = time.monotonic()
        self.cp._start_controller_manager()
        self.startup["controller_manager"] = time.monotonic() - t
        self.fabric = Fabric(self.prefix, gateway=True)
        self.dns_node = self.fabric.add_node("dns")
        t = time.monotonic()
        self._start_coredns()
        self.startup["coredns"] = time.monotonic() - t
        self.startup.update({k: round(v, 2) for k, v in self.cp.startup_seconds.items()})
        self.startup["cluster_total"] = time.monotonic() - t0

    def close(self) -> None:
        steps = [("host agent", self.stop_host_agent),
                 ("coredns", lambda: self.coredns.stop(grace=7) if self.coredns else None),
                 ("sink", lambda: self.sink.close() if self.sink else None),
                 ("relay", lambda: self.relay.close() if self.relay else None),
                 ("fabric", lambda: self.fabric.close() if self.fabric else None),
                 ("logs", self._keep_logs),
                 ("control plane", lambda: self.cp.stop() if self.cp else None)]
        for what, step in steps:
            try:
                step()
            except Exception as e:  # teardown goes on
                log.warning("teardown of %s failed: %s", what, e)

    def _keep_logs(self) -> None:
        if self.keep_logs is not None and self.cp is not None:
            shutil.copytree(self.cp.workdir / "logs", self.keep_logs / "cluster-logs",
                            dirs_exist_ok=True)

    @property
    def api(self) -> Api:
        assert self.cp is not None and self.cp.admin is not None
        return self.cp.admin

    @property
    def dns_ip(self) -> str:
        assert self.dns_node is not None
        return self.dns_node.ip

    # ---- CoreDNS
    def _start_coredns(self) -> None:
        cp, node, kubeadm = self.cp, self.dns_node, self.kubeadm
        assert cp is not None and node is not None and kubeadm is not None
        # kubeadm's ClusterRole for CoreDNS, from the same source file as the Corefile
        token = cp.service_account_token("kube-system", "coredns", kubeadm.rules,
                                         cluster_role="system:coredns")
        sa = cp.workdir / "coredns-sa"
        sa.mkdir(exist_ok=True)
        (sa / "token").write_text(token)
        shutil.copy(cp.ca, sa / "ca.crt")
        (sa / "namespace").write_text("kube-system")
        self.corefile = with_forward_to(kubeadm.corefile, f"{SINK[0]}:{SINK[1]}")
        corefile = cp.workdir / "Corefile"
        corefile.write_text(self.corefile)
        api_port = int(cp.server.rsplit(":", 1)[1])
        self.relay = TcpRelay(node.name, ("127.0.0.1", api_port), ("127.0.0.1", api_port))
        self.sink = DnsSink(node.name, SINK)
        script = (f"set -e; mount -t tmpfs -o mode=0755 tmpfs /run; mkdir -p {SA_DIR}; "
                  f'cp "$0"/token "$0"/ca.crt "$0"/namespace {SA_DIR}/; '
                  'exec "$1" -conf "$2"')
        env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": str(api_port)}
        self.coredns = cp._spawn("coredns", [
            "ip", "netns", "exec", node.name, "unshare", "--mount", "--propagation", "private",
            "sh", "-c", script, str(sa), str(cp.bin_dir / "coredns"), str(corefile)], env=env)
        ready = f"http://{node.ip}:8181/ready"
        cp._await(self.coredns, "CoreDNS /ready (kubeadm's ready plugin)",
                  lambda: httpx.get(ready, timeout=2).status_code == 200, 90)

    def coredns_metrics(self) -> str:
        r = httpx.get(f"http://{self.dns_ip}:9153/metrics", timeout=10)
        r.raise_for_status()
        return r.text

    def ask(self, name: str, rdtype: str = "A", timeout: float = 1.0) -> list[str]:
        """CoreDNS's answer for ``name`` (absolute), as addresses; [] for none or no answer."""
        q = dns.message.make_query(name.rstrip(".") + ".", rdtype)
        try:
            resp = dns.query.udp(q, self.dns_ip, port=53, timeout=timeout)
        except (OSError, dns.exception.Timeout):
            return []
        want = dns.rdatatype.from_text(rdtype)
        return sorted(rd.to_text() for rrset in resp.answer if rrset.rdtype == want
                      for rd in rrset)

    # ---- API objects shared by the sides
    def ensure_namespace(self, ns: str) -> None:
        api = self.api
        api.apply(f"/api/v1/namespaces/{ns}",
                  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        # the serviceaccount controller is not running: pods need their SA to exist
        api.apply(f"/api/v1/namespaces/{ns}/serviceaccounts/default",
                  {"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": "default", "namespace": ns}})

    def ensure_nodes(self, names: list[str]) -> None:
        """Node objects for the pods' and VMIs' nodeNames (the EndpointSlice controller
        skips pods on a node it does not know). Nothing taints them: node lifecycle is
        not among the controllers."""
        for name in names:
            self.api.apply(f"/api/v1/nodes/{name}",
                           {"apiVersion": "v1", "kind": "Node",
                            "metadata": {"name": name,
                                         "labels": {"kubernetes.io/hostname": name}}})

    def delete_namespace(self, ns: str, timeout: float = 120) -> None:
        self.api.delete(f"/api/v1/namespaces/{ns}")
        wait_until(lambda: self.api.request("GET", f"/api/v1/namespaces/{ns}").status_code
                   == 404, f"namespace {ns} to go", timeout)

    # ---- audit log
    def audit(self) -> list[AuditEvent]:
        """Every clock event so far (read incrementally)."""
        assert self.cp is not None
        try:
            with open(self.cp.audit_log, "rb") as f:
                f.seek(self._audit_pos)
                data = f.read()
        except FileNotFoundError:
            return self._audit_events
        end = data.rfind(b"\n") + 1
        self._audit_pos += end
        self._audit_events += parse_audit(data[:end].decode(errors="replace").splitlines())
        return self._audit_events

    def received_at(self, user_agent: str, timeout: float = 10) -> float:
        """When the request sent with ``user_agent`` reached the apiserver (audit log)."""
        from tests.bench.peers.measure import received_at
        deadline = time.monotonic() + timeout
        while True:
            t = received_at(self.audit(), user_agent)
            if t is not None:
                return t
            if time.monotonic() > deadline:
                raise HarnessError(f"no audit event for user agent {user_agent!r}")
            time.sleep(0.02)

    # ---- host agent (ours and the floor)
    @property
    def registry_url(self) -> str:
        assert self.fabric is not None and self.fabric.gateway_ip is not None
        return f"http://{self.fabric.gateway_ip}:{self.registry_port}"

    def start_host_agent(self) -> None:
        """``imex-host-agent`` as the base manifests' ServiceAccount and Roles, production
        settings, its registry on the fabric's gateway address (the guests' way to it)."""
        cp, fabric = self.cp, self.fabric
        assert cp is not None and fabric is not None and fabric.gateway_ip is not None
        if self.host_agent is not None and self.host_agent.alive():
            return
        apply_base_rbac(cp)
        apply_leader_election_role(cp)  # the Lease and the reports' ConfigMaps
        token = cp.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
        kc = cp.write_kubeconfig(cp.workdir / "host-agent.kubeconfig", token, AGENT_SA)
        self.registry_port = free_port()
        self.host_agent = cp._spawn("host-agent", [
            str(HOST_AGENT), "--kubeconfig", str(kc),
            "--listen", f"{fabric.gateway_ip}:{self.registry_port}", "--json"])
        cp._await(self.host_agent, "host agent /readyz",
                  lambda: httpx.get(f"{self.registry_url}/readyz", timeout=2).status_code
                  == 200, 60)

    def stop_host_agent(self) -> None:
        if self.host_agent is not None:
            self.host_agent.stop()
            self.host_agent = None

    def env_note(self) -> dict[str, Any]:
        assert self.kubeadm is not None
        return {"corefile_source": self.kubeadm.citation, "corefile": self.corefile,
                "controllers": CONTROLLERS, "startup_s": self.startup,
                "pid": os.getpid()}
