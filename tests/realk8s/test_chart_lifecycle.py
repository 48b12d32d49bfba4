"""The chart's life on the real control plane, as an operator lives it: ``helm install``
(the CRD from crds/), an upgrade (the new CRD first, then ``helm upgrade`` with changed
values: log level, memory limit, priority class), ``helm uninstall``, and ``helm install`` again.

The agent's pods are processes run as the Deployment in the apiserver says
(tests/realk8s/pods.py), behind a Service stand-in; two ImexEnsembles (one with
authEncryption) with VMIs, and three real guest agents reading the registry through
that Service. Throughout: the registry never answers anything but the same
membership, no ensemble's generation moves, no guest rewrites a file; after the
uninstall the ensembles, their Services and slices and the CA Secrets are all still
there, and the second install adopts them as they are. The times are printed.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import pytest
import yaml

from tests.realk8s.harness import ControlPlane
from tests.realk8s.installs import CHART, CRD, CURRENT, Guests, Helm, RegistryMonitor, Site, get
from tests.realk8s.pods import AgentDeployment
from tests.sandbox.service_proxy import ServiceProxy

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(600)]

NS = "imex-ops"  # not imex-system: the chart installs into --namespace


def older_chart(dest: Path) -> Path:
    """The chart as a previous version would have it: its CRD without the DOMAIN-ID
    printer column (so an upgrade has a CRD change to bring)."""
    chart = dest / "imex-ensemble"
    shutil.copytree(CHART, chart)
    crd_file = chart / "crds" / "imexensembles.yaml"
    crd = yaml.safe_load(crd_file.read_text())
    (version,) = crd["spec"]["versions"]
    version["additionalPrinterColumns"] = [
        c for c in version["additionalPrinterColumns"] if c["name"] != "DOMAIN-ID"]
    crd_file.write_text(yaml.safe_dump(crd))
    return chart


def columns(cp: ControlPlane) -> list[str]:
    assert cp.admin is not None
    crd = get(cp.admin, CRD) or {}
    return [c["name"] for c in crd["spec"]["versions"][0]["additionalPrinterColumns"]]


def timed(times: dict[str, float], what: str, t0: float) -> None:
    times[what] = time.monotonic() - t0


def test_install_upgrade_uninstall_and_install_again(clean_plane: ControlPlane,
                                                     install_helm: Helm,
                                                     tmp_path: Path) -> None:
    cp, helm = clean_plane, install_helm
    times: dict[str, float] = {}
    site = Site(cp, agent_ns=NS)
    with ServiceProxy() as svc:
        pods = AgentDeployment(cp, NS, tmp_path, svc, CURRENT)
        guests = Guests(tmp_path, svc.url, cp.dns_port)
        try:
            # install: Helm creates the CRD from crds/, then the release's objects
            t0 = time.monotonic()
            helm.run("install", "imex-ensemble", str(older_chart(tmp_path)), "--namespace", NS,
                     "--create-namespace")
            timed(times, "helm install", t0)
            pods.sync()
            timed(times, "install (helm install, both replicas ready)", t0)
            assert "DOMAIN-ID" not in columns(cp)
            site.create()
            site.published()
            guests.start()
            before, files = site.snapshot(), guests.files()

            # upgrade: the CRDs first (Helm never upgrades crds/), then the release
            with RegistryMonitor(svc.url) as monitor:
                t0 = time.monotonic()
                # Helm created the CRD by server-side apply as manager "helm": kubectl's
                # apply conflicts on .spec.versions until it takes the fields over
                plain = cp.kubectl("apply", "--server-side", "-f", str(CHART / "crds"),
                                   check=False)
                assert plain.returncode != 0 and 'conflict with "helm"' in plain.stderr
                cp.kubectl("apply", "--server-side", "--force-conflicts",
                           "-f", str(CHART / "crds"))
                assert "DOMAIN-ID" in columns(cp)
                helm.run("upgrade", "imex-ensemble", str(CHART), "--namespace", NS,
                         "--set", "logLevel=debug", "--set", "resources.limits.memory=768Mi",
                         "--set", "priorityClassName=system-cluster-critical")
                timed(times, "helm upgrade (CRDs applied first)", t0)
                pods.sync()
                timed(times, "upgrade (both replicas rolled)", t0)
                time.sleep(1)
            assert monitor.gaps == [], monitor.gaps[:20]
            assert monitor.asked > 20
            dep = pods.read()
            assert dep is not None
            pod_spec = dep["spec"]["template"]["spec"]
            assert "--log-level=debug" in pod_spec["containers"][0]["args"]
            assert pod_spec["priorityClassName"] == "system-cluster-critical"
            assert len(pods.pods) == 2 and all(p.template == pods.template_of(dep)
                                               for p in pods.pods)
            site.kept(before)
            assert guests.files() == files, "a guest rewrote a file during the upgrade"

            # uninstall: the release's objects go; the CRD, the ensembles, their Services
            # and slices, the CA Secrets and the namespace stay
            t0 = time.monotonic()
            helm.run("uninstall", "imex-ensemble", "--namespace", NS)
            timed(times, "helm uninstall", t0)
            pods.sync()
            timed(times, "uninstall (pods gone)", t0)
            assert pods.read() is None and not pods.pods
            assert cp.admin is not None
            for path in (f"/api/v1/namespaces/{NS}/serviceaccounts/imex-host-agent",
                         "/apis/rbac.authorization.k8s.io/v1/clusterroles/imex-host-agent",
                         "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies/"
                         "imex-host-agent-services"):
                assert get(cp.admin, path) is None, f"{path} outlived helm uninstall"
            assert site.crd_exists()
            assert get(cp.admin, f"/api/v1/namespaces/{NS}") is not None
            time.sleep(2)  # what a GC or a cascading delete would do, it would do by now
            site.kept(before)
            assert guests.files() == files, "a guest rewrote a file while no agent ran"

            # install again: the same ensembles, adopted as they are
            t0 = time.monotonic()
            helm.run("install", "imex-ensemble", str(CHART), "--namespace", NS)
            timed(times, "helm install again", t0)
            pods.sync()
            timed(times, "reinstall (both replicas ready)", t0)
            with RegistryMonitor(svc.url) as monitor:
                time.sleep(2)
            assert monitor.gaps == [], monitor.gaps[:20]
            site.kept(before)
            for name, snap in before.items():
                got = monitor.want[name]
                assert (got[0], got[1]) == (snap["membershipGeneration"], snap["domainID"])
            assert guests.files() == files, "a guest rewrote a file after the reinstall"
        finally:
            guests.stop()
            pods.stop_all()
    print("\nchart lifecycle: " + ", ".join(f"{k} {v:.1f}s" for k, v in times.items()))
