"""Moving a kustomize install of the previous release (commit ``PREVIOUS_RELEASE``,
its own manifests and agent code) to the chart, as docs/install.md says: Helm's
ownership annotations and label on the agent's objects, the new CRD applied, then
``helm install`` into the same namespace takes them over, and the pods roll to this
release. The registry keeps serving the same membership throughout (no gap, no
generation move), no guest rewrites a file, and the CRD and the namespace stay
outside the release.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.realk8s.harness import ControlPlane, wait_until
from tests.realk8s.installs import (
    CHART,
    CURRENT,
    Guests,
    Helm,
    RegistryMonitor,
    Site,
    get,
    previous_program,
)
from tests.realk8s.pods import AgentDeployment
from tests.sandbox.service_proxy import ServiceProxy

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(600)]

NS = "imex-system"
RELEASE = "imex-ensemble"
#: the agent's kinds in a kustomize install (not the CRD, not the Namespace: the
#: chart has neither), exactly as install.md's takeover commands name them
NAMESPACED = "serviceaccount,deployment,service,poddisruptionbudget,networkpolicy,role,rolebinding"
CLUSTER = ("clusterrole,clusterrolebinding,validatingadmissionpolicy,"
           "validatingadmissionpolicybinding")
SELECTOR = "app.kubernetes.io/part-of=imex-ensemble"


def take_over(cp: ControlPlane) -> None:
    """install.md's "Moving a kustomize install to the chart", step 1."""
    for scope in (["-n", NS, NAMESPACED], [CLUSTER]):
        cp.kubectl("annotate", *scope, "-l", SELECTOR, "--overwrite",
                   f"meta.helm.sh/release-name={RELEASE}",
                   f"meta.helm.sh/release-namespace={NS}")
        cp.kubectl("label", *scope, "-l", SELECTOR, "--overwrite",
                   "app.kubernetes.io/managed-by=Helm")


def test_a_kustomize_install_of_the_previous_release_moves_to_the_chart(
        clean_plane: ControlPlane, install_helm: Helm, previous_tree: Path,
        tmp_path: Path) -> None:
    cp, helm = clean_plane, install_helm
    assert cp.admin is not None
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
            old = {p.name for p in pods.pods}

            with RegistryMonitor(svc.url) as monitor:
                t0 = time.monotonic()
                take_over(cp)
                cp.kubectl("apply", "--server-side", "--force-conflicts",
                           "-f", str(CHART / "crds"))
                helm.run("install", RELEASE, str(CHART), "--namespace", NS,
                         "--force-conflicts")
                times["take over (annotate, CRD, helm install)"] = time.monotonic() - t0
                pods.sync(CURRENT)
                times["take over, rolled"] = time.monotonic() - t0
                time.sleep(1)
            assert monitor.gaps == [], monitor.gaps[:20]
            assert monitor.asked > 20
            assert not old & {p.name for p in pods.pods}
            site.kept(before)
            assert guests.files() == files, "a guest rewrote a file during the move"
            status = helm.run("status", RELEASE, "--namespace", NS).stdout
            assert "STATUS: deployed" in status, status
            dep = pods.read()
            assert dep is not None
            assert dep["metadata"]["labels"]["app.kubernetes.io/managed-by"] == "Helm"
            crd = get(cp.admin, "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"
                      "imexensembles.imex-ensemble.io") or {}
            ns = get(cp.admin, f"/api/v1/namespaces/{NS}") or {}
            for obj in (crd, ns):  # outside the release: helm uninstall never deletes them
                assert "meta.helm.sh/release-name" not in obj["metadata"].get(
                    "annotations", {}), obj["metadata"]["name"]
        finally:
            guests.stop()
            pods.stop_all()
    print("\nkustomize to chart: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
