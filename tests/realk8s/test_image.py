"""The built host agent image, run as the base Deployment says, against the real apiserver.

``make image``'s build (tools/image.py: the local Debian base, the wheelhouse, ``podman
build --network=none --pull=never``) makes ``localhost/imex-host-agent:<version>``; the
test then renders manifests/base with the tier's kubectl and runs the image under podman
with ``--network=host`` (the apiserver listens on 127.0.0.1) and the flags the rendered
pod spec translates to (tests/realk8s/podspec.py): its uid and gid, a read-only root, the
``/tmp`` emptyDir as a tmpfs of its size limit, no capabilities, no privilege
escalation, its limits, its env (``POD_NAME`` from the pod's name) and its args. The one
change: ``--listen`` moves from the pod's own 0.0.0.0:8080 to a free loopback port, since
the pod's network is the machine's here. Credentials are the kubelet's: a TokenRequest
token of the Deployment's ServiceAccount with the CA and the namespace, mounted at the
standard path; the agent finds them itself (no --kubeconfig). It must lead, publish an
ensemble's slice, answer its probes and /metrics, and stop cleanly on SIGTERM.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from tests.realk8s.agentproc import MANIFESTS, apply_base_rbac
from tests.realk8s.container import (
    LABEL,
    PID_LABEL,
    Container,
    leftovers,
    remove_orphans,
    running,
)
from tests.realk8s.fixtures import MANAGED_BY, ensemble_service, vmi
from tests.realk8s.harness import Api, ControlPlane, free_port, wait_until
from tests.realk8s.kubeops import SERVICES, SLICES, create_vmi
from tests.realk8s.podspec import (
    Kubelet,
    on_host_network,
    run_args,
    run_flags,
    tls_on_loopback,
)
from tools import image as image_tool
from tools.image_base import podman, ulimits

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(1800)]


@pytest.fixture(scope="module")
def built(request: pytest.FixtureRequest) -> image_tool.Built:
    """``make image`` for this machine's platform (the base and wheels cached)."""
    b = image_tool.build(image_tool.native_platform())
    report = image_tool.write_report(b)
    reporter = request.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        for line in [*image_tool.summary(b), f"the full inventory: {report}"]:
            reporter.write_line(f"\nrealk8s: {line}")
    return b


def rendered_deployment(cp: ControlPlane) -> dict[str, Any]:
    objs = [o for o in yaml.safe_load_all(cp.kubectl("kustomize", str(MANIFESTS)).stdout) if o]
    (dep,) = [o for o in objs if o["kind"] == "Deployment"]
    return dep


@pytest.fixture
def token_dir(control_plane: ControlPlane) -> Iterator[Path]:
    """Where the kubelet's projected volume would be: token, ca.crt, namespace."""
    d = Path(tempfile.mkdtemp(prefix="rk8s-sa-"))
    d.chmod(0o755)  # the container's uid reads it through the bind mount
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def proc_status(box: Container) -> dict[str, str]:
    out = box.exec("cat", "/proc/1/status").stdout
    return {k: v.strip() for k, _, v in (ln.partition(":") for ln in out.splitlines())}


def lease_holder(admin: Api, ns: str) -> str:
    r = admin.request("GET", f"/apis/coordination.k8s.io/v1/namespaces/{ns}/leases/"
                             "imex-host-agent")
    return str(r.json()["spec"].get("holderIdentity") or "") if r.status_code == 200 else ""


def test_the_image_runs_as_the_deployment_says(
        control_plane: ControlPlane, imex_crd: dict[str, Any], admin: Api, namespace: str,
        built: image_tool.Built, token_dir: Path, tmp_path: Path) -> None:
    t0 = time.monotonic()
    dep = rendered_deployment(control_plane)
    pod = dep["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    repo, _, tag = container["image"].rpartition(":")
    # the manifests name the release this tree builds; run the local build of that tag
    assert (repo.rsplit("/", 1)[1], tag) == ("imex-host-agent", image_tool.project_version())
    assert built.ref == f"{image_tool.IMAGE}:{tag}"

    apply_base_rbac(control_plane)
    agent_ns, sa = dep["metadata"]["namespace"], pod["serviceAccountName"]
    token = control_plane.service_account_token(agent_ns, sa)
    for name, text in (("token", token), ("namespace", agent_ns),
                       ("ca.crt", control_plane.ca.read_text())):
        (token_dir / name).write_text(text)
        (token_dir / name).chmod(0o644)
    pod_name = f"{dep['metadata']['name']}-{uuid.uuid4().hex[:10]}-{uuid.uuid4().hex[:5]}"
    api_port = int(control_plane.server.rsplit(":", 1)[1])
    flags = run_flags(pod, Kubelet(pod_name, agent_ns, "127.0.0.1", api_port, str(token_dir)))
    port = free_port()
    args = tls_on_loopback(on_host_network(run_args(container), container,
                                           f"127.0.0.1:{port}"), free_port())
    url = f"http://127.0.0.1:{port}"
    user = f"system:serviceaccount:{agent_ns}:{sa}"
    mark = control_plane.audit_mark()

    with running(f"rk8s-image-{uuid.uuid4().hex[:8]}", built.ref, flags, args,
                 tmp_path / "agent.log") as box:
        ready = container["readinessProbe"]["httpGet"]["path"]
        wait_until(lambda: httpx.get(url + ready, timeout=2).status_code == 200,
                   f"the container's {ready}", 120, lambda: "\n" + box.logs()[-3000:])
        started = time.monotonic() - t0
        live = container["livenessProbe"]["httpGet"]["path"]
        assert httpx.get(url + live, timeout=5).status_code == 200

        # what the kernel says the agent runs as: the manifest's ids, nothing privileged
        status = proc_status(box)
        uid, gid = str(pod["securityContext"]["runAsUser"]), str(
            pod["securityContext"]["runAsGroup"])
        assert status["Uid"].split() == [uid] * 4 and status["Gid"].split() == [gid] * 4
        assert status["CapEff"] == status["CapBnd"] == "0000000000000000"
        assert status["NoNewPrivs"] == "1" and status["Seccomp"] == "2"
        mounts = {f[1]: f for f in (ln.split() for ln in
                                    box.exec("cat", "/proc/mounts").stdout.splitlines())}
        assert mounts["/"][3].split(",")[0] == "ro"
        assert mounts["/tmp"][2] == "tmpfs" and "size=16384k" in mounts["/tmp"][3]
        assert box.exec("touch", "/opt/x").returncode != 0  # read-only root
        assert box.exec("touch", "/tmp/x").returncode == 0  # the emptyDir

        # it leads, and publishes an ensemble
        wait_until(lambda: lease_holder(admin, agent_ns) == pod_name,
                   f"{pod_name} to hold the Lease", 60,
                   lambda: f"; holder {lease_holder(admin, agent_ns)!r}")
        admin.create(SERVICES.format(ns=namespace), ensemble_service(namespace, "imgtest"))
        create_vmi(admin, vmi(namespace, "imgtest-0", "imgtest", ip="10.77.0.1"))

        def published() -> bool:
            items = admin.get(SLICES.format(ns=namespace))["items"]
            return any(s["metadata"]["labels"].get("endpointslice.kubernetes.io/managed-by")
                       == MANAGED_BY and [a for e in s["endpoints"] for a in e["addresses"]]
                       == ["10.77.0.1"] for s in items)

        wait_until(published, "the ensemble's EndpointSlice", 60,
                   lambda: "\n" + box.logs()[-3000:])
        listed = httpx.get(f"{url}/v1/ensembles", timeout=5).json()
        assert (namespace, "imgtest") in {(e["namespace"], e["name"]) for e in listed["items"]}
        metrics = httpx.get(f"{url}/metrics", timeout=5).text
        assert "\nimex_host_agent_leader 1.0\n" in metrics
        assert 'imex_host_agent_slice_writes_total{op="apply"}' in metrics
        refused = [(e["verb"], e["requestURI"]) for e in control_plane.audit_events(user, mark)
                   if e.get("stage") == "ResponseComplete"
                   and e.get("responseStatus", {}).get("code") == 403]
        assert not refused, f"the manifests' RBAC refused: {refused}"

        # SIGTERM (podman stop, the pod's grace period): a clean exit that hands the lease on
        assert box.stop() == 0, box.log.read_text()[-3000:]
        assert lease_holder(admin, agent_ns) != pod_name
    print(f"\nrealk8s: image {built.ref} ready {started:.1f}s after the test began; "
          f"whole run {time.monotonic() - t0:.1f}s")


def test_a_failing_test_and_a_killed_one_leave_no_container(built: image_tool.Built,
                                                            tmp_path: Path) -> None:
    """The cleanup itself: a body that raises still ends with no container and no mount;
    a container whose test process is gone (here: a pid that has exited) is removed by
    the next run."""
    name = f"rk8s-image-fail-{uuid.uuid4().hex[:8]}"
    seen: list[Container] = []
    with pytest.raises(RuntimeError, match="the test failed"), running(
            name, built.ref, ["--entrypoint", "sleep", "--stop-timeout", "2"], ["600"],
            tmp_path / "fail.log") as box:
        seen.append(box)
        assert box.alive()
        raise RuntimeError("the test failed")
    assert leftovers(name, seen[0].id) == []

    orphan = f"rk8s-image-orphan-{uuid.uuid4().hex[:8]}"
    gone_pid = _exited_pid()
    subprocess.run(podman("run", "--detach", "--name", orphan, "--label", f"{LABEL}={orphan}",
                          "--label", f"{PID_LABEL}={gone_pid}", *ulimits(),
                          "--entrypoint", "sleep", built.ref, "600"),
                   check=True, capture_output=True, timeout=120)
    cid = subprocess.run(podman("inspect", "--format", "{{.Id}}", orphan), check=True,
                         capture_output=True, text=True).stdout.strip()
    assert orphan in remove_orphans()
    assert leftovers(orphan, cid) == []


def _exited_pid() -> int:
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid
