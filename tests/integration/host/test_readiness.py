"""An agent that cannot work is not ready: the real ``imex-host-agent`` process against the
API double, whose RBAC and SelfSubjectAccessReviews answer as kube-apiserver's do
(tests/realk8s/test_rbac_parity.py).

- The issue's case: run outside the cluster without ``--agent-namespace``, where
  ``imex-system`` does not exist. /readyz is 503 naming the namespace (and the log says
  so once), until the namespace is created; then it is ready without a restart.
- The manifests' exact RBAC (manifests/base rendered by kubectl, applied as rendered),
  but for the leader-election RoleBinding: 503 naming the Lease and ConfigMap verbs,
  until the binding is there.
- A kubeconfig whose ``tokenFile`` cannot be read: 503 naming the file, until it can.
- Once ready, an API outage does not take readiness away: the registry keeps serving.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.sandbox.kube_api.fixtures import KubeApiHandle
from tests.sandbox.kube_api.server import kubeconfig_document

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[3]
BASE = ROOT / "manifests" / "base"
RBAC_KINDS = ("Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
              "RoleBinding")


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Agent:
    def __init__(self, proc: subprocess.Popen[bytes], port: int, log: Path) -> None:
        self.proc, self.port, self.log = proc, port, log

    def readyz(self) -> tuple[int, str]:
        try:
            resp = httpx.get(f"http://127.0.0.1:{self.port}/readyz", timeout=2)
        except httpx.TransportError as exc:
            return 0, str(exc)
        return resp.status_code, resp.text

    def wait(self, check: Callable[[tuple[int, str]], bool], what: str,
             timeout: float = 30) -> tuple[int, str]:
        deadline = time.monotonic() + timeout
        last = self.readyz()
        while not check(last):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                raise AssertionError(f"{what}: last /readyz {last}; log:\n"
                                     f"{self.log.read_text()[-3000:]}")
            time.sleep(0.1)
            last = self.readyz()
        return last


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[..., Agent]]:
    procs: list[subprocess.Popen[bytes]] = []

    def run(kubeconfig: Path, *flags: str) -> Agent:
        port = free_port()
        log = tmp_path / f"agent-{len(procs)}.log"
        env = {k: v for k, v in os.environ.items() if not k.startswith("IMEX_")}
        proc = subprocess.Popen(
            [sys.executable, "-m", "tests.sandbox.host_agent_proc",
             "--tune", "backoff_initial=0.1", "--tune", "backoff_max=0.5",
             "--kubeconfig", str(kubeconfig), "--listen", f"127.0.0.1:{port}", *flags],
            stdout=log.open("wb"), stderr=subprocess.STDOUT, cwd=ROOT,
            env={**env, "PYTHONPATH": str(ROOT)})
        procs.append(proc)
        return Agent(proc, port, log)

    try:
        yield run
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def ready(answer: tuple[int, str]) -> bool:
    return answer[0] == 200


def base_rbac(kubectl: str) -> list[dict[str, Any]]:
    """manifests/base's Namespace, ServiceAccount, roles and bindings, as kubectl renders
    them."""
    out = subprocess.run([kubectl, "kustomize", str(BASE)], capture_output=True, text=True,
                         check=True, timeout=60).stdout
    return [o for o in yaml.safe_load_all(out) if o and o["kind"] in RBAC_KINDS]


def account_token(kube_api: KubeApiHandle, namespace: str, name: str) -> str:
    """A token of the ServiceAccount, from the TokenRequest API."""
    return str(httpx.post(
        f"{kube_api.url}/api/v1/namespaces/{namespace}/serviceaccounts/{name}/token",
        json={"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest", "spec": {}},
        headers={"Authorization": f"Bearer {kube_api.token}"}, timeout=10,
    ).json()["status"]["token"])


def write_kubeconfig(kube_api: KubeApiHandle, path: Path, token: str | None = None,
                     token_file: Path | None = None) -> Path:
    doc = kubeconfig_document(kube_api.url, token or "")
    if token_file is not None:
        doc["users"][0]["user"] = {"tokenFile": str(token_file)}
    path.write_text(yaml.safe_dump(doc))
    return path


def test_a_missing_namespace_is_named_until_it_exists_then_an_outage_changes_nothing(
        kube_api: KubeApiHandle, start: Callable[..., Agent]) -> None:
    agent = start(kube_api.kubeconfig_path)  # the superuser, no --agent-namespace
    code, text = agent.wait(lambda a: "does not exist" in a[1], "the namespace named")
    assert code == 503
    assert ("not ready: namespace imex-system does not exist: the agent keeps its "
            "guest-report ConfigMaps, its CA Secrets there; create it, or pass "
            "--agent-namespace (env IMEX_AGENT_NAMESPACE)") in text
    time.sleep(4)  # the checks ran again after 1 and 2 s: said once all the same
    assert agent.log.read_text().count("namespace imex-system does not exist") == 1
    assert agent.readyz()[0] == 503

    kube_api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    agent.wait(ready, "ready once the namespace exists", 15)
    assert "start-up checks hold" in agent.log.read_text()
    assert kube_api.list("v1", "ConfigMap", "imex-system") == []  # a dry run stores nothing
    assert kube_api.writes("configmaps") == 0

    kube_api.outage("refuse")
    try:
        until = time.monotonic() + 5
        while time.monotonic() < until:
            assert agent.readyz()[0] == 200, "an API outage took readiness away"
            time.sleep(0.2)
    finally:
        kube_api.recover()


def test_the_manifests_rbac_without_the_lease_binding_names_the_verbs(
        kube_api: KubeApiHandle, start: Callable[..., Agent], machine_kubectl: str,
        tmp_path: Path) -> None:
    objs = base_rbac(machine_kubectl)
    binding = next(o for o in objs if o["kind"] == "RoleBinding"
                   and o["metadata"]["name"] == "imex-host-agent-leader-election")
    kube_api.put_many([o for o in objs if o is not binding])
    kc = write_kubeconfig(kube_api, tmp_path / "sa.kubeconfig",
                          account_token(kube_api, "imex-system", "imex-host-agent"))
    agent = start(kc, "--leader-elect")
    code, text = agent.wait(lambda a: "RBAC refuses" in a[1], "the missing rights named")
    assert code == 503
    # that Role holds the reports' ConfigMaps too (role-leader-election.yaml)
    assert ("not ready: RBAC refuses 5 rights the agent needs: create configmaps in "
            "namespace imex-system (storing guest reports); patch configmaps in namespace "
            "imex-system (storing guest reports); get leases.coordination.k8s.io in "
            "namespace imex-system (leader election); create leases.coordination.k8s.io in "
            "namespace imex-system (leader election); update leases.coordination.k8s.io in "
            "namespace imex-system (leader election)") in text
    # reads keep serving while it is not ready
    assert httpx.get(f"http://127.0.0.1:{agent.port}/v1/ensembles", timeout=5).status_code \
        == 200
    kube_api.put(binding)
    agent.wait(ready, "ready once the binding is there", 15)


def test_an_unreadable_token_file_is_named_until_it_can_be_read(
        kube_api: KubeApiHandle, start: Callable[..., Agent], machine_kubectl: str,
        tmp_path: Path) -> None:
    kube_api.put_many(base_rbac(machine_kubectl))
    token_file = tmp_path / "sa.token"
    kc = write_kubeconfig(kube_api, tmp_path / "sa.kubeconfig", token_file=token_file)
    agent = start(kc)
    code, text = agent.wait(lambda a: "token file" in a[1], "the token file named")
    assert code == 503
    assert f"not ready: token file {token_file} cannot be read" in text
    token_file.write_text(account_token(kube_api, "imex-system", "imex-host-agent"))
    agent.wait(ready, "ready once the token file reads", 15)


async def test_an_api_that_cannot_answer_is_named_and_the_checks_go_on(
        kube_api: KubeApiHandle, caplog: pytest.LogCaptureFixture) -> None:
    """The driver alone (kube/preflight_io.py), in this loop, quick retries: the API down
    at start is a cause of its own, said once; the checks go on and hold once it is back."""
    import asyncio
    import logging

    from host_agent.kube.client import make_client
    from host_agent.kube.preflight_io import NOT_YET, Preflight
    from host_agent.settings import HostSettings

    kube_api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    settings = HostSettings(kubeconfig=str(kube_api.kubeconfig_path))
    client = make_client(settings)
    preflight = Preflight(client, settings, retry=(0.05, 0.1))
    assert preflight.problem == NOT_YET
    caplog.set_level(logging.INFO, "imex.host")
    kube_api.outage("refuse")
    task = asyncio.create_task(preflight.run())
    try:
        for _ in range(200):  # bounded: 10 s
            if preflight.rounds >= 5:
                break
            await asyncio.sleep(0.05)
        assert preflight.problem is not None
        assert preflight.problem.startswith("cannot check the agent's rights: POST "
                                            "/apis/authorization.k8s.io/v1/"
                                            "selfsubjectaccessreviews")
        said = [r.getMessage() for r in caplog.records if "not ready" in r.getMessage()]
        assert len(said) == 1, said
        kube_api.recover()
        async with asyncio.timeout(10):
            await task
        assert preflight.problem is None
    finally:
        task.cancel()
        await client.close()
