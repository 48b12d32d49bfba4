"""kubectl installs the ImexEnsemble CRD and the base manifests into the API double.

The same commands a user runs against a cluster: `kubectl apply -f` of the generated
CRD into a double that starts without it, `kubectl apply -k manifests/base` (CRD,
RBAC, the Service admission policy and its binding, Deployment, NetworkPolicy), then
an ImexEnsemble and `kubectl get` with the printer columns. The machine's kubectl is
fine here (the double answers any version); the realk8s tier uses the pinned one
against the real apiserver.
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.sandbox.kube_api.server import ThreadedKubeApi

KUBECTL = shutil.which("kubectl")
REPO = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.usefixtures("machine_kubectl"),  # skips without one, fails below the floor
]
ENSEMBLE = """\
apiVersion: imex-ensemble.io/v1alpha1
kind: ImexEnsemble
metadata: {name: rack1, namespace: default}
spec: {maxMembers: 4, mode: ips}
"""


Run = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture
def kubectl(tmp_path: Path) -> Iterator[Run]:
    with ThreadedKubeApi(crds=()) as api:
        kc = api.write_kubeconfig(tmp_path / "kubeconfig")

        def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
            assert KUBECTL is not None
            return subprocess.run([KUBECTL, "--kubeconfig", str(kc), "--cache-dir",
                                   str(tmp_path / "cache"), *args], input=stdin,
                                  capture_output=True, text=True, timeout=60, check=False)
        yield run


def test_apply_the_crd_then_the_base_then_an_ensemble(kubectl: Run) -> None:
    run = kubectl
    before = run("get", "imexensembles")
    assert before.returncode != 0 and "imexensembles" in before.stderr
    crd = run("apply", "-f", str(REPO / "manifests/crds/crd-imexensembles.yaml"))
    assert crd.returncode == 0, crd.stderr
    assert "customresourcedefinition.apiextensions.k8s.io/imexensembles.imex-ensemble.io " \
        "created" in crd.stdout
    base = run("apply", "-k", str(REPO / "manifests/base"))
    assert base.returncode == 0, base.stderr
    for line in ("validatingadmissionpolicy.admissionregistration.k8s.io/"
                 "imex-host-agent-services created",
                 "validatingadmissionpolicybinding.admissionregistration.k8s.io/"
                 "imex-host-agent-services created",
                 "clusterrole.rbac.authorization.k8s.io/imex-ensemble-edit created",
                 "deployment.apps/imex-host-agent created"):
        assert line in base.stdout, base.stdout
    again = run("apply", "-k", str(REPO / "manifests/base"))
    assert again.returncode == 0, again.stderr
    # nothing a second apply would rewrite; except that kubectl always sends a
    # PodDisruptionBudget's selector (patchStrategy "replace"), so it reports that one as
    # "configured" against any server (so does kube-apiserver 1.37 with its kubectl)
    assert [line for line in again.stdout.splitlines() if not line.endswith(" unchanged")
            and not line.startswith("poddisruptionbudget.policy/")] == [], again.stdout
    made = run("apply", "-f", "-", stdin=ENSEMBLE)
    assert made.returncode == 0, made.stderr
    wide = run("get", "imexens", "-o", "wide").stdout.splitlines()
    assert wide[0].split() == ["NAME", "MEMBERS", "IMEX-READY", "READY", "DOMAIN", "AGE",
                               "MODE", "DOMAIN-ID"]
    assert wide[1].split()[0] == "rack1" and wide[1].split()[-1] == "ips"
    changed = run("apply", "-f", "-", stdin=ENSEMBLE.replace("maxMembers: 4", "maxMembers: 5"))
    assert changed.returncode != 0
    assert "spec.maxMembers" in changed.stderr and "immutable" in changed.stderr
