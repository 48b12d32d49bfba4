"""The API double against kube-apiserver v1.37, side by side (realk8s tier, opt-in).

Runs one script of REST calls, in order, against the realk8s control plane
(tests/realk8s/harness.py: etcd, kube-apiserver, controller manager, the
VMI CRD built from KubeVirt's schema) and against the API double, and
compares what clients act on: HTTP code, Status reason, the fields a 422
names, Warning headers, and per step the parts of the object that matter
(defaults, managedFields, generation, watch event sequences). Complements
tests/realk8s/test_double_parity.py with the behaviours the double imitates
beyond that script: Service defaulting and field selectors, unknown-field
pruning, forced server-side apply, finalizers, watch selector moves, delete
responses, the mux's 404.

In the realk8s tier (`make realk8s`), on the tier's one control plane, in a
namespace of its own.
"""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from tests.realk8s.harness import ControlPlane
from tests.sandbox.kube_api.server import ThreadedKubeApi

pytestmark = [pytest.mark.realk8s, pytest.mark.timeout(600)]
Body = dict[str, Any]
Result = dict[str, Any]


def _service(name: str, **spec: Any) -> Body:
    return {"apiVersion": "v1", "kind": "Service",
            "metadata": {"name": name, "labels": {"imex-ensemble.io/ensemble": name}},
            "spec": {"clusterIP": "None", "ports": [{"name": "imex", "port": 50000}], **spec}}


def _slice(name: str, svc: str, uid: str | None, **over: Any) -> Body:
    body: Body = {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
        "metadata": {"name": name, "labels": {
            "kubernetes.io/service-name": svc,
            "endpointslice.kubernetes.io/managed-by": "host-agent.imex-ensemble.io"}},
        "addressType": "IPv4",
        "endpoints": [{"addresses": ["10.1.0.5"], "hostname": "imex-x-0",
                       "conditions": {"ready": True}}],
        "ports": [{"name": "imex", "port": 50000, "protocol": "TCP"}]}
    if uid:
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": "v1", "kind": "Service", "name": svc, "uid": uid}]
    body.update(over)
    return body


def _vmi(name: str) -> Body:
    return {"apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
            "metadata": {"name": name, "labels": {"imex-ensemble.io/ensemble": "ens"}},
            "spec": {"domain": {"devices": {}, "resources": {"requests": {"memory": "1Gi"}}}},
            "status": {"phase": "Running"}}


def _managers(obj: Body) -> Any:
    return sorted((m["manager"].split("/")[0], m["operation"], m.get("subresource", ""),
                   sorted(m.get("fieldsV1", {}))) for m in obj["metadata"].get(
                       "managedFields", []))


MERGE = {"Content-Type": "application/merge-patch+json"}
APPLY = {"Content-Type": "application/apply-patch+yaml"}


def script(c: httpx.Client, ns: str) -> dict[str, Result]:
    """Every step's reduced answer, by step name (steps depend on earlier ones)."""
    out: dict[str, Result] = {}
    svcs = f"/api/v1/namespaces/{ns}/services"
    slices = f"/apis/discovery.k8s.io/v1/namespaces/{ns}/endpointslices"
    vmis = f"/apis/kubevirt.io/v1/namespaces/{ns}/virtualmachineinstances"

    def step(name: str, resp: httpx.Response,
             view: Callable[[Body], Any] | None = None) -> Body:
        try:
            body = resp.json()
        except ValueError:
            body = {}
        got: Result = {"code": resp.status_code}
        if isinstance(body, dict) and body.get("kind") == "Status":
            got["reason"] = body.get("reason")
            got["causes"] = sorted((x.get("field"), x.get("reason")) for x in
                                   (body.get("details") or {}).get("causes") or [])
        if "warning" in resp.headers:
            got["warning"] = resp.headers["warning"]
        if view is not None and resp.status_code < 300:
            got["view"] = view(body)
        out[name] = got
        return body if isinstance(body, dict) else {}

    svc = step("headless selectorless Service defaults", c.post(svcs, json=_service("ens")),
               lambda b: (b["spec"]["type"], b["spec"]["ipFamilyPolicy"],
                          b["spec"]["ipFamilies"], b["spec"]["ports"], b.get("status")))
    step("Service name with a leading digit", c.post(svcs, json=_service("0abc")))
    step("Service with two unnamed ports", c.post(svcs, json={
        "apiVersion": "v1", "kind": "Service", "metadata": {"name": "tp"},
        "spec": {"ports": [{"port": 1}, {"port": 2}]}}))
    step("Service fieldSelector spec.clusterIP/spec.type",
         c.get(svcs, params={"fieldSelector": "spec.clusterIP=None,spec.type=ClusterIP"}),
         lambda b: sorted(i["metadata"]["name"] for i in b["items"]))
    step("VMI fieldSelector on status is refused",
         c.get(vmis, params={"fieldSelector": "status.phase=Running"}))
    step("label selector notin and !",
         c.get(svcs, params={"labelSelector": "imex-ensemble.io/ensemble notin (x),!foo"}),
         lambda b: sorted(i["metadata"]["name"] for i in b["items"]))
    uid = svc.get("metadata", {}).get("uid")
    typo = [{"addresses": ["10.1.0.5"], "hostName": "x"}]
    step("unknown field pruned with a warning",
         c.post(slices, json=_slice("u", "ens", uid, endpoints=typo)),
         lambda b: b["endpoints"])
    step("unknown field refused under Strict",
         c.post(slices, json=_slice("u2", "ens", uid, endpoints=typo),
                params={"fieldValidation": "Strict"}))
    body = json.dumps(_slice("ens-imex", "ens", uid))
    first = step("apply creates", c.patch(slices + "/ens-imex", content=body, headers=APPLY,
                                          params={"fieldManager": "agent"}), _managers)
    step("identical apply keeps the resourceVersion",
         c.patch(slices + "/ens-imex", content=body, headers=APPLY,
                 params={"fieldManager": "agent"}),
         lambda b: b["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"])
    other = json.dumps(_slice("ens-imex", "ens", uid, endpoints=[{"addresses": ["10.1.0.9"]}]))
    step("apply conflict", c.patch(slices + "/ens-imex", content=other, headers=APPLY,
                                   params={"fieldManager": "other"}))
    step("forced apply shares equal fields",
         c.patch(slices + "/ens-imex", content=other, headers=APPLY,
                 params={"fieldManager": "other", "force": "true"}),
         lambda b: sorted((m["manager"], m["operation"]) for m in b["metadata"]["managedFields"]))
    step("delete Service returns the object", c.delete(svcs + "/ens"),
         lambda b: b.get("kind"))
    deadline = time.monotonic() + 60  # the real garbage collector is asynchronous
    while any(o.get("uid") == uid for i in c.get(slices).json()["items"]
              for o in i["metadata"].get("ownerReferences") or []):
        if time.monotonic() > deadline:
            break  # the step below records what is left
        time.sleep(0.2)
    step("owned slices collected", c.get(slices),
         lambda b: sorted(i["metadata"]["name"] for i in b["items"]))

    step("VMI create drops status", c.post(vmis, json=_vmi("gb-0")),
         lambda b: (b["metadata"]["generation"], "status" in b, _managers(b)))
    rv = c.get(vmis).json()["metadata"]["resourceVersion"]
    events: list[tuple[str, str]] = []

    watching = threading.Event()

    def watch() -> None:
        # until the VMI's deletion (the script's last change it sees: a relabel out of
        # the selector is a DELETED too, without deletionTimestamp); timeoutSeconds is only
        # a backstop, so a slow machine's steps cannot outlast the watch
        with c.stream("GET", vmis, params={
                "watch": "1", "resourceVersion": rv, "timeoutSeconds": "60",
                "labelSelector": "imex-ensemble.io/ensemble=ens"}) as r:
            watching.set()
            for line in r.iter_lines():
                ev = json.loads(line)
                events.append((ev["type"], (ev["object"].get("status") or {}).get("phase", "")))
                if ev["type"] == "DELETED" and ev["object"]["metadata"].get(
                        "deletionTimestamp"):
                    break

    watcher = threading.Thread(target=watch)
    watcher.start()
    assert watching.wait(30), "the watch was not accepted"
    step("status merge patch", c.patch(vmis + "/gb-0/status", headers=MERGE, content=json.dumps(
        {"status": {"phase": "Running"}})), lambda b: (b["metadata"]["generation"], _managers(b)))
    step("label change keeps generation", c.patch(vmis + "/gb-0", headers=MERGE, content=json.dumps(
        {"metadata": {"labels": {"x": "1"}}})), lambda b: b["metadata"]["generation"])
    step("spec change bumps generation", c.patch(vmis + "/gb-0", headers=MERGE, content=json.dumps(
        {"spec": {"hostname": "h0"}})), lambda b: b["metadata"]["generation"])
    step("status apply", c.patch(vmis + "/gb-0/status", headers=APPLY, content=json.dumps({
        "apiVersion": "kubevirt.io/v1", "kind": "VirtualMachineInstance",
        "metadata": {"name": "gb-0"}, "status": {"phase": "Failed"}}),
        params={"fieldManager": "virt-handler", "force": "true"}), _managers)
    for label in ("other", "ens"):  # out of the watch's selector and back
        step(f"relabel {label}", c.patch(vmis + "/gb-0", headers=MERGE, content=json.dumps(
            {"metadata": {"labels": {"imex-ensemble.io/ensemble": label}}})))
    step("finalizer added", c.patch(vmis + "/gb-0", headers=MERGE, content=json.dumps(
        {"metadata": {"finalizers": ["x.io/f"]}})))
    step("delete with a finalizer", c.delete(vmis + "/gb-0"),
         lambda b: bool(b["metadata"].get("deletionTimestamp")))
    step("finalizer removed", c.patch(vmis + "/gb-0", headers=MERGE, content=json.dumps(
        {"metadata": {"finalizers": None}})))
    step("gone", c.get(vmis + "/gb-0"))
    watcher.join()
    out["watch events (selector moves, finalizers)"] = {"events": events}
    step("generateName", c.post(vmis, json={**_vmi("x"), "metadata": {"generateName": "g-"}}),
         lambda b: (b["metadata"]["name"][:2], len(b["metadata"]["name"])))
    step("unknown resource", c.get(f"/apis/kubevirt.io/v1/namespaces/{ns}/frobs"))
    step("PUT on a collection", c.put(vmis, json={}))
    return out


@pytest.fixture(scope="module")
def answers(control_plane: ControlPlane) -> Iterator[tuple[dict[str, Result],
                                                           dict[str, Result]]]:
    ns = f"kapi-{uuid.uuid4().hex[:6]}"
    cp = control_plane
    assert cp.admin is not None
    cp.admin.create("/api/v1/namespaces", {"apiVersion": "v1", "kind": "Namespace",
                                           "metadata": {"name": ns}})
    real = script(cp.admin.client, ns)
    with ThreadedKubeApi() as api:
        api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
        with httpx.Client(base_url=api.url, timeout=30,
                          headers={"User-Agent": "python-httpx/0.28"}) as client:
            double = script(client, ns)
    yield real, double


STEPS = [
    "headless selectorless Service defaults", "Service name with a leading digit",
    "Service with two unnamed ports", "Service fieldSelector spec.clusterIP/spec.type",
    "VMI fieldSelector on status is refused", "label selector notin and !",
    "unknown field pruned with a warning", "unknown field refused under Strict",
    "apply creates", "identical apply keeps the resourceVersion", "apply conflict",
    "forced apply shares equal fields", "delete Service returns the object",
    "owned slices collected", "VMI create drops status", "status merge patch",
    "label change keeps generation", "spec change bumps generation", "status apply",
    "relabel other", "relabel ens", "finalizer added", "delete with a finalizer",
    "finalizer removed", "gone", "watch events (selector moves, finalizers)",
    "generateName", "unknown resource", "PUT on a collection",
]


@pytest.mark.parametrize("step", STEPS)
def test_double_answers_as_kube_apiserver(
        answers: tuple[dict[str, Result], dict[str, Result]], step: str) -> None:
    real, double = answers
    assert step in real, f"the script has no step {step!r}"
    assert double.get(step) == real[step]
