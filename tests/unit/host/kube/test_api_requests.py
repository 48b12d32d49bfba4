"""How one Kubernetes API request is labelled in imex_host_agent_api_requests_total."""

from __future__ import annotations

import pytest

from host_agent.kube.api_requests import WRITE_VERBS, classify, resource_of

APPLY = "application/apply-patch+yaml"


@pytest.mark.parametrize(("method", "path", "params", "ctype", "want"), [
    ("GET", "/api/v1/namespaces/gpu/services/gb200", {}, None, ("get", "services")),
    ("GET", "/apis/discovery.k8s.io/v1/endpointslices", {}, None, ("list", "endpointslices")),
    ("GET", "/apis/kubevirt.io/v1/virtualmachineinstances", {"watch": "true"}, None,
     ("watch", "virtualmachineinstances")),
    ("PUT", "/apis/imex-ensemble.io/v1alpha1/namespaces/gpu/imexensembles/gb200/status", {},
     None, ("update", "imexensembles/status")),
    ("PATCH", "/apis/discovery.k8s.io/v1/namespaces/gpu/endpointslices/gb200-x", {},
     APPLY + "; charset=utf-8", ("apply", "endpointslices")),
    ("PATCH", "/api/v1/namespaces/gpu/events/e1", {}, "application/merge-patch+json",
     ("patch", "events")),
    ("POST", "/api/v1/namespaces/gpu/events", {}, None, ("create", "events")),
    ("DELETE", "/apis/discovery.k8s.io/v1/namespaces/gpu/endpointslices/s", {}, None,
     ("delete", "endpointslices")),
    ("DELETE", "/apis/discovery.k8s.io/v1/namespaces/gpu/endpointslices", {}, None,
     ("deletecollection", "endpointslices")),
    ("PUT", "/apis/coordination.k8s.io/v1/namespaces/imex-system/leases/imex", {}, None,
     ("update", "leases")),
    ("GET", "/api/v1/namespaces/imex-system", {}, None, ("get", "namespaces")),
    ("GET", "/apis", {}, None, ("discovery", "")),
    ("GET", "/api/v1", {}, None, ("discovery", "")),
    ("GET", "/healthz", {}, None, ("other", "")),
    ("OPTIONS", "/api/v1/pods", {}, None, ("other", "pods")),
])
def test_each_request_gets_its_verb_and_resource(
        method: str, path: str, params: dict[str, str], ctype: str | None,
        want: tuple[str, str]) -> None:
    assert classify(method, path, params, ctype) == want


def test_label_values_stay_bounded() -> None:
    """A path with more parts than plural/name/subresource, or a name-like odd plural,
    counts as ``other``: never a label value per object."""
    assert resource_of("/api/v1/namespaces/gpu/pods/p/log/extra") == ("other", True)
    assert resource_of("/api/v1/namespaces/gpu/Pods_X/p") == ("other", True)
    assert resource_of("/apis/g/v1") is None
    assert set(WRITE_VERBS) == {"create", "update", "patch", "apply", "delete",
                                "deletecollection"}
