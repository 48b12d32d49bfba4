"""host_agent.kube.client must import beside other lightkube users in one process."""

from __future__ import annotations

import subprocess
import sys


def test_kube_imports_after_another_generic_core_service() -> None:
    # lightkube refuses a second *generic* core-group class of one kind; a
    # test harness or plugin creating one must not break the agent's import.
    code = (
        "from lightkube.generic_resource import create_namespaced_resource;"
        "create_namespaced_resource('', 'v1', 'Service', 'services');"
        "import host_agent.kube.client as k;"
        "print(k.Service.__module__)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["lightkube.resources.core_v1"]


def test_bookmark_objects_parse_for_every_watched_kind() -> None:
    """A BOOKMARK carries only kind, apiVersion and metadata.resourceVersion."""
    from host_agent.kube.client import EndpointSlice, Service, VirtualMachineInstance, plain

    for res, api in (
        (Service, "v1"),
        (EndpointSlice, "discovery.k8s.io/v1"),
        (VirtualMachineInstance, "kubevirt.io/v1"),
    ):
        raw = {"kind": res.__name__, "apiVersion": api, "metadata": {"resourceVersion": "42"}}
        obj = res.from_dict(raw)  # what lightkube does with each watch event
        assert plain(obj)["metadata"]["resourceVersion"] == "42"


def test_typed_objects_become_plain_json() -> None:
    from lightkube.models.meta_v1 import ObjectMeta
    from lightkube.resources.core_v1 import Service

    from host_agent.kube.client import plain

    svc = Service(metadata=ObjectMeta(name="gb200", namespace="gpu", labels={"a": "b"}))
    assert plain(svc) == {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "gb200", "namespace": "gpu", "labels": {"a": "b"}},
    }
    assert plain({"kind": "X"}) == {"kind": "X"}
    assert plain(42) == {}
