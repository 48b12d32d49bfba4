"""The host agent's Deployment as local processes (TEST STAND-IN for the Deployment
controller and the kubelet): the realk8s tier has a real apiserver and no kubelet, so
"installing" applies the objects and this runs the pods they describe.

What a pod is here: the container's ``args`` exactly as the Deployment in the apiserver
says, after ``program`` (the installed ``imex-host-agent``, or an older release's code
for upgrade tests), with what the pod would get from its node:

- ``--listen``: each pod has its own network namespace with port 8080 in a cluster;
  here every pod gets 127.0.0.1 and a free port (the flag's value is replaced, the
  flag itself must be in the args);
- ``POD_NAME`` (the Deployment's fieldRef ``metadata.name``): a pod name
  ``imex-host-agent-<template hash>-<n>``; literal env values as written;
- the ServiceAccount's credentials: a token from the TokenRequest API for the pod
  spec's ``serviceAccountName``, in a kubeconfig (``--kubeconfig``: in a pod, the
  in-cluster config), and ``IMEX_AGENT_NAMESPACE`` (a pod reads its service
  account's namespace file).

``sync`` does what the Deployment controller does when the Deployment (re)appears,
changes or goes: a new Deployment's replicas start together; with strategy
RollingUpdate (maxSurge 1, maxUnavailable 0, as the chart and manifests say; checked)
one new pod is started and must be ready (/readyz 200) and in the Service before one
old pod leaves the Service and gets SIGTERM, and the next new pod starts without
waiting for that one to exit (a terminating pod no longer counts); with Recreate every
old pod is gone first; a deleted Deployment's pods all get SIGTERM at once. A pod's
"template" is the pod spec JSON and the program, so a new release's code counts as a
new template, as a new image does.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from tests.realk8s.harness import Api, ControlPlane, free_port, wait_until
from tests.realk8s.podspec import tls_on_loopback
from tests.sandbox.service_proxy import ServiceProxy

DEPLOYMENT = "imex-host-agent"


@dataclass
class Pod:
    name: str
    template: str
    port: int
    popen: subprocess.Popen[bytes]
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.popen.poll() is None

    def tail(self, chars: int = 3000) -> str:
        try:
            return f"\n--- {self.log} ---\n" + self.log.read_text(errors="replace")[-chars:]
        except OSError:
            return ""


@dataclass
class Program:
    """How a pod's container starts: ``argv`` before the Deployment's args, ``env`` on
    top of the test's (PYTHONPATH for an older release's tree)."""

    argv: Sequence[str]
    env: Mapping[str, str] = field(default_factory=dict)
    label: str = "current"


def token_for(api: Api, namespace: str, account: str) -> str:
    """A token of ``account`` from the TokenRequest API (the account must exist: the
    install made it; nothing is created here)."""
    tr = api.create(f"/api/v1/namespaces/{namespace}/serviceaccounts/{account}/token",
                    {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenRequest",
                     "spec": {"expirationSeconds": 7200}})
    return str(tr["status"]["token"])


@dataclass
class AgentDeployment:
    cp: ControlPlane
    namespace: str
    workdir: Path
    service: ServiceProxy
    program: Program
    pods: list[Pod] = field(default_factory=list)
    terminating: list[Pod] = field(default_factory=list)
    started: int = 0

    @property
    def api(self) -> Api:
        assert self.cp.admin is not None
        return self.cp.admin

    def read(self) -> dict[str, Any] | None:
        resp = self.api.request(
            "GET", f"/apis/apps/v1/namespaces/{self.namespace}/deployments/{DEPLOYMENT}")
        if resp.status_code == 404:
            return None
        resp.raise_for_status()
        out: dict[str, Any] = resp.json()
        return out

    def template_of(self, dep: Mapping[str, Any]) -> str:
        spec = json.dumps(dep["spec"]["template"], sort_keys=True)
        return hashlib.sha256(f"{spec}\0{self.program.label}".encode()).hexdigest()[:10]

    def spawn_pod(self, dep: Mapping[str, Any]) -> Pod:
        """One pod of ``dep``, started (not yet ready, not yet in the Service)."""
        spec = dep["spec"]["template"]["spec"]
        (container,) = spec["containers"]
        template = self.template_of(dep)
        self.started += 1
        name = f"{DEPLOYMENT}-{template}-{self.started}"
        port = free_port()
        args = list(container.get("args") or [])
        listen = [i for i, a in enumerate(args) if a.startswith("--listen")]
        assert len(listen) == 1, f"the Deployment's args name no single --listen: {args}"
        args[listen[0]] = f"--listen=127.0.0.1:{port}"
        args = tls_on_loopback(args, free_port())
        env = {}
        for e in container.get("env") or []:
            if "value" in e:
                env[e["name"]] = e["value"]
            elif e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") == "metadata.name":
                env[e["name"]] = name
            else:
                raise AssertionError(f"env {e['name']}: this stand-in knows no such source")
        account = spec["serviceAccountName"]
        kubeconfig = self.cp.write_kubeconfig(
            self.workdir / f"{name}.kubeconfig", token_for(self.api, self.namespace, account),
            account)
        log = self.workdir / f"{name}.log"
        with log.open("ab") as out:
            popen = subprocess.Popen(
                [*self.program.argv, *args, "--kubeconfig", str(kubeconfig)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                start_new_session=True, cwd=self.workdir,
                env={**os.environ, **self.program.env, **env,
                     "IMEX_AGENT_NAMESPACE": self.namespace})
        pod = Pod(name, template, port, popen, log)
        self.pods.append(pod)
        return pod

    def ready(self, *pods: Pod) -> None:
        """Until every one of ``pods`` answers /readyz 200; each joins the Service then."""
        waiting = list(pods)

        def check() -> bool:
            for pod in list(waiting):
                if not pod.alive():
                    raise AssertionError(f"{pod.name} exited {pod.popen.returncode}"
                                         f"{pod.tail()}")
                if httpx.get(f"{pod.url}/readyz", timeout=2).status_code == 200:
                    self.service.add(pod.port)
                    waiting.remove(pod)
            return not waiting

        wait_until(check, f"{', '.join(p.name for p in pods)} /readyz", 90,
                   lambda: "".join(p.tail() for p in waiting))

    def terminate(self, pod: Pod) -> None:
        """Out of the Service, then SIGTERM; the pod no longer counts (as a terminating
        pod does not for its ReplicaSet). ``reap`` waits for it."""
        self.service.remove(pod.port)
        if pod.alive():
            os.killpg(pod.popen.pid, signal.SIGTERM)
        self.pods.remove(pod)
        self.terminating.append(pod)

    def reap(self, grace: float = 30) -> None:
        """Every terminating pod gone (SIGKILL after ``grace``, the Deployment's
        terminationGracePeriodSeconds)."""
        for pod in self.terminating:
            try:
                pod.popen.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(pod.popen.pid, signal.SIGKILL)
                pod.popen.wait(10)
        self.terminating.clear()

    def sync(self, program: Program | None = None) -> None:
        """Bring the pods to what the Deployment now says (its template, its replicas;
        none when it is gone), the way its strategy says; ``program``: the release's
        code from now on. Returns once the old pods are gone."""
        if program is not None:
            self.program = program
        dep = self.read()
        if dep is None:  # the garbage collector deletes its ReplicaSets' pods at once
            for pod in list(self.pods):
                self.terminate(pod)
            self.reap()
            return
        template = self.template_of(dep)
        replicas = int(dep["spec"].get("replicas", 1))
        strategy = dep["spec"].get("strategy", {})
        if strategy.get("type") == "Recreate":
            for pod in [p for p in self.pods if p.template != template]:
                self.terminate(pod)
            self.reap()
        else:
            assert strategy.get("rollingUpdate") == {"maxSurge": 1, "maxUnavailable": 0}, \
                f"this stand-in rolls with maxSurge 1, maxUnavailable 0 only: {strategy}"
        if not self.pods:  # nothing to keep available: every replica at once
            self.ready(*[self.spawn_pod(dep) for _ in range(replicas)])

        def new() -> list[Pod]:
            return [p for p in self.pods if p.template == template]

        while True:
            old = [p for p in self.pods if p.template != template]
            if not old and len(new()) == replicas:
                break
            if len(new()) < replicas:
                self.ready(self.spawn_pod(dep))  # surge: one more than replicas at most
            if old and len(self.pods) > replicas:
                self.terminate(old[0])
            elif not old and len(new()) > replicas:
                self.terminate(new()[-1])
        self.reap()

    def stop_all(self) -> None:
        for pod in list(self.pods):
            self.terminate(pod)
        self.reap(grace=10)
