"""The realnode tier's session: the realk8s control plane on the node bridge's address,
one real node (tests/realnode/node.py), the host agent's image imported into containerd.

Builds (both warm in well under a second): tests/realk8s/build.sh for the control plane
and tests/realk8s/build_node.sh for the node (a cache key of its own). Needs root.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.realk8s.crd import kubevirt_openapi
from tests.realk8s.harness import ControlPlane, HarnessError, build_binaries
from tests.realnode import images
from tests.realnode.host import (
    GATEWAY,
    KUBERNETES_SERVICE_IP,
    LOCK,
    SERVICE_CIDR,
    network_up,
    sweep,
)
from tests.realnode.node import CONTROLLERS, Node

NODE_BUILD = Path(__file__).resolve().parents[1] / "realk8s" / "build_node.sh"


def build_node_binaries(timeout: float = 7200.0) -> Path:
    """Run build_node.sh (seconds when warm); ``REALNODE_BIN`` names ready binaries."""
    override = os.environ.get("REALNODE_BIN")
    if override:
        return Path(override)
    try:
        proc = subprocess.run(["bash", str(NODE_BUILD)], check=True, stdout=subprocess.PIPE,
                              text=True, timeout=timeout)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as exc:
        raise HarnessError(f"{NODE_BUILD} failed: {exc}") from exc
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="session")
def agent_image() -> str:
    """The image ``make image`` built for this tree's version (podman's store), or
    ``REALNODE_IMAGE`` (another tag); ``REALNODE_IMAGE_ARCHIVE``: a ``podman save``
    archive of it to import instead of saving one from podman's store."""
    return os.environ.get("REALNODE_IMAGE") or f"{images.AGENT_REPO}:{images.agent_version()}"


@pytest.fixture(scope="session")
def node(request: pytest.FixtureRequest, agent_image: str) -> Iterator[Node]:
    if os.geteuid() != 0:
        pytest.fail("the realnode tier needs root (bridge, nftables, mounts, cgroups)")
    lock = LOCK.open("w")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pytest.fail(f"another realnode run holds {LOCK}")
    request.addfinalizer(lock.close)
    if not os.environ.get("REALNODE_IMAGE_ARCHIVE"):
        images.require_agent_image(agent_image)  # before minutes of building and starting
    t0 = time.monotonic()
    cp_bin, node_bin = build_binaries(), build_node_binaries()
    built = time.monotonic() - t0
    sweep()  # what a killed run left
    cp = ControlPlane(bin_dir=cp_bin, vmi_openapi=kubevirt_openapi(), address=GATEWAY,
                      service_cidr=SERVICE_CIDR, endpoint_reconciler="lease",
                      extra_sans=(KUBERNETES_SERVICE_IP,), controllers=CONTROLLERS,
                      apiserver_args=("--kubelet-preferred-address-types=InternalIP",))
    n = Node(cp, node_bin)
    try:
        network_up()
        cp.start()
        n.start()
        t = time.monotonic()
        archive = Path(os.environ.get("REALNODE_IMAGE_ARCHIVE") or images.save_agent_image(
            agent_image, n.workdir / "agent.tar"))
        images.ctr_import(node_bin / "ctr", n.containerd_sock, archive)
        n.startup_seconds["agent image import"] = time.monotonic() - t
        reporter = request.config.pluginmanager.get_plugin("terminalreporter")
        if reporter is not None:
            def fmt(times: dict[str, float]) -> str:
                return ", ".join(f"{k} {v:.1f}s" for k, v in times.items())

            reporter.write_line(f"\nrealnode: builds {built:.1f}s; control plane: "
                                f"{fmt(cp.startup_seconds)}; node: {fmt(n.startup_seconds)}")
        yield n
    finally:
        n.stop()
        cp.stop()
        sweep()
