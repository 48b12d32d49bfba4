"""The realk8s soak's invariant 4 reads kube-apiserver's own audit log (tests/soak/apiaudit.py).

Unit tests pin the rule on lines shaped by hand; this checks the shape itself: requests
sent with a host agent's User-Agent to the real apiserver, a Lease moving from ``ha-1``
to ``ha-2``, and the ledger fed the log's real lines must find exactly the one 2xx write
``ha-1`` made after the move, count its refused attempt, and pass ``ha-2``'s.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.realk8s.fixtures import ensemble_service
from tests.realk8s.harness import Api, ControlPlane
from tests.realk8s.kubeops import SERVICES
from tests.soak.apiaudit import Ledger, parse

pytestmark = pytest.mark.realk8s

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"


def as_agent(ident: str) -> dict[str, str]:
    return {"User-Agent": f"imex-host-agent/0.3.0 ({ident})"}


def test_the_ledger_finds_the_stale_write_in_the_real_audit_log(
        control_plane: ControlPlane, admin: Api, namespace: str) -> None:
    ns = namespace
    mark = control_plane.audit_mark()
    lease: dict[str, Any] = admin.ok("POST", LEASES.format(ns=ns), {
        "apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
        "metadata": {"name": "imex-host-agent", "namespace": ns},
        "spec": {"holderIdentity": "ha-1", "leaseDurationSeconds": 4}},
        headers=as_agent("ha-1"))
    svc = admin.ok("POST", SERVICES.format(ns=ns), ensemble_service(ns, "gb200"),
                   headers=as_agent("ha-1"))
    lease["spec"]["holderIdentity"] = "ha-2"
    admin.ok("PUT", f"{LEASES.format(ns=ns)}/imex-host-agent", lease, headers=as_agent("ha-2"))
    path = f"{SERVICES.format(ns=ns)}/gb200"
    admin.ok("PATCH", path, {"metadata": {"labels": {"by": "ha-1"}}},
             content_type="application/merge-patch+json", headers=as_agent("ha-1"))
    refused = admin.request("PUT", path, svc, headers=as_agent("ha-1"))  # old version
    assert refused.status_code == 409
    admin.ok("PATCH", path, {"metadata": {"labels": {"by": "ha-2"}}},
             content_type="application/merge-patch+json", headers=as_agent("ha-2"))

    lines = control_plane.audit_log.read_text().splitlines()[mark:]
    events = [ev for ln in lines if (ev := parse(ln)) is not None]
    ledger = Ledger(ns, "imex-host-agent")
    found = ledger.feed(events, final=True)
    assert [h for _, h in ledger.holders] == ["ha-1", "ha-2"], "the answers name the holder"
    assert len(found) == 1, found
    assert found[0].startswith(f"ha-1 wrote patch services {ns}/gb200 (200)")
    assert found[0].endswith("while the Lease holder was ha-2")
    assert (ledger.guarded_writes, ledger.stale_refused) == (4, 1)
