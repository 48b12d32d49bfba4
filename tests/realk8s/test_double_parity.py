"""The Kubernetes API double (tests/sandbox/kube_api) answers as the real apiserver does.

Two levels. The same fixture set (a script of REST calls with VMI, Service and EndpointSlice
bodies) runs against both, each in a fresh namespace of the same name; for every
step the answers are reduced to what clients act on (HTTP code, Status reason, the
fields a 422 names, and per step the parts of the object the agents read) and must
be equal. And the real host agent, run once against each with the same VMIs (every
shape the agent must judge), must publish the same slices and report the same
problems. A disagreement is a bug in the double (or in our reading of Kubernetes):
the step's name says where.

A second script (crd_script.py) does the same for the ImexEnsemble CRD as committed
(defaults, pruning, schema and CEL refusals with their messages, the status
subresource, generation, server-side apply merging list-type maps by key, conflicts,
the Table `kubectl get` asks for), events.k8s.io/v1 Events (create, series patch,
refusals) and ValidatingAdmissionPolicy objects.
"""

from __future__ import annotations

import contextlib
import copy
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

from imex_shared.model import EnsembleId
from tests.realk8s import crd_script
from tests.realk8s.agentproc import HostAgentProc
from tests.realk8s.fixtures import contract_slice, ensemble_service, vmi
from tests.realk8s.harness import Api, ControlPlane, end_processes, free_port, wait_until
from tests.realk8s.kubeops import SERVICES, SLICES, VMIS, create_vmi
from tests.sandbox.kube_api.server import ThreadedKubeApi

pytestmark = pytest.mark.realk8s

Body = dict[str, Any]
Project = Callable[[Body], Any]
#: resourceVersion of the ensemble's slice after the last step that wrote it
#: (one script runs at a time).
_LAST_RV: dict[str, Any] = {}


@dataclass
class Step:
    name: str
    method: str
    path: str  # {ns} is replaced
    body: Callable[[str, dict[str, Any]], Body | None] = lambda ns, ctx: None
    content_type: str = "application/json"
    project: Project = lambda obj: None
    params: dict[str, str] = field(default_factory=dict)


def _meta(obj: Body, *keys: str) -> Any:
    return tuple(obj.get("metadata", {}).get(k) for k in keys)


def _status_ifaces(obj: Body) -> Any:
    return [(i.get("name"), i.get("ipAddress")) for i in
            (obj.get("status") or {}).get("interfaces") or []]


def _slice_view(obj: Body) -> Any:
    return (obj.get("addressType"), obj.get("ports"),
            sorted((e.get("hostname"), tuple(e.get("addresses", [])),
                    e.get("conditions", {}).get("ready")) for e in obj.get("endpoints") or []),
            obj.get("metadata", {}).get("labels"))


def _names(obj: Body) -> Any:
    return sorted(i["metadata"]["name"] for i in obj.get("items", []))


def _page_view(obj: Body) -> Any:
    meta = obj.get("metadata") or {}
    return ([o["metadata"]["name"] for o in obj.get("items") or []],
            bool(meta.get("continue")), meta.get("remainingItemCount", "absent"))


def _vmi_body(ns: str, name: str, **kw: Any) -> Body:
    body = vmi(ns, name, "ens", ip="10.1.0.5", **kw)
    return body


def _without_status(body: Body) -> Body:
    out = copy.deepcopy(body)
    out.pop("status", None)
    return out


def _bad_vmi(mutate: Callable[[Body], Any]) -> Callable[[str, dict[str, Any]], Body]:
    def make(ns: str, ctx: dict[str, Any]) -> Body:
        body = _without_status(_vmi_body(ns, "bad-0"))
        mutate(body)
        return body
    return make


def _slice(ns: str, ctx: dict[str, Any], **change: Any) -> Body:
    ens = EnsembleId(ns, "ens")
    members = [{"index": 0, "ip": "10.1.0.5", "vmi": "ens-0", "node": "n1", "ready": True},
               {"index": 1, "ip": "10.1.0.6", "vmi": "ens-1", "node": "n2", "ready": False}]
    body = contract_slice(ens, ctx.get("svc_uid", str(uuid.uuid4())), members)
    for path, value in change.items():
        target: Any = body
        keys = path.split(".")
        for k in keys[:-1]:
            target = target[int(k)] if isinstance(target, list) else target[k]
        target[keys[-1]] = value
    return body


SECRETS = "/api/v1/namespaces/{ns}/secrets"


def _ca_secret(ns: str, ctx: dict[str, Any], **data: str) -> Body:
    """The shape host_agent/ca/secret_io.py writes (issue 19): a dotted name, base64 data."""
    body: Body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
                  "metadata": {"name": "imex-ca-gpu.gb200", "namespace": ns,
                               "labels": {"imex-ensemble.io/ca": "true"},
                               "annotations": {"imex-ensemble.io/ca-rotation": ""}},
                  "data": {"ca.crt": "Y2VydA==", "ca.key": "a2V5"}}
    body["data"].update(data)
    return body


def _ca_secret_update(ns: str, ctx: dict[str, Any], rv: str | None = None,
                      **data: str) -> Body:
    body = _ca_secret(ns, ctx, **data)
    body["metadata"]["resourceVersion"] = rv if rv is not None else ctx["secret_rv"]
    return body


def _secret_view(obj: Body) -> Any:
    return (obj.get("type"), obj.get("data"), obj.get("stringData"),
            _meta(obj, "name", "annotations", "labels"))


def _status_put(ns: str, ctx: dict[str, Any]) -> Body:
    obj: Body = copy.deepcopy(ctx["vmi"])
    obj["status"] = _vmi_body(ns, "ens-0")["status"]
    return obj


STEPS: list[Step] = [
    Step("create VMI: status in a create is dropped", "POST", VMIS,
         lambda ns, ctx: _vmi_body(ns, "ens-0"),
         project=lambda o: (_meta(o, "name", "namespace", "labels"), _status_ifaces(o),
                            o["spec"]["domain"]["devices"]["interfaces"])),
    Step("get VMI", "GET", VMIS + "/ens-0", project=lambda o: _status_ifaces(o)),
    Step("PUT VMI /status sets status", "PUT", VMIS + "/ens-0/status", _status_put,
         project=_status_ifaces),
    Step("merge-patch VMI /status", "PATCH", VMIS + "/ens-0/status",
         lambda ns, ctx: {"status": {"interfaces": [{"name": "default",
                                                     "ipAddress": "10.1.0.9"}]}},
         "application/merge-patch+json", project=_status_ifaces),
    Step("merge-patch main resource ignores status", "PATCH", VMIS + "/ens-0",
         lambda ns, ctx: {"metadata": {"labels": {"x": "y"}},
                          "status": {"phase": "Failed"}},
         "application/merge-patch+json",
         project=lambda o: (o["metadata"]["labels"].get("x"),
                            (o.get("status") or {}).get("phase"))),
    Step("strategic merge patch on a CRD is refused", "PATCH", VMIS + "/ens-0",
         lambda ns, ctx: {"metadata": {"labels": {"x": "z"}}},
         "application/strategic-merge-patch+json"),
    Step("create VMI twice: AlreadyExists", "POST", VMIS,
         lambda ns, ctx: _without_status(_vmi_body(ns, "ens-0"))),
    Step("get missing VMI: NotFound", "GET", VMIS + "/nope"),
    Step("VMI without spec.domain: Invalid", "POST", VMIS,
         _bad_vmi(lambda b: b["spec"].pop("domain"))),
    Step("VMI cores as string: Invalid", "POST", VMIS,
         _bad_vmi(lambda b: b["spec"]["domain"]["cpu"].update(cores="four"))),
    Step("VMI interface without name: Invalid", "POST", VMIS,
         _bad_vmi(lambda b: b["spec"]["domain"]["devices"]["interfaces"][0].pop("name"))),
    Step("list VMIs by ensemble label existence", "GET", VMIS,
         params={"labelSelector": "imex-ensemble.io/ensemble"}, project=_names),
    Step("list VMIs by label value mismatch", "GET", VMIS,
         params={"labelSelector": "imex-ensemble.io/ensemble=other"}, project=_names),
    Step("create headless selector-less Service", "POST", SERVICES,
         lambda ns, ctx: ensemble_service(ns, "ens"),
         project=lambda o: (o["spec"].get("clusterIP"), o["spec"].get("clusterIPs"),
                            o["spec"].get("selector"), o["spec"]["ports"][0]["name"],
                            o["spec"].get("type"))),
    Step("create contract EndpointSlice", "POST", SLICES, _slice, project=_slice_view),
    Step("server-side apply of the same slice", "PATCH", SLICES + "/ens-imex",
         lambda ns, ctx: _slice(ns, ctx), "application/apply-patch+yaml",
         params={"fieldManager": "imex-host-agent", "force": "true"},
         project=_slice_view),
    Step("server-side apply with nothing changed keeps resourceVersion", "PATCH",
         SLICES + "/ens-imex", lambda ns, ctx: _slice(ns, ctx),
         "application/apply-patch+yaml",
         params={"fieldManager": "imex-host-agent", "force": "true"},
         project=lambda o: o["metadata"]["resourceVersion"] == _LAST_RV.get("slice")),
    Step("update with a stale resourceVersion: Conflict", "PUT", SLICES + "/ens-imex",
         lambda ns, ctx: _slice(ns, ctx, **{"metadata.resourceVersion": "1"})),
    Step("slice with DESIGN.md's managed-by value: Invalid", "POST", SLICES,
         lambda ns, ctx: _slice(ns, ctx, **{
             "metadata.name": "bad-label",
             "metadata.labels": {"kubernetes.io/service-name": "ens",
                                 "endpointslice.kubernetes.io/managed-by":
                                     "imex-ensemble.io/host-agent"}})),
    Step("slice with an upper-case hostname: Invalid", "POST", SLICES,
         lambda ns, ctx: _slice(ns, ctx, **{"metadata.name": "bad-host",
                                            "endpoints.0.hostname": "Imex-0"})),
    Step("slice with a loopback address", "POST", SLICES,
         lambda ns, ctx: _slice(ns, ctx, **{"metadata.name": "loop",
                                            "endpoints.0.addresses": ["127.0.0.1"]})),
    Step("slice with a link-local address", "POST", SLICES,
         lambda ns, ctx: _slice(ns, ctx, **{"metadata.name": "linklocal",
                                            "endpoints.0.addresses": ["169.254.1.1"]})),
    Step("slice with an IPv6 address in an IPv4 slice: Invalid", "POST", SLICES,
         lambda ns, ctx: _slice(ns, ctx, **{"metadata.name": "v6",
                                            "endpoints.0.addresses": ["fd00::1"]})),
    # the CA Secrets (issue 19): GET by name, create, update with a resourceVersion
    Step("get a missing Secret: NotFound", "GET", SECRETS + "/imex-ca-gpu.gb200"),
    Step("create the CA Secret", "POST", SECRETS, _ca_secret, project=_secret_view),
    Step("create it twice: AlreadyExists", "POST", SECRETS, _ca_secret),
    Step("get the CA Secret", "GET", SECRETS + "/imex-ca-gpu.gb200", project=_secret_view),
    Step("update it (rotation)", "PUT", SECRETS + "/imex-ca-gpu.gb200",
         lambda ns, ctx: _ca_secret_update(ns, ctx, **{"previous.crt": "b2xk"}),
         project=_secret_view),
    Step("update with a stale resourceVersion: Conflict", "PUT",
         SECRETS + "/imex-ca-gpu.gb200",
         lambda ns, ctx: _ca_secret_update(ns, ctx, rv=ctx["secret_rv0"])),
    Step("update without a change keeps resourceVersion", "PUT",
         SECRETS + "/imex-ca-gpu.gb200",
         lambda ns, ctx: _ca_secret_update(ns, ctx, **{"previous.crt": "b2xk"}),
         project=lambda o: o["metadata"]["resourceVersion"] == _LAST_RV.get("secret")),
    Step("data that is not base64: BadRequest", "POST", SECRETS,
         lambda ns, ctx: {**_ca_secret(ns, ctx, **{"ca.crt": "!!"}),
                          "metadata": {"name": "bad-b64", "namespace": ns}}),
    Step("a data key with a slash: Invalid", "POST", SECRETS,
         lambda ns, ctx: {**_ca_secret(ns, ctx, **{"a/b": "eA=="}),
                          "metadata": {"name": "bad-key", "namespace": ns}}),
    # paged lists (the informers list with limit/continue): a second VMI makes two pages
    Step("create a second VMI", "POST", VMIS,
         lambda ns, ctx: _without_status(_vmi_body(ns, "ens-1")),
         project=lambda o: _meta(o, "name")),
    Step("page VMIs by label: a continue, no remainingItemCount", "GET", VMIS,
         params={"labelSelector": "imex-ensemble.io/ensemble", "limit": "1"},
         project=_page_view),
    Step("page VMIs without a selector: the rest is counted", "GET", VMIS,
         params={"limit": "1"}, project=_page_view),
    Step("delete VMI", "DELETE", VMIS + "/ens-0"),
    Step("get deleted VMI: NotFound", "GET", VMIS + "/ens-0"),
]


def outcome(api: Api, ns: str, step: Step, ctx: dict[str, Any]) -> Any:
    body = step.body(ns, ctx)
    resp = api.request(step.method, step.path.format(ns=ns), body,
                       content_type=step.content_type, params=step.params or None)
    try:
        obj = resp.json()
    except ValueError:
        obj = {}
    if resp.status_code >= 400:
        causes = sorted({c.get("field", "") for c in
                         (obj.get("details") or {}).get("causes") or []}) \
            if resp.status_code == 422 else None
        return (resp.status_code, obj.get("reason"), causes)
    if step.name.startswith("create VMI:"):
        ctx["vmi"] = obj
    if step.name.startswith("create headless"):
        ctx["svc_uid"] = obj["metadata"]["uid"]
    if step.path.startswith(SECRETS) and step.method in ("POST", "PUT"):
        rv = obj.get("metadata", {}).get("resourceVersion")
        ctx.setdefault("secret_rv0", rv)
        ctx["secret_rv"] = rv
    result = (resp.status_code, step.project(obj))
    if step.path == SLICES + "/ens-imex" or step.name.startswith("create contract"):
        _LAST_RV["slice"] = obj.get("metadata", {}).get("resourceVersion")
    if step.path.startswith(SECRETS):
        _LAST_RV["secret"] = obj.get("metadata", {}).get("resourceVersion")
    return result


def run_script(api: Api, ns: str) -> list[Any]:
    ctx: dict[str, Any] = {}
    _LAST_RV.clear()
    api.ok("POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    return [outcome(api, ns, step, ctx) for step in STEPS]


@pytest.fixture
def double_srv() -> Iterator[ThreadedKubeApi]:
    with ThreadedKubeApi() as srv:
        yield srv


@pytest.fixture
def double(double_srv: ThreadedKubeApi) -> Iterator[Api]:
    api = Api(double_srv.url, None, double_srv.token)
    try:
        yield api
    finally:
        api.close()


def test_double_answers_the_fixture_script_as_the_real_apiserver(
        control_plane: ControlPlane, double: Api) -> None:
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-parity-{uuid.uuid4().hex[:6]}"
    real = run_script(admin, ns)
    try:
        fake = run_script(double, ns)
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")
    diffs = [f"{step.name}:\n    real:   {r!r}\n    double: {f!r}"
             for step, r, f in zip(STEPS, real, fake, strict=True) if r != f]
    assert not diffs, "the API double disagrees with kube-apiserver:\n" + "\n".join(diffs)


def test_double_serves_the_imexensemble_crd_events_and_policies_as_the_real_apiserver(
        control_plane: ControlPlane, imex_crd: dict[str, Any], double: Api) -> None:
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-crdparity-{uuid.uuid4().hex[:6]}"
    vap = f"rk8s-parity-{uuid.uuid4().hex[:6]}"
    try:
        real = crd_script.run(admin, ns, vap)
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")
        admin.delete(f"{crd_script.VAPBS}/{vap}")
        admin.delete(f"{crd_script.VAPS}/{vap}")
    fake = crd_script.run(double, ns, vap)
    diffs = [f"{call.name}:\n    real:   {r!r}\n    double: {f!r}"
             for call, r, f in zip(crd_script.SCRIPT, real, fake, strict=True) if r != f]
    assert not diffs, "the API double disagrees with kube-apiserver:\n" + "\n".join(diffs)


# ---- the host agent on the same fixtures, against both ---------------------------

def _fixture_vmis(ns: str) -> list[Body]:
    """Members in every shape the agent must judge: usable, masquerade-internal address,
    not yet running, not ready, a duplicated slot, an index out of range."""
    return [
        vmi(ns, "mix-0", "mix", ip="10.30.0.10", node="n0"),
        vmi(ns, "mix-1", "mix", ip="10.30.0.11", node="n1", ready=False),
        vmi(ns, "mix-2", "mix", ip="10.0.2.2", node="n2"),
        vmi(ns, "mix-3", "mix", node="n3", phase="Scheduling"),
        vmi(ns, "dup-a", "mix", ip="10.30.0.20", node="n4", index=5),
        vmi(ns, "dup-b", "mix", ip="10.30.0.21", node="n5", index=5),
        vmi(ns, "mix-9", "mix", ip="10.30.0.30", node="n6"),
        vmi(ns, "mix-6", "mix", ip="10.30.0.16", node="n7"),
    ]


def _published(api: Api, ns: str) -> Any:
    r = api.request("GET", SLICES.format(ns=ns))
    if r.status_code != 200:
        return None
    return sorted(
        (s["metadata"]["name"], s["addressType"],
         sorted((e["hostname"], tuple(e["addresses"]), e["conditions"].get("ready"),
                 e.get("nodeName"), e["targetRef"]["name"]) for e in s.get("endpoints") or []),
         s["metadata"]["labels"].get("endpointslice.kubernetes.io/managed-by"))
        for s in r.json()["items"])


@contextlib.contextmanager
def _agent_on_double(double_srv: ThreadedKubeApi, tmp_path: Path) -> Iterator[tuple[Api, int]]:
    """A second host agent against the double (log in ``tmp_path/agent.log``), beside the
    module's agent on the real apiserver: (a client of the double, the agent's port)."""
    dbl = Api(double_srv.url, None, double_srv.token)
    kc = double_srv.write_kubeconfig(tmp_path / "double.kubeconfig")
    port = free_port()
    agent = subprocess.Popen(
        [str(Path(sys.executable).with_name("imex-host-agent")), "--kubeconfig", str(kc),
         "--listen", f"127.0.0.1:{port}"],
        stdout=(tmp_path / "agent.log").open("wb"), stderr=subprocess.STDOUT)
    try:
        yield dbl, port
    finally:
        end_processes(agent)
        dbl.close()


def _settled_on_both(admin: Api, dbl: Api, ready: Callable[[Api], Callable[[], bool]],
                     view: Callable[[Api], Any], what: str, real_timeout: float,
                     tmp_path: Path) -> tuple[Any, Any]:
    """Wait until ``ready`` holds on the real apiserver, then on the double (the second
    agent's log tail on a timeout); ``view`` of each, to compare."""
    wait_until(ready(admin), f"{what} on the real apiserver", real_timeout)
    wait_until(ready(dbl), f"{what} on the double", 60,
               lambda: (tmp_path / "agent.log").read_text()[-3000:])
    return view(admin), view(dbl)


def test_host_agent_publishes_the_same_slices_on_double_and_real(
        control_plane: ControlPlane, host_agent: HostAgentProc, double_srv: ThreadedKubeApi,
        tmp_path: Path) -> None:
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-mix-{uuid.uuid4().hex[:6]}"
    with _agent_on_double(double_srv, tmp_path) as (dbl, port):
        for api in (admin, dbl):
            api.ok("POST", "/api/v1/namespaces",
                   {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
            api.create(SERVICES.format(ns=ns), ensemble_service(ns, "mix", max_members=8))
            for body in _fixture_vmis(ns):
                create_vmi(api, body)
        want_hosts = {EnsembleId(ns, "mix").slot(i) for i in (0, 1, 6)}

        def settled(api: Api) -> Callable[[], bool]:
            def check() -> bool:
                pub = _published(api, ns)
                return bool(pub) and {e[0] for e in pub[0][2]} == want_hosts
            return check

        real, fake = _settled_on_both(admin, dbl, settled, lambda api: _published(api, ns),
                                      "agent publishes", 60, tmp_path)
        assert real == fake, f"real: {real}\ndouble: {fake}"
        problems = [
            httpx.get(f"{url}/v1/ensembles/{ns}/mix", timeout=5).json()["problems"]
            for url in (host_agent.registry, f"http://127.0.0.1:{port}")]
        assert problems[0] == problems[1]
        assert problems[0], "the duplicated slot and the out-of-range index are problems"
        admin.delete(f"/api/v1/namespaces/{ns}")


def _cr_story(api: Api, ns: str) -> Any:
    """What the agent wrote for ImexEnsemble ``crs`` (clock-made values left out): its
    Service, the status it wrote through /status, and the reasons of its Events."""
    svc = api.request("GET", f"{SERVICES.format(ns=ns)}/crs")
    cr = api.request("GET", f"/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles/crs")
    events = api.request("GET", f"/apis/events.k8s.io/v1/namespaces/{ns}/events")
    if svc.status_code != 200 or cr.status_code != 200 or events.status_code != 200:
        return None
    s, status = svc.json(), cr.json().get("status") or {}
    return {
        "service": (s["metadata"].get("labels"),
                    {k: v for k, v in (s["metadata"].get("annotations") or {}).items()
                     if k != "imex-ensemble.io/membership"},  # the leader's wall clock
                    [(r["kind"], r["name"], r.get("controller"), r.get("blockOwnerDeletion"))
                     for r in s["metadata"].get("ownerReferences") or []],
                    s["spec"].get("clusterIP"), s["spec"].get("ports")),
        "status": {k: v for k, v in status.items()
                   if k not in ("membershipGeneration", "conditions", "members")},
        "members": sorted((m["index"], m["slot"], m["ip"], m.get("vmi"), m.get("imexState"))
                          for m in status.get("members") or []),
        "conditions": sorted((c["type"], c["status"], c["reason"])
                             for c in status.get("conditions") or []),
        "events": sorted({e["reason"] for e in events.json()["items"]
                          if e["regarding"]["kind"] == "ImexEnsemble"}),
    }


def test_host_agent_writes_the_same_service_status_and_events_on_double_and_real(
        control_plane: ControlPlane, imex_crd: dict[str, Any], host_agent: HostAgentProc,
        double_srv: ThreadedKubeApi, tmp_path: Path) -> None:
    """An ImexEnsemble's calls (Service POST and apply, /status apply, Event POST) on both."""
    admin = control_plane.admin
    assert admin is not None
    ns = f"rk8s-crs-{uuid.uuid4().hex[:6]}"
    try:
        with _agent_on_double(double_srv, tmp_path) as (dbl, _):
            for api in (admin, dbl):
                api.ok("POST", "/api/v1/namespaces",
                       {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
                api.create(f"/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles",
                           {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                            "metadata": {"name": "crs", "namespace": ns},
                            "spec": {"maxMembers": 4, "network": "default"}})
                for i in range(2):
                    create_vmi(api, vmi(ns, f"crs-{i}", "crs", ip=f"10.31.0.{i + 10}",
                                        node=f"n{i}"))

            def told(api: Api) -> Callable[[], bool]:
                def check() -> bool:
                    story = _cr_story(api, ns)
                    return bool(story) and len(story["members"]) == 2 and \
                        {"ServiceCreated", "MemberJoined"} <= set(story["events"])
                return check

            # the agent lists ImexEnsembles again every 30 s if it started before the CRD
            real, fake = _settled_on_both(admin, dbl, told, lambda api: _cr_story(api, ns),
                                          "the agent's story", 90, tmp_path)
            assert real == fake, f"real: {real}\ndouble: {fake}"
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")
