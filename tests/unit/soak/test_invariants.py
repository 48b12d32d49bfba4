"""Invariant 4 over the API double's audit log (tests/soak/invariants.py): a host agent's
2xx write to a guarded kind while another replica held the Lease is a violation; a
refused one, another client's write and a stale Event are counted, not reported."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from tests.sandbox.kube_api.audit import Audit
from tests.soak.invariants import Continuous


def _rack(audit: Audit) -> Any:
    api = SimpleNamespace(server=SimpleNamespace(api=SimpleNamespace(audit=audit)))
    return SimpleNamespace(sbx=SimpleNamespace(api=api))


UA = "imex-host-agent/0.1 ({})"
SLICE = "/apis/discovery.k8s.io/v1/namespaces/soak/endpointslices/gb200-x"


def test_a_stale_2xx_write_is_a_violation_and_the_rest_are_counted() -> None:
    audit = Audit(("imex-system", "imex-host-agent"))
    audit.write("patch", "endpointslices", SLICE, 200, UA.format("h-a"), "h-a", None)
    audit.write("patch", "endpointslices", SLICE, 200, UA.format("h-b"), "h-a", None)
    audit.write("patch", "endpointslices", SLICE, 409, UA.format("h-b"), "h-a", None)
    audit.write("update", "imexensembles/status", "/apis/imex-ensemble.io/v1alpha1/"
                "namespaces/soak/imexensembles/gb300/status", 200, UA.format("h-c"), None,
                None)
    audit.write("create", "events", "/apis/events.k8s.io/v1/namespaces/soak/events", 201,
                UA.format("h-b"), "h-a", None)
    audit.write("update", "leases", "/apis/coordination.k8s.io/v1/namespaces/imex-system/"
                "leases/imex-host-agent", 200, UA.format("h-b"), "h-b", None)
    audit.write("patch", "services", "/api/v1/namespaces/soak/services/gb200", 200,
                "lightkube/0.15", "h-a", None)
    checks = Continuous(_rack(audit))
    found = checks.audit()
    assert [(f.invariant, f.what.split(" while")[0]) for f in found] == [
        (4, "h-b wrote patch endpointslices soak/gb200-x (200)"),
        (4, "h-c wrote update imexensembles/status soak/gb300 (200)")]
    assert "holder was h-a" in found[0].what and "holder was None" in found[1].what
    assert (checks.guarded_writes, checks.stale_refused, checks.stale_events) == (4, 1, 1)
    assert checks.audit() == []  # drained


def test_rss_growth_past_ten_percent_of_the_same_process_is_a_leak() -> None:
    from tests.soak.invariants import rss_growth

    early = {"h-a": (10, 1000), "a0": (11, 1000), "a1": (12, 1000)}
    late = {"h-a": (10, 1101), "a0": (99, 5000), "a1": (12, 1100)}
    found = rss_growth(early, late)
    assert [f.invariant for f in found] == [7] and found[0].what.startswith("h-a: RSS 1000")
