"""A real, single-node Kubernetes control plane on loopback, for tests.

Start order is dependency order and every step waits for the previous one to
answer, never for a fixed time: etcd (``/health``), kube-apiserver (``/readyz``
with the admin token), the VMI CRD (``Established``), kube-controller-manager
(its ``/healthz``), then CoreDNS (its ``ready`` plugin, which only answers 200
once the ``kubernetes`` plugin has synced its informers).

Ports are picked by binding port 0 and releasing it just before the process
starts; a component that then fails to bind makes ``start`` fail with its log
tail, which names the cause.

Credentials: a private CA issues the apiserver's serving certificate; the admin
is a static token in ``system:masters``; workloads (CoreDNS, the host agent)
are ServiceAccounts whose tokens come from the real TokenRequest API and whose
rights come only from RBAC objects the test applies, so a missing or excessive
permission shows exactly as in a cluster.

Teardown (``stop``) kills every process group it started (SIGTERM, then SIGKILL
after a deadline) and removes the work directory; it is idempotent and safe to
call after a partial start.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import secrets
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from tests.realk8s.crd import load_vmi_crd

HERE = Path(__file__).resolve().parent
BUILD_SCRIPT = HERE / "build.sh"
CLUSTER_DOMAIN = "cluster.local"
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"


class HarnessError(Exception):
    """A control-plane component failed to build, start or answer."""


def build_binaries(timeout: float = 3600.0) -> Path:
    """Run build.sh (seconds when warm) and return its bin directory.

    ``REALK8S_BIN`` short-circuits the build with a directory of ready binaries.
    """
    override = os.environ.get("REALK8S_BIN")
    if override:
        return Path(override)
    try:
        proc = subprocess.run(
            ["bash", str(BUILD_SCRIPT)],
            check=True,
            stdout=subprocess.PIPE,
            text=True,
            timeout=timeout,
        )
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise HarnessError(f"{BUILD_SCRIPT} failed: {exc}") from exc
    return Path(proc.stdout.strip().splitlines()[-1])


_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when the test process dies, even by SIGKILL,
    so a killed pytest leaves no etcd or apiserver behind (teardown cannot run then)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_until(
    check: Callable[[], bool], what: str, timeout: float, on_timeout: Callable[[], str] = str
) -> None:
    """Poll ``check`` (which may raise: counts as not yet) until true or the deadline."""
    deadline = time.monotonic() + timeout
    delay = 0.05
    last: BaseException | None = None
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except HarnessError:
            raise
        except Exception as exc:  # anything else means "not yet"
            last = exc
        time.sleep(delay)
        delay = min(delay * 1.5, 0.5)
    raise HarnessError(f"timed out after {timeout:.0f}s waiting for {what}"
                       f" (last error: {last!r}){on_timeout()}")


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 40) -> str:
        try:
            text = self.log.read_text(errors="replace").splitlines()[-lines:]
        except OSError:
            return ""
        return f"\n--- last lines of {self.log} ---\n" + "\n".join(text)

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, grace: float = 5.0, sig: signal.Signals = signal.SIGTERM) -> None:
        if self.popen.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.popen.pid, sig)
        try:
            self.popen.wait(grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.popen.pid, signal.SIGKILL)
            self.popen.wait(grace)


class Api:
    """A thin synchronous REST client (httpx) for one identity; the tests' view of the API."""

    def __init__(self, server: str, ca: Path | None, token: str) -> None:
        """``ca``: the CA that signed the server's certificate; None for plain HTTP."""
        self.server = server
        self.client = httpx.Client(
            base_url=server,
            verify=ssl.create_default_context(cafile=str(ca)) if ca else False,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30.0,
        )

    def close(self) -> None:
        self.client.close()

    def request(self, method: str, path: str, body: Any = None,
                content_type: str = "application/json",
                params: Mapping[str, str] | None = None,
                headers: Mapping[str, str] | None = None) -> httpx.Response:
        """``headers``: extra request headers (``Impersonate-User``, ``Accept``)."""
        sent = {"Content-Type": content_type} if body is not None else {}
        sent.update(headers or {})
        data = None if body is None else json.dumps(body)
        return self.client.request(method, path, content=data, headers=sent, params=params)

    def ok(self, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        resp = self.request(method, path, body, **kw)
        if resp.status_code >= 300:
            raise HarnessError(f"{method} {path} -> {resp.status_code}: {resp.text}")
        return resp.json()

    def get(self, path: str) -> Any:
        return self.ok("GET", path)

    def create(self, path: str, body: Any) -> Any:
        return self.ok("POST", path, body)

    def delete(self, path: str) -> httpx.Response:
        return self.request("DELETE", path)

    def apply(self, path: str, body: Any, manager: str = "realk8s-test") -> Any:
        """Server-side apply (create or update) of ``body`` at its object path."""
        return self.ok("PATCH", path, body, content_type="application/apply-patch+yaml",
                       params={"fieldManager": manager, "force": "true"})

    @contextlib.contextmanager
    def watch(self, path: str, resource_version: str, timeout: float = 30.0,
              params: Mapping[str, str] | None = None
              ) -> Iterator[tuple[int, Iterator[dict[str, Any]]]]:
        """Open a watch (``params``: selectors); yields (HTTP status, decoded events)."""
        params = {"watch": "1", "resourceVersion": resource_version,
                  "allowWatchBookmarks": "false",
                  "timeoutSeconds": str(int(timeout)), **(params or {})}
        with self.client.stream("GET", path, params=params,
                                timeout=httpx.Timeout(timeout + 5)) as resp:
            def events() -> Iterator[dict[str, Any]]:
                for line in resp.iter_lines():
                    if line.strip():
                        yield json.loads(line)
            yield resp.status_code, events()


def kubeconfig(server: str, ca: Path, token: str, user: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "realk8s",
                      "cluster": {"server": server, "certificate-authority": str(ca)}}],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "realk8s", "context": {"cluster": "realk8s", "user": user}}],
        "current-context": "realk8s",
    }


def _openssl(*args: str, cwd: Path) -> None:
    try:
        subprocess.run(["openssl", *args], cwd=cwd, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    except subprocess.CalledProcessError as exc:
        raise HarnessError(f"openssl {' '.join(args)} failed: {exc.stderr!r}") from exc


def make_pki(pki: Path, extra_ips: tuple[str, ...] = ()) -> None:
    """CA, apiserver serving cert (127.0.0.1, localhost and ``extra_ips``) and the SA
    signing key pair."""
    pki.mkdir(parents=True, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=realk8s-ca", "-keyout", "ca.key", "-out", "ca.crt", cwd=pki)
    ips = "".join(f",IP:{ip}" for ip in extra_ips)
    (pki / "san.cnf").write_text(
        f"subjectAltName=IP:127.0.0.1{ips},DNS:localhost,DNS:kubernetes.default.svc,"
        "DNS:kubernetes.default.svc.cluster.local\n"
        "extendedKeyUsage=serverAuth\n")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=kube-apiserver",
             "-keyout", "apiserver.key", "-out", "apiserver.csr", cwd=pki)
    _openssl("x509", "-req", "-in", "apiserver.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", "2", "-extfile", "san.cnf",
             "-out", "apiserver.crt", cwd=pki)
    _openssl("genrsa", "-out", "sa.key", "2048", cwd=pki)
    _openssl("rsa", "-in", "sa.key", "-pubout", "-out", "sa.pub", cwd=pki)


# RBAC CoreDNS needs for the kubernetes plugin (what a cluster's system:coredns grants).
COREDNS_RULES: list[dict[str, Any]] = [
    {"apiGroups": [""], "resources": ["endpoints", "services", "pods", "namespaces"],
     "verbs": ["list", "watch"]},
    {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
     "verbs": ["list", "watch"]},
]


@dataclass
class ControlPlane:
    """One etcd + kube-apiserver + kube-controller-manager + CoreDNS, on 127.0.0.1."""

    bin_dir: Path
    vmi_openapi: Path
    workdir: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="rk8s-")))
    procs: dict[str, Proc] = field(default_factory=dict)
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    etcd_url: str = ""
    #: etcd's (client, peer) ports, kept for a restart on the same addresses
    etcd_ports: tuple[int, int] = (0, 0)
    server: str = ""
    dns_port: int = 0
    admin: Api | None = None
    startup_seconds: dict[str, float] = field(default_factory=dict)
    #: audit every request (the RBAC tests read the log); benchmarks turn it off
    audit: bool = True
    #: also keep Lease requests' bodies (RequestResponse): the answer names the holder,
    #: which the realk8s soak's invariant 4 needs (tests/soak/apiaudit.py)
    audit_leases: bool = False
    #: kube-controller-manager's --controllers (the peers benchmark adds the EndpointSlice
    #: controller, which publishes the manual recipe's pods)
    #: (the default's aggregation controller fills admin/edit/view from aggregate-to-* roles)
    controllers: str = ("garbage-collector-controller,namespace-controller,"
                        "clusterrole-aggregation-controller")
    #: where kube-apiserver binds and what it advertises; a node's pods cannot reach
    #: loopback, so the realnode tier passes an address on its bridge (tests/realnode)
    address: str = "127.0.0.1"
    service_cidr: str = "10.96.0.0/16"
    #: "none": no `kubernetes` Service endpoints (nothing in a pod needs them here);
    #: "lease" publishes ``address`` for in-cluster clients
    endpoint_reconciler: str = "none"
    #: more SANs for the serving certificate (the `kubernetes` Service's cluster IP)
    extra_sans: tuple[str, ...] = ()
    #: more kube-apiserver flags (the realnode tier: reach the kubelet by its InternalIP)
    apiserver_args: tuple[str, ...] = ()

    # ---- paths
    @property
    def pki(self) -> Path:
        return self.workdir / "pki"

    @property
    def ca(self) -> Path:
        return self.pki / "ca.crt"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.workdir / "admin.kubeconfig"

    # ---- lifecycle
    def start(self, api_only: bool = False) -> None:
        """Start everything, or (``api_only``) just etcd, the apiserver and the VMI CRD."""
        t0 = time.monotonic()
        steps: list[Callable[[], None]] = [self._start_etcd, self._start_apiserver,
                                           self._register_crd]
        if not api_only:
            steps += [self._start_controller_manager, self._start_coredns]
        try:
            for step in steps:
                t = time.monotonic()
                step()
                self.startup_seconds[step.__name__.removeprefix("_")] = time.monotonic() - t
        except BaseException:
            self.stop()
            raise
        self.startup_seconds["total"] = time.monotonic() - t0

    def stop(self) -> None:
        if self.admin is not None:
            self.admin.close()
            self.admin = None
        for proc in reversed(list(self.procs.values())):
            proc.stop()
        self.procs.clear()
        shutil.rmtree(self.workdir, ignore_errors=True)

    def _spawn(self, name: str, argv: list[str], env: Mapping[str, str] | None = None) -> Proc:
        logs = self.workdir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        log = logs / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out,
                                     stderr=subprocess.STDOUT, start_new_session=True,
                                     preexec_fn=_die_with_parent,
                                     cwd=self.workdir, env={**os.environ, **(env or {})})
        proc = Proc(name, popen, log)
        self.procs[name] = proc
        return proc

    def _await(self, proc: Proc, what: str, check: Callable[[], bool], timeout: float) -> None:
        def ready() -> bool:
            if not proc.alive():
                raise HarnessError(f"{proc.name} exited with {proc.popen.returncode}"
                                   f"{proc.tail()}")
            return check()

        wait_until(ready, what, timeout, proc.tail)

    # ---- etcd
    def _start_etcd(self, ports: tuple[int, int] | None = None) -> None:
        client, peer = ports or (free_port(), free_port())
        self.etcd_ports = (client, peer)
        self.etcd_url = f"http://127.0.0.1:{client}"
        proc = self._spawn("etcd", [
            str(self.bin_dir / "etcd"), "--name", "rk8s",
            "--data-dir", str(self.workdir / "etcd"),
            "--listen-client-urls", self.etcd_url, "--advertise-client-urls", self.etcd_url,
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"rk8s=http://127.0.0.1:{peer}",
            "--unsafe-no-fsync", "--log-level", "warn",
        ])

        def healthy() -> bool:
            r = httpx.get(f"{self.etcd_url}/health", timeout=2)
            return r.status_code == 200 and r.json().get("health") == "true"

        self._await(proc, "etcd /health", healthy, 60)

    def etcd_revision(self) -> int:
        r = httpx.post(f"{self.etcd_url}/v3/kv/range",
                       json={"key": "AA=="}, timeout=10)  # base64 of "\0": any key
        r.raise_for_status()
        return int(r.json()["header"]["revision"])

    def compact_etcd(self) -> int:
        """Compact etcd's history up to its current revision (what the apiserver does
        every 5 minutes in a cluster); returns that revision."""
        rev = self.etcd_revision()
        r = httpx.post(f"{self.etcd_url}/v3/kv/compaction",
                       json={"revision": str(rev), "physical": True}, timeout=30)
        if r.status_code != 200:
            raise HarnessError(f"etcd compaction to {rev} failed: {r.status_code} {r.text}")
        return rev

    # ---- kube-apiserver
    def _start_apiserver(self, port: int | None = None) -> None:
        if not (self.pki / "ca.crt").exists():
            make_pki(self.pki, tuple(dict.fromkeys(
                ip for ip in (self.address, *self.extra_sans) if ip != "127.0.0.1")))
            (self.workdir / "tokens.csv").write_text(
                f"{self.admin_token},realk8s-admin,realk8s-admin,system:masters\n")
        port = port or free_port()
        self.server = f"https://{self.address}:{port}"
        pki = self.pki
        proc = self._spawn("kube-apiserver", [
            str(self.bin_dir / "kube-apiserver"),
            f"--etcd-servers={self.etcd_url}",
            f"--bind-address={self.address}", f"--advertise-address={self.address}",
            f"--secure-port={port}",
            f"--tls-cert-file={pki / 'apiserver.crt'}",
            f"--tls-private-key-file={pki / 'apiserver.key'}",
            f"--client-ca-file={pki / 'ca.crt'}",
            f"--token-auth-file={self.workdir / 'tokens.csv'}",
            "--authorization-mode=RBAC",
            f"--service-account-issuer={SA_ISSUER}",
            f"--service-account-key-file={pki / 'sa.pub'}",
            f"--service-account-signing-key-file={pki / 'sa.key'}",
            f"--service-cluster-ip-range={self.service_cidr}",
            f"--endpoint-reconciler-type={self.endpoint_reconciler}",
            "--anonymous-auth=false",
            "--enable-priority-and-fairness=false",
            *([f"--audit-policy-file={self._audit_policy()}",
               f"--audit-log-path={self.audit_log}",
               "--audit-log-format=json"] if self.audit else []),
            "--profiling=false",
            *self.apiserver_args,
            "--v=1",
        ])
        if self.admin is None:  # kept across restart_apiserver: same address
            self.admin = Api(self.server, self.ca, self.admin_token)
        self.admin_kubeconfig.write_text(yaml.safe_dump(
            kubeconfig(self.server, self.ca, self.admin_token, "realk8s-admin")))

        def ready() -> bool:
            assert self.admin is not None
            return self.admin.request("GET", "/readyz").status_code == 200

        self._await(proc, "kube-apiserver /readyz", ready, 120)

    @property
    def audit_log(self) -> Path:
        return self.workdir / "audit.log"

    def _audit_policy(self) -> Path:
        """Audit every request at Metadata level: who did which verb on what, and the
        answer's code. The RBAC test compares what the agent used with what it holds."""
        path = self.workdir / "audit-policy.yaml"
        path.write_text(yaml.safe_dump({
            "apiVersion": "audit.k8s.io/v1", "kind": "Policy",
            "omitStages": ["RequestReceived", "ResponseStarted"],
            "rules": [*([{"level": "RequestResponse", "resources": [
                {"group": "coordination.k8s.io", "resources": ["leases"]}]}]
                if self.audit_leases else []),
                      {"level": "Metadata"}]}))
        return path

    def audit_mark(self) -> int:
        """A position in the audit log: pass it to ``audit_events`` to see only later
        requests (identities are shared between tests of one session)."""
        try:
            return len(self.audit_log.read_text().splitlines())
        except FileNotFoundError:
            return 0

    def audit_events(self, username: str, after: int = 0) -> list[dict[str, Any]]:
        """Audit events of requests made by ``username`` (after the mark ``after``)."""
        events = []
        try:
            lines = self.audit_log.read_text().splitlines()[after:]
        except FileNotFoundError:
            return []
        for line in lines:
            with contextlib.suppress(ValueError):
                ev = json.loads(line)
                if ev.get("user", {}).get("username") == username:
                    events.append(ev)
        return events

    def restart_apiserver(self, *, kill: bool = False) -> None:
        """Stop and start kube-apiserver on the same etcd (its watch cache starts afresh)
        and on the same port, so clients holding the old address reconnect.

        ``kill``: SIGKILL, as a crashed or OOM-killed apiserver goes: no final bookmarks
        to watchers, so their resourceVersions are as old as their last event."""
        self.stop_apiserver(kill=kill)
        self.start_apiserver_again()

    def stop_apiserver(self, *, kill: bool = False) -> None:
        """Stop kube-apiserver (SIGKILL with ``kill``) until :meth:`start_apiserver_again`."""
        self.procs.pop("kube-apiserver").stop(sig=signal.SIGKILL if kill else signal.SIGTERM)

    def start_apiserver_again(self) -> None:
        # Same port: clients (the host agent) keep their kubeconfig.
        self._start_apiserver(port=int(self.server.rsplit(":", 1)[1]))

    def stop_etcd(self, *, kill: bool = True) -> None:
        """Stop etcd (SIGKILL by default: a crashed member), keeping its data directory;
        kube-apiserver stays up and answers errors until :meth:`start_etcd_again`."""
        self.procs.pop("etcd").stop(sig=signal.SIGKILL if kill else signal.SIGTERM)

    def start_etcd_again(self) -> None:
        """etcd on the same ports and data: the apiserver's client reconnects by itself."""
        self._start_etcd(self.etcd_ports)

    # ---- CRD
    def _register_crd(self) -> None:
        assert self.admin is not None
        crd = load_vmi_crd(self.vmi_openapi)
        name = crd["metadata"]["name"]
        self.admin.create("/apis/apiextensions.k8s.io/v1/customresourcedefinitions", crd)

        def established() -> bool:
            assert self.admin is not None
            obj = self.admin.get(f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}")
            conds = obj.get("status", {}).get("conditions", [])
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                return False
            # Established precedes the REST endpoint by a moment; wait for a real list.
            return self.admin.request(
                "GET", "/apis/kubevirt.io/v1/virtualmachineinstances").status_code == 200

        wait_until(established, f"CRD {name} Established", 60)

    # ---- kube-controller-manager
    def _start_controller_manager(self) -> None:
        port = free_port()
        kc = str(self.admin_kubeconfig)
        proc = self._spawn("kube-controller-manager", [
            str(self.bin_dir / "kube-controller-manager"),
            f"--kubeconfig={kc}",
            f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
            f"--controllers={self.controllers}",
            "--leader-elect=false",
            f"--root-ca-file={self.ca}",
            "--bind-address=127.0.0.1", f"--secure-port={port}",
            "--v=1",
        ])

        def healthy() -> bool:
            r = httpx.get(f"https://127.0.0.1:{port}/healthz", verify=False, timeout=2)
            return r.status_code == 200

        self._await(proc, "kube-controller-manager /healthz", healthy, 90)

    # ---- identities
    def service_account_token(self, namespace: str, name: str,
                              cluster_role_rules: list[dict[str, Any]] | None = None,
                              cluster_role: str | None = None) -> str:
        """Create namespace + ServiceAccount (idempotent), bind it to ``cluster_role``
        (created from ``cluster_role_rules`` when given) and mint a token for it with
        the TokenRequest API."""
        api = self.admin
        assert api is not None
        api.apply(f"/api/v1/namespaces/{namespace}",
                  {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace}})
        api.apply(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}",
                  {"apiVersion": "v1", "kind": "ServiceAccount",
                   "metadata": {"name": name, "namespace": namespace}})
        if cluster_role_rules is not None:
            cluster_role = cluster_role or f"realk8s:{namespace}:{name}"
            api.apply(f"/apis/rbac.authorization.k8s.io/v1/clusterroles/{cluster_role}",
                      {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "ClusterRole",
                       "metadata": {"name": cluster_role}, "rules": cluster_role_rules})
        if cluster_role is not None:
            binding = f"realk8s:{namespace}:{name}"
            api.apply(f"/apis/rbac.authorization.k8s.io/v1/clusterrolebindings/{binding}",
                      {"apiVersion": "rbac.authorization.k8s.io/v1",
                       "kind": "ClusterRoleBinding", "metadata": {"name": binding},
                       "roleRef": {"apiGroup": "rbac.authorization.k8s.io",
                                   "kind": "ClusterRole", "name": cluster_role},
                       "subjects": [{"kind": "ServiceAccount", "name": name,
                                     "namespace": namespace}]})
        tr = api.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
                        {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                         "spec": {"expirationSeconds": 7200}})
        return str(tr["status"]["token"])

    def write_kubeconfig(self, path: Path, token: str, user: str) -> Path:
        path.write_text(yaml.safe_dump(kubeconfig(self.server, self.ca, token, user)))
        return path

    # ---- CoreDNS
    def _start_coredns(self) -> None:
        self.dns_port = self.start_coredns("coredns", "127.0.0.1")

    def start_coredns(self, name: str, bind: str) -> int:
        """Start a CoreDNS (kubernetes plugin, ``ttl 5``) listening on ``bind``; returns
        its DNS port once its ``ready`` plugin says the plugin has synced.

        A second instance serves clients in network namespaces, bound to the address
        of the namespace fabric's gateway (loopback is per namespace)."""
        if not hasattr(self, "_coredns_token"):
            self._coredns_token = self.service_account_token("kube-system", "coredns",
                                                              COREDNS_RULES)
        kc = self.write_kubeconfig(self.workdir / "coredns.kubeconfig", self._coredns_token,
                                   "coredns")
        port = free_port_udp_tcp(bind)
        ready_port = free_port()
        corefile = self.workdir / f"Corefile.{name}"
        corefile.write_text(
            f".:{port} {{\n"
            f"    bind {bind}\n"
            "    errors\n"
            f"    ready 127.0.0.1:{ready_port}\n"
            f"    kubernetes {CLUSTER_DOMAIN} {{\n"
            f"        kubeconfig {kc} realk8s\n"
            "        ttl 5\n"
            "    }\n"
            "}\n")
        proc = self._spawn(name, [str(self.bin_dir / "coredns"), "-conf", str(corefile)])

        def ready() -> bool:
            return httpx.get(f"http://127.0.0.1:{ready_port}/ready", timeout=2).status_code == 200

        self._await(proc, f"{name} /ready", ready, 60)
        return port

    # ---- kubectl at the apiserver's version
    def kubectl(self, *args: str, kubeconfig: Path | None = None, stdin: str | None = None,
                check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess[str]:
        """Run the kubectl build.sh built beside the apiserver (never the machine's: it
        is out of kubectl's one-minor skew), as the admin unless ``kubeconfig``."""
        argv = [str(self.bin_dir / "kubectl"),
                "--kubeconfig", str(kubeconfig or self.admin_kubeconfig),
                "--cache-dir", str(self.workdir / "kubectl-cache"), *args]
        proc = subprocess.run(argv, input=stdin, capture_output=True, text=True,
                              timeout=timeout, check=False)
        if check and proc.returncode != 0:
            raise HarnessError(f"kubectl {' '.join(args)} exited {proc.returncode}: "
                               f"{proc.stderr.strip()}")
        return proc

    def apply_crd(self, crd: Mapping[str, Any], timeout: float = 60) -> None:
        """Create or update a CRD (server-side apply) and wait until its kind is served."""
        api = self.admin
        assert api is not None
        name = crd["metadata"]["name"]
        path = f"/apis/apiextensions.k8s.io/v1/customresourcedefinitions/{name}"
        api.apply(path, dict(crd))
        spec = crd["spec"]
        version = next(v["name"] for v in spec["versions"] if v.get("storage"))
        plural = spec["names"]["plural"]

        def served() -> bool:
            assert self.admin is not None
            obj = self.admin.get(path)
            conds = obj.get("status", {}).get("conditions", [])
            if not any(c["type"] == "Established" and c["status"] == "True" for c in conds):
                return False
            return self.admin.request(
                "GET", f"/apis/{spec['group']}/{version}/{plural}").status_code == 200

        wait_until(served, f"CRD {name} Established and served", timeout)

    def stop_process(self, name: str) -> None:
        proc = self.procs.pop(name, None)
        if proc is not None:
            proc.stop()


def end_processes(*procs: subprocess.Popen[bytes], grace: float = 10.0) -> None:
    """SIGTERM all of ``procs`` at once, then SIGKILL whichever is still there after
    ``grace`` seconds; every one is reaped (a test's agent processes, at teardown)."""
    for proc in procs:
        if proc.poll() is None:
            proc.terminate()
    for proc in procs:
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(grace)


def free_port_udp_tcp(host: str = "127.0.0.1") -> int:
    """A port free for both UDP and TCP on ``host`` (DNS listens on both)."""
    for _ in range(50):
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as u:
            u.bind((host, 0))
            port = int(u.getsockname()[1])
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as t:
                try:
                    t.bind((host, port))
                except OSError:
                    continue
                return port
    raise HarnessError(f"no port free for both UDP and TCP on {host}")
