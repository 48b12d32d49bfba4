"""tests/realk8s/podspec.py without podman: the committed Deployment's flags, and refusals.

Not marked realk8s: these run with ``make test``. The base Deployment is read from the
committed file (test_image.py renders it with the tier's kubectl and runs it).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.realk8s.podspec import (
    SA_MOUNT,
    Kubelet,
    PodSpecError,
    on_host_network,
    quantity_bytes,
    quantity_cpus,
    run_args,
    run_flags,
    tls_on_loopback,
)

DEPLOYMENT = Path(__file__).resolve().parents[2] / "manifests" / "agent" / "deployment.yaml"
KUBELET = Kubelet("imex-host-agent-abc-def", "imex-system", "127.0.0.1", 6443, "/tmp/sa")


def pod() -> dict[str, Any]:
    spec: dict[str, Any] = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]
    return spec


def pairs(flags: list[str], name: str) -> list[str]:
    return [flags[i + 1] for i, f in enumerate(flags) if f == name]


def test_the_base_deployment_translates_to_its_security_limits_env_and_mounts() -> None:
    flags = run_flags(pod(), KUBELET)
    assert pairs(flags, "--user") == ["65532:65532"]
    assert {"--read-only", "--read-only-tmpfs=false", "--cap-drop=all",
            "--pull=never"} <= set(flags)
    assert pairs(flags, "--security-opt") == ["no-new-privileges"]
    assert pairs(flags, "--tmpfs") == ["/tmp:rw,mode=0777,size=16777216"]
    assert pairs(flags, "-v") == [f"/tmp/sa:{SA_MOUNT}:ro"]
    assert pairs(flags, "--memory") == [str(512 * 2**20)]
    assert pairs(flags, "--cpus") == ["1"]
    assert pairs(flags, "--stop-timeout") == ["30"]
    assert pairs(flags, "-e") == ["POD_NAME=imex-host-agent-abc-def",
                                  "PYTHONDONTWRITEBYTECODE=1",
                                  "KUBERNETES_SERVICE_HOST=127.0.0.1",
                                  "KUBERNETES_SERVICE_PORT=6443"]


def test_listen_moves_to_the_given_address_and_nothing_else_changes() -> None:
    (c,) = pod()["containers"]
    args = run_args(c)
    tail = ["--json", "--log-level=info", "--leader-elect"]
    assert args == ["--listen=0.0.0.0:8080", "--tls-listen=0.0.0.0:8443", "--tls-self-issued",
                    *tail]
    assert on_host_network(args, c, "127.0.0.1:4000") == [
        "--listen=127.0.0.1:4000", "--tls-listen=0.0.0.0:8443", "--tls-self-issued", *tail]
    assert tls_on_loopback(args, 4443) == [
        "--listen=0.0.0.0:8080", "--tls-listen=127.0.0.1:4443", "--tls-self-issued", *tail]
    c2 = copy.deepcopy(c)
    c2["args"] = ["--listen=0.0.0.0:9090", "--json"]
    with pytest.raises(PodSpecError, match="not the probes' port 8080"):
        on_host_network(run_args(c2), c2, "127.0.0.1:4000")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda p: p.update(hostNetwork=True), "pod spec: no podman translation for hostNetwork"),
    (lambda p: p["containers"][0].update(workingDir="/x"), "workingDir"),
    (lambda p: p["containers"][0]["securityContext"].update(privileged=True), "privileged"),
    (lambda p: p["volumes"].append({"name": "s", "secret": {"secretName": "x"}})
     or p["containers"][0]["volumeMounts"].append({"name": "s", "mountPath": "/s"}),
     "volume s: no podman translation for secret"),
    (lambda p: p["containers"][0]["env"].append(
        {"name": "X", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}),
     "env X: valueFrom"),
    (lambda p: p["containers"][0].update(imagePullPolicy="Always"), "imagePullPolicy Always"),
    (lambda p: p["securityContext"].update(runAsUser=0), "runAsNonRoot with runAsUser 0"),
    (lambda p: p.update(enableServiceLinks=True), "enableServiceLinks"),
])
def test_a_field_without_translation_is_refused_by_name(edit: Any, message: str) -> None:
    spec = pod()
    edit(spec)
    with pytest.raises(PodSpecError, match=message):
        run_flags(spec, KUBELET)


def test_quantities() -> None:
    assert quantity_bytes("16Mi") == 16 * 2**20
    assert quantity_bytes("1G") == 10**9
    assert quantity_cpus("500m") == "0.5"
    with pytest.raises(PodSpecError, match=r"quantity '1\.5Gi'"):
        quantity_bytes("1.5Gi")
