"""The real-API host benchmark's pure parts: the fleet as API requests, https targets."""

from __future__ import annotations

import ssl

import pytest

from tests.bench.host_scale import fleet_requests
from tests.bench.kube_proc import NAMESPACE, member_ip
from tests.bench.loadgen import HttpError, split_url, tls_context


def test_fleet_is_written_in_phases_that_must_not_overlap() -> None:
    ns, creates, statuses = fleet_requests(2, 3)
    # the VMs' namespace and the agent's own (imex-system: the agent is not ready without it)
    assert [(m, p, o["metadata"]["name"]) for m, p, o in ns] == [
        ("POST", "/api/v1/namespaces", NAMESPACE), ("POST", "/api/v1/namespaces", "imex-system")]
    kinds = [obj["kind"] for _, _, obj in creates]
    assert kinds.count("Service") == 2 and kinds.count("VirtualMachineInstance") == 6
    for _, _, obj in creates:
        assert "uid" not in obj["metadata"]  # the apiserver assigns it
        assert "status" not in obj  # a subresource: ignored on create
    vmis = f"/apis/kubevirt.io/v1/namespaces/{NAMESPACE}/virtualmachineinstances"
    assert [(m, p) for m, p, _ in statuses] == [
        ("PATCH", f"{vmis}/e{e}-{i}/status") for e in range(2) for i in range(3)]
    first = statuses[0][2]["status"]
    assert first["phase"] == "Running"
    assert first["interfaces"][0]["ipAddress"] == member_ip(0, 0)


def test_https_targets_get_a_verifying_context_and_http_none() -> None:
    assert split_url("https://127.0.0.1:6443") == ("127.0.0.1", 6443, "/")
    assert split_url("https://api.internal/x?y=1") == ("api.internal", 443, "/x?y=1")
    ctx = tls_context("https://127.0.0.1:6443", None)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert tls_context("http://127.0.0.1:8080", None) is None
    with pytest.raises(HttpError, match="only http"):
        split_url("ftp://127.0.0.1/")
