"""The API double's audit and delivery logs (audit.py), seen through raw HTTP.

Two clients with their own User-Agent take turns holding a Lease; every write is logged
with the holder at its commit, a refused one with its code, and each object version a
client is sent (list, get, watch, its own write's answer) is logged for the kept kinds.
"""

from __future__ import annotations

import json
from typing import Any

import httpx

from tests.sandbox.kube_api import ThreadedKubeApi

LEASE = "/apis/coordination.k8s.io/v1/namespaces/default/leases/lead"
SVCS = "/api/v1/namespaces/default/services"


def _client(api: ThreadedKubeApi, who: str) -> httpx.Client:
    return httpx.Client(base_url=api.url, timeout=10, headers={
        "Authorization": f"Bearer {api.token}", "User-Agent": f"agent/1 ({who})"})


def _lease(holder: str, rv: str | None = None) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "lead", "namespace": "default"}
    if rv:
        meta["resourceVersion"] = rv
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease", "metadata": meta,
            "spec": {"holderIdentity": holder}}


def test_writes_carry_the_holder_at_their_commit_and_deliveries_the_reader() -> None:
    with ThreadedKubeApi() as api:
        audit = api.start_audit(("default", "lead"), keep=["services"])
        a, b = _client(api, "a"), _client(api, "b")
        try:
            r = a.post(LEASE.rsplit("/", 1)[0], json=_lease("a"))
            assert r.status_code == 201
            svc = {"apiVersion": "v1", "kind": "Service",
                   "metadata": {"name": "s", "namespace": "default"},
                   "spec": {"clusterIP": "None"}}
            assert a.post(SVCS, json=svc).status_code == 201
            r = b.put(LEASE, json=_lease("b", r.json()["metadata"]["resourceVersion"]))
            assert r.status_code == 200
            stale = a.patch(f"{SVCS}/s", content=json.dumps(
                {"metadata": {"labels": {"x": "1"}, "resourceVersion": "1"}}),
                headers={"Content-Type": "application/merge-patch+json"})
            assert stale.status_code == 409
            assert b.patch(f"{SVCS}/s", content=b'{"metadata":{"labels":{"x":"2"}}}',
                           headers={"Content-Type": "application/merge-patch+json"}
                           ).status_code == 200
            assert a.get(SVCS).status_code == 200
            with a.stream("GET", SVCS, params={"watch": "true", "resourceVersion": "1",
                                               "timeoutSeconds": "1"}) as w:
                events = [json.loads(line) for line in w.iter_lines() if line]
            assert [e["type"] for e in events] == ["ADDED", "MODIFIED"]
        finally:
            a.close()
            b.close()
        writes, deliveries = audit.drain()
        got = [(w.verb, w.resource, w.name, w.code, w.user_agent, w.holder) for w in writes]
        assert got == [
            ("create", "leases", "lead", 201, "agent/1 (a)", "a"),
            ("create", "services", "s", 201, "agent/1 (a)", "a"),
            ("update", "leases", "lead", 200, "agent/1 (b)", "b"),
            ("patch", "services", "s", 409, "agent/1 (a)", "b"),
            ("patch", "services", "s", 200, "agent/1 (b)", "b"),
        ]
        assert writes[1].obj is not None and writes[0].obj is None  # only kept kinds
        seen = [(d.user_agent, d.how, d.obj["metadata"].get("labels", {}).get("x"))
                for d in deliveries]
        assert seen == [("agent/1 (a)", "write", None), ("agent/1 (b)", "write", "2"),
                        ("agent/1 (a)", "list", "2"), ("agent/1 (a)", "watch", None),
                        ("agent/1 (a)", "watch", "2")]
        assert audit.drain() == ([], [])
