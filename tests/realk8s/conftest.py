"""Fixtures for the real control plane.

The binaries are built (or found warm in the cache) once, after collection and
only when a realk8s test is selected, so `make test`, which deselects the tier,
never starts a Go build, and a cold build is not charged to any test's timeout.
One control plane serves the whole session; tests isolate themselves by
namespace. Teardown runs even when a test or the start itself fails.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from tests.realk8s.agentproc import (
    AGENT_SA,
    AGENT_SA_NAMESPACE,
    CRD_MANIFESTS,
    HostAgentProc,
    apply_base_rbac,
    start_host_agent,
)
from tests.realk8s.crd import kubevirt_openapi
from tests.realk8s.harness import Api, ControlPlane, build_binaries
from tests.realk8s.installs import Helm, previous_release, wipe

OPENAPI = kubevirt_openapi()

_BIN: dict[str, Path] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return  # listing tests (tests/test_tiers.py) builds nothing
    if not any(item.get_closest_marker("realk8s") for item in session.items):
        return
    t0 = time.monotonic()
    _BIN["dir"] = build_binaries()
    took = time.monotonic() - t0
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"realk8s: binaries in {_BIN['dir']} ({took:.1f}s)")


@pytest.fixture(scope="session")
def control_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    bin_dir = _BIN.get("dir") or build_binaries()
    cp = ControlPlane(bin_dir=bin_dir, vmi_openapi=OPENAPI, audit_leases=True)
    try:
        cp.start()
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            times = ", ".join(f"{k} {v:.1f}s" for k, v in cp.startup_seconds.items())
            reporter.write_line(f"\nrealk8s: control plane up: {times}")
        yield cp
    finally:
        cp.stop()


IMEX_CRD = CRD_MANIFESTS / "crd-imexensembles.yaml"


@pytest.fixture(scope="session")
def imex_crd(control_plane: ControlPlane) -> dict[str, object]:
    """The ImexEnsemble CRD exactly as committed (manifests/crds), installed into the
    real apiserver once per session and served; yields the CRD document."""
    crd: dict[str, object] = yaml.safe_load(IMEX_CRD.read_text())
    control_plane.apply_crd(crd)
    return crd


@pytest.fixture
def admin(control_plane: ControlPlane) -> Api:
    assert control_plane.admin is not None
    return control_plane.admin


@pytest.fixture
def namespace(admin: Api) -> Iterator[str]:
    name = f"rk8s-{uuid.uuid4().hex[:8]}"
    admin.create("/api/v1/namespaces",
                 {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}})
    try:
        yield name
    finally:
        admin.delete(f"/api/v1/namespaces/{name}")


@pytest.fixture(scope="module")
def host_agent(control_plane: ControlPlane) -> Iterator[HostAgentProc]:
    """``imex-host-agent --kubeconfig`` (the installed console script) as the base
    manifests' ServiceAccount, watching every namespace, registry on loopback.

    One per test module: a cluster-wide agent left running would also publish for
    the ensembles of modules that test other deployments (the sidecar overlay)."""
    apply_base_rbac(control_plane)
    token = control_plane.service_account_token(AGENT_SA_NAMESPACE, AGENT_SA)
    kc = control_plane.write_kubeconfig(control_plane.workdir / "host-agent.kubeconfig",
                                        token, AGENT_SA)
    try:
        yield start_host_agent(control_plane, "host-agent", kc)
    finally:
        control_plane.stop_process("host-agent")


@pytest.fixture(scope="session")
def helm(control_plane: ControlPlane, tmp_path_factory: pytest.TempPathFactory) -> Helm:
    """The Helm build.sh built beside kubectl, as the session plane's admin."""
    return Helm(control_plane.bin_dir / "helm", control_plane.admin_kubeconfig,
                tmp_path_factory.mktemp("helm-home"))


@pytest.fixture(scope="session")
def install_plane(request: pytest.FixtureRequest) -> Iterator[ControlPlane]:
    """A control plane of its own for the install tests (test_install_kustomize,
    test_chart_lifecycle, test_chart_takeover): they install and remove the CRD, the
    cluster-wide roles and the agent's namespace, which the session plane's tests share.
    Started when the first of them runs; each leaves it empty (``clean_plane``)."""
    cp = ControlPlane(bin_dir=_BIN.get("dir") or build_binaries(), vmi_openapi=OPENAPI)
    try:
        cp.start()
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            times = ", ".join(f"{k} {v:.1f}s" for k, v in cp.startup_seconds.items())
            reporter.write_line(f"\nrealk8s: install plane up: {times}")
        yield cp
    finally:
        cp.stop()


@pytest.fixture
def clean_plane(install_plane: ControlPlane) -> Iterator[ControlPlane]:
    """The install plane, holding nothing of ours; emptied again afterwards."""
    wipe(install_plane)
    try:
        yield install_plane
    finally:
        wipe(install_plane)


@pytest.fixture
def install_helm(install_plane: ControlPlane, tmp_path: Path) -> Helm:
    return Helm(install_plane.bin_dir / "helm", install_plane.admin_kubeconfig,
                tmp_path / "helm-home")


@pytest.fixture(scope="session")
def previous_tree(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The previous release's manifests and agents' code (git archive, no checkout)."""
    return previous_release(tmp_path_factory.mktemp("previous-release"))
