"""The kustomize install's life on the real control plane: the previous release
(commit ``PREVIOUS_RELEASE``, its own manifests and its own agent code) upgraded to
this one with ``kubectl apply -k manifests/base``; the agent removed alone with
``kubectl delete -k manifests/agent`` and put back; then everything removed on
purpose in docs/install.md's order ("Remove").

The agent's pods are processes run as the Deployment in the apiserver says
(tests/realk8s/pods.py), behind a Service stand-in, with three real guest agents
reading the registry through it. The upgrade must keep the registry serving the same
membership throughout (no gap, no generation move) and no guest may rewrite a file;
removing the agent must keep the CRD, the namespace, the ensembles, their Services and
slices and the CA Secrets.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.realk8s.harness import ControlPlane, wait_until
from tests.realk8s.installs import (
    CURRENT,
    ENS,
    REPO,
    USER_NS,
    Guests,
    RegistryMonitor,
    Site,
    get,
    previous_program,
)
from tests.realk8s.kubeops import SERVICES, SLICES
from tests.realk8s.pods import AgentDeployment
from tests.sandbox.service_proxy import ServiceProxy

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(600)]

MANIFESTS = REPO / "manifests"
NS = "imex-system"


def test_upgrade_from_the_previous_release_then_remove_the_agent_then_everything(
        clean_plane: ControlPlane, previous_tree: Path, tmp_path: Path) -> None:
    cp = clean_plane
    assert cp.admin is not None
    api = cp.admin
    times: dict[str, float] = {}
    site = Site(cp, agent_ns=NS)
    with ServiceProxy() as svc:
        pods = AgentDeployment(cp, NS, tmp_path, svc, previous_program(previous_tree))
        guests = Guests(tmp_path, svc.url, cp.dns_port)
        try:
            cp.kubectl("apply", "-k", str(previous_tree / "manifests" / "base"))
            wait_until(site.crd_exists, "the previous release's CRD", 30)
            pods.sync()
            site.create()
            site.published()
            guests.start()
            before, files = site.snapshot(), guests.files()

            with RegistryMonitor(svc.url) as monitor:
                t0 = time.monotonic()
                cp.kubectl("apply", "-k", str(MANIFESTS / "base"))
                pods.sync(CURRENT)
                times["upgrade (apply -k base, rolled)"] = time.monotonic() - t0
                time.sleep(1)
            assert monitor.gaps == [], monitor.gaps[:20]
            assert monitor.asked > 20
            assert all(p.template == pods.template_of(pods.read() or {}) for p in pods.pods)
            site.kept(before)
            assert guests.files() == files, "a guest rewrote a file during the upgrade"

            # the agent alone goes: nothing of what it made, nor the CRD, nor the namespace
            t0 = time.monotonic()
            cp.kubectl("delete", "-k", str(MANIFESTS / "agent"), "--wait=true")
            pods.sync()
            times["delete -k agent"] = time.monotonic() - t0
            assert not pods.pods
            assert site.crd_exists()
            assert get(api, f"/api/v1/namespaces/{NS}") is not None
            time.sleep(2)  # what a GC or a cascading delete would do, it would do by now
            site.kept(before)
            assert guests.files() == files, "a guest rewrote a file while no agent ran"

            cp.kubectl("apply", "-k", str(MANIFESTS / "base"))
            pods.sync()
            with RegistryMonitor(svc.url) as monitor:
                time.sleep(1)
            assert monitor.gaps == []
            site.kept(before)

            # everything, on purpose, in install.md's order: the ensembles, the agent,
            # the CRD, the namespace
            t0 = time.monotonic()
            cp.kubectl("delete", "imexensembles", "--all", "--all-namespaces", "--wait=true")
            for name in before:
                wait_until(lambda n=name: get(api, f"{SERVICES.format(ns=USER_NS)}/{n}")
                           is None and get(api, f"{SLICES.format(ns=USER_NS)}/{n}-imex")
                           is None, f"{name}'s Service and slice collected", 60)
            cp.kubectl("delete", "-k", str(MANIFESTS / "agent"), "--wait=true")
            pods.sync()
            cp.kubectl("delete", "-k", str(MANIFESTS / "crds"), "--wait=true")
            cp.kubectl("delete", "-k", str(MANIFESTS / "namespace"), "--wait=true",
                       timeout=120)
            times["remove everything"] = time.monotonic() - t0
            assert not site.crd_exists()
            assert get(api, f"/api/v1/namespaces/{NS}") is None
            assert get(api, site.ca_secret("rack-b")) is None
            assert get(api, f"/api/v1/namespaces/{USER_NS}") is not None  # the user's
            assert api.request("GET", ENS.format(ns=USER_NS)).status_code == 404
        finally:
            guests.stop()
            pods.stop_all()
    print("\nkustomize install: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
