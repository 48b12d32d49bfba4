"""Installing, upgrading and removing the host agent as an operator does, on a control
plane of its own (tests/realk8s/test_install_*.py, test_chart_*.py).

- ``Helm``: the Helm build.sh built beside kubectl, with its own home directories.
- ``previous_release``: the previous release's tree (commit ``PREVIOUS_RELEASE``:
  its manifests and its agents' code), extracted with ``git archive``, never checked out.
- ``Site``: what a cluster holds that the install must never lose: the user's
  namespace with two ImexEnsembles (one with authEncryption, so a CA Secret), their VMIs
  and what the agent made; ``Site.snapshot`` records it and ``Site.kept`` compares.
- ``RegistryMonitor``: asks the registry Service for every ensemble every 0.1 s
  while an upgrade runs and records every answer that is not the same membership.
- ``Guests``: real guest agents (``imex-guest-agent run``) on this host, registry
  through the Service, CoreDNS as their DNS; ``files`` says whether one rewrote a file.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.guest_support.agent import write_config
from tests.realk8s.fixtures import vmi
from tests.realk8s.harness import Api, ControlPlane, HarnessError, wait_until
from tests.realk8s.kubeops import SERVICES, SLICES, create_vmi
from tests.realk8s.pods import Program

REPO = Path(__file__).resolve().parents[2]
#: the previous release, installed from its own manifests by the upgrade tests
PREVIOUS_RELEASE = "8503169"
CHART = REPO / "charts" / "imex-ensemble"
ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/imexensembles.imex-ensemble.io"
USER_NS = "gpu-jobs"
#: ensemble -> (maxMembers, authEncryption, member IPs)
ENSEMBLES = {"rack-a": (4, False, ["10.80.0.10", "10.80.0.11", "10.80.0.12"]),
             "rack-b": (2, True, ["10.80.1.10", "10.80.1.11"])}


def previous_release(dest: Path) -> Path:
    """The previous release's manifests/, host_agent/ and guest_agent/ under ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", PREVIOUS_RELEASE,
                              "manifests", "host_agent", "guest_agent"],
                             capture_output=True, timeout=60, check=False)
    if archive.returncode != 0:
        raise HarnessError(f"the previous release {PREVIOUS_RELEASE} is not in this clone "
                           f"(a shallow clone? git fetch --unshallow): "
                           f"{archive.stderr.decode(errors='replace').strip()}")
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True,
                   timeout=60)
    return dest


#: this release's agent: the installed console script
CURRENT = Program([str(Path(sys.executable).with_name("imex-host-agent"))])


def previous_program(tree: Path) -> Program:
    """The previous release's agent: its own code (``previous_release``) first on the path."""
    return Program([sys.executable, "-c",
                    "import sys; from host_agent.cli import main; sys.exit(main())"],
                   env={"PYTHONPATH": str(tree)}, label=PREVIOUS_RELEASE)


@dataclass
class Helm:
    binary: Path
    kubeconfig: Path
    home: Path

    def run(self, *args: str, check: bool = True,
            timeout: float = 180) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "KUBECONFIG": str(self.kubeconfig),
               "HELM_CACHE_HOME": str(self.home / "cache"),
               "HELM_CONFIG_HOME": str(self.home / "config"),
               "HELM_DATA_HOME": str(self.home / "data")}
        proc = subprocess.run([str(self.binary), *args], capture_output=True, text=True,
                              timeout=timeout, env=env, check=False)
        if check and proc.returncode != 0:
            raise HarnessError(f"helm {' '.join(args)} exited {proc.returncode}: "
                               f"{proc.stderr.strip()}")
        return proc


def get(api: Api, path: str) -> dict[str, Any] | None:
    r = api.request("GET", path)
    if r.status_code == 404:
        return None
    r.raise_for_status()
    out: dict[str, Any] = r.json()
    return out


@dataclass
class Site:
    """The user's side of the cluster: namespace ``gpu-jobs``, the ensembles of
    ``ENSEMBLES`` as ImexEnsembles with their VMIs."""

    cp: ControlPlane
    agent_ns: str = "imex-system"

    @property
    def api(self) -> Api:
        assert self.cp.admin is not None
        return self.cp.admin

    def create(self) -> None:
        self.api.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                               "metadata": {"name": USER_NS}})
        for name, (size, tls, ips) in ENSEMBLES.items():
            self.api.create(ENS.format(ns=USER_NS), {
                "apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                "metadata": {"name": name, "namespace": USER_NS},
                "spec": {"maxMembers": size, "authEncryption": tls}})
            for i, ip in enumerate(ips):
                create_vmi(self.api, vmi(USER_NS, f"{name}-{i}", name, ip=ip, node=f"n{i}"))

    def published(self, timeout: float = 90) -> None:
        """Until every ensemble's status counts all its members and its slice, Service
        (and CA Secret) exist."""
        def done() -> bool:
            for name, (_, tls, ips) in ENSEMBLES.items():
                st = (get(self.api, f"{ENS.format(ns=USER_NS)}/{name}") or {}).get("status")
                if not st or st.get("membersPublished") != len(ips):
                    return False
                if not get(self.api, f"{SLICES.format(ns=USER_NS)}/{name}-imex"):
                    return False
                if tls and not st.get("caSHA256"):
                    return False
            return True

        wait_until(done, "every ensemble published", timeout, lambda: f"; {self.snapshot()}")

    def ca_secret(self, name: str) -> str:
        return f"/api/v1/namespaces/{self.agent_ns}/secrets/imex-ca-{USER_NS}.{name}"

    def snapshot(self) -> dict[str, Any]:
        """What must survive an upgrade, an uninstall and a reinstall unchanged."""
        out: dict[str, Any] = {}
        for name, (_, tls, _ips) in ENSEMBLES.items():
            cr = get(self.api, f"{ENS.format(ns=USER_NS)}/{name}") or {}
            st = cr.get("status") or {}
            svc = get(self.api, f"{SERVICES.format(ns=USER_NS)}/{name}") or {}
            sl = get(self.api, f"{SLICES.format(ns=USER_NS)}/{name}-imex") or {}
            out[name] = {
                "cr": (cr.get("metadata", {}).get("uid"), cr.get("metadata", {}).get("generation")),
                "domainID": st.get("domainID"),
                "membershipGeneration": st.get("membershipGeneration"),
                "caSHA256": st.get("caSHA256"),
                "service": (svc.get("metadata", {}).get("uid"),
                            svc.get("metadata", {}).get("annotations")),
                "slice": (sl.get("metadata", {}).get("uid"),
                          sl.get("metadata", {}).get("resourceVersion"), sl.get("endpoints")),
            }
            if tls:
                sec = get(self.api, self.ca_secret(name)) or {}
                out[name]["ca"] = (sec.get("metadata", {}).get("uid"),
                                   sec.get("metadata", {}).get("resourceVersion"),
                                   sec.get("data"))
        return out

    def kept(self, before: dict[str, Any]) -> None:
        now = self.snapshot()
        for name, want in before.items():
            for part, value in want.items():
                assert now[name][part] == value, \
                    f"{name}: {part} changed: {value} -> {now[name][part]}"

    def crd_exists(self) -> bool:
        return get(self.api, CRD) is not None


@dataclass
class RegistryMonitor:
    """Every 0.1 s, every ensemble through the Service: an answer other than 200 with the
    expected generation, domain id, members and CA is a gap (recorded, not raised)."""

    url: str
    want: dict[str, tuple[int, str, list[tuple[int, str]], str | None]] = field(
        default_factory=dict)
    asked: int = 0
    gaps: list[str] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    @staticmethod
    def view(doc: dict[str, Any]) -> tuple[int, str, list[tuple[int, str]], str | None]:
        members = sorted((m["index"], m["ip"]) for m in doc["members"])
        return (doc["generation"], doc["domain_id"], members,
                (doc.get("tls") or {}).get("ca_sha256"))

    def expect_current(self) -> None:
        for name in ENSEMBLES:
            r = httpx.get(f"{self.url}/v1/ensembles/{USER_NS}/{name}", timeout=5)
            r.raise_for_status()
            self.want[name] = self.view(r.json())

    def _loop(self) -> None:
        with httpx.Client(timeout=2) as client:
            while not self._stop.is_set():
                for name, want in self.want.items():
                    t = time.strftime("%H:%M:%S")
                    try:
                        r = client.get(f"{self.url}/v1/ensembles/{USER_NS}/{name}")
                        got = self.view(r.json()) if r.status_code == 200 else r.status_code
                    except (httpx.HTTPError, ValueError, KeyError) as exc:
                        got = repr(exc)
                    self.asked += 1
                    if got != want:
                        self.gaps.append(f"{t} {name}: {got}")
                self._stop.wait(0.1)

    def __enter__(self) -> RegistryMonitor:
        self.expect_current()
        self._thread = threading.Thread(target=self._loop, name="registry-monitor",
                                        daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)


@dataclass
class Guests:
    """One real guest agent per member of ``rack-a`` on this host (no IMEX, no reports:
    the Service stand-in hides their addresses), registry through ``registry_url``."""

    workdir: Path
    registry_url: str
    dns_port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def paths(self, i: int) -> list[Path]:
        return [self.workdir / f"guest-{i}.nodes", self.workdir / f"guest-{i}.hosts"]

    def start(self) -> None:
        size, _, ips = ENSEMBLES["rack-a"]
        for i in range(len(ips)):
            nodes, hosts = self.paths(i)
            hosts.write_text("127.0.0.1 localhost\n")
            cfg = write_config(self.workdir / f"guest-{i}.toml", {
                "ensemble": "rack-a", "namespace": USER_NS, "max_members": size,
                "registry_url": self.registry_url, "own_index": i,
                "nameservers": [f"127.0.0.1:{self.dns_port}"],
                "nodes_config": str(nodes), "hosts_file": str(hosts),
                "status_file": str(self.workdir / f"guest-{i}.status"),
                "imex_control": "none", "reserve_port": False})
            log = (self.workdir / f"guest-{i}.log").open("ab")
            self.procs.append(subprocess.Popen(
                [str(Path(sys.executable).with_name("imex-guest-agent")), "run", "--config",
                 str(cfg)], stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

        def pinned() -> bool:
            """Every guest's hosts file pins its peers' published addresses (its own
            slot is its own business: own_slot auto)."""
            return all(all(ip in self.paths(i)[1].read_text() for j, ip in enumerate(ips)
                           if j != i) for i in range(len(ips)))

        wait_until(pinned, "every guest pinned every member", 60, self.tail)

    def files(self) -> dict[str, tuple[int, int, str]]:
        """Every guest file's inode, mtime and content hash: a rewrite changes them."""
        out = {}
        for i in range(len(self.procs)):
            for p in self.paths(i):
                st = p.stat()
                out[p.name] = (st.st_ino, st.st_mtime_ns,
                               hashlib.sha256(p.read_bytes()).hexdigest())
        return out

    def tail(self) -> str:
        return "".join(f"\n--- guest {i} ---\n"
                       + (self.workdir / f"guest-{i}.log").read_text(errors="replace")[-1500:]
                       + f"\n--- guest {i}'s hosts ---\n" + self.paths(i)[1].read_text()
                       for i in range(len(self.procs)))

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()


#: namespaces the install tests use: the user's, the kustomize install's, the chart's
NAMESPACES = (USER_NS, "imex-system", "imex-ops")
CLUSTER_OBJECTS = (
    CRD,
    "/apis/rbac.authorization.k8s.io/v1/clusterroles/imex-host-agent",
    "/apis/rbac.authorization.k8s.io/v1/clusterroles/imex-ensemble-edit",
    "/apis/rbac.authorization.k8s.io/v1/clusterroles/imex-ensemble-view",
    "/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/imex-host-agent",
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/imex-host-agent-services",
    "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings/"
    "imex-host-agent-services",
)


def wipe(cp: ControlPlane, timeout: float = 120) -> None:
    """Remove everything the install tests make (namespaces, then the cluster-wide
    objects) and wait until it is gone: the next test starts on an empty cluster."""
    api = cp.admin
    assert api is not None
    for ns in NAMESPACES:
        api.delete(f"/api/v1/namespaces/{ns}")
    for path in CLUSTER_OBJECTS:
        api.delete(path)

    def gone() -> bool:
        return all(api.request("GET", f"/api/v1/namespaces/{ns}").status_code == 404
                   for ns in NAMESPACES) and all(
            api.request("GET", path).status_code == 404 for path in CLUSTER_OBJECTS)

    wait_until(gone, "the install plane to be empty", timeout)
