"""The ImexEnsemble, Event and admission-policy calls the parity test sends to both servers.

One script of REST calls, each reduced to what a client acts on: the HTTP code; for
a 422 the causes (field and message for custom resources, whose texts the double
imitates word for word; field and reason for Events); for a 409 the conflicting
fields; for a success the parts of the object the product reads or writes. Volatile
values (uids, timestamps, resourceVersions, ages) are left out or compared among
themselves. test_double_parity.py runs it against kube-apiserver and the API double.
"""

from __future__ import annotations

import copy
import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from tests.realk8s.harness import Api

Body = dict[str, Any]
Ctx = dict[str, Any]
ENS = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"
EVENTS = "/apis/events.k8s.io/v1/namespaces/{ns}/events"
CRD = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/imexensembles.imex-ensemble.io"
VAPS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicies"
VAPBS = "/apis/admissionregistration.k8s.io/v1/validatingadmissionpolicybindings"
MERGE = "application/merge-patch+json"
APPLY = "application/apply-patch+yaml"
TABLE = {"Accept": "application/json;as=Table;v=v1;g=meta.k8s.io"}


@dataclass
class Call:
    name: str
    method: str
    path: str  # {ns} and {vap} are replaced
    body: Callable[[str, Ctx], Any] = lambda ns, ctx: None
    content_type: str = "application/json"
    project: Callable[[Body, httpx.Response, Ctx], Any] = lambda o, r, ctx: None
    params: dict[str, str] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    #: 422 causes compared by (field, message); else by (field, reason)
    messages: bool = True
    #: failures compared by code, reason and fields only (messages quote whole objects)
    loose: bool = False


def ensemble(ns: str, name: str, **spec: Any) -> Body:
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": name, "namespace": ns}, "spec": spec}


def _create(name: str, **spec: Any) -> Callable[[str, Ctx], Body]:
    return lambda ns, ctx: ensemble(ns, name, **spec)


CONDITION = {"type": "Ready", "status": "True", "reason": "AllReady", "message": "3 ready",
             "lastTransitionTime": "2026-12-01T00:00:00Z"}
STATUS_A = {"publishedSummary": "1/4", "imexReady": 1, "domainStatus": "UP",
            "domainID": "0123abcd", "membersPublished": 1, "membershipGeneration": 7,
            "members": [{"index": 0, "slot": "imex-0123abcd-0", "vmi": "rack-0",
                         "ip": "10.1.0.5", "ready": True, "imexState": "READY"}],
            "conditions": [CONDITION]}
STATUS_B = {"members": [{"index": 1, "ip": "10.1.0.6"}],
            "conditions": [{**CONDITION, "type": "Degraded", "status": "False",
                            "reason": "NoProblem", "message": ""}]}


def _status_apply(status: Body) -> Callable[[str, Ctx], Body]:
    return lambda ns, ctx: {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                            "metadata": {"name": "a", "namespace": ns},
                            "status": copy.deepcopy(status)}


def _owners(obj: Body) -> Any:
    """manager -> the list-map items it owns under status (members and conditions)."""
    out = {}
    for m in obj["metadata"].get("managedFields") or []:
        st = (m.get("fieldsV1") or {}).get("f:status") or {}
        items = sorted(k for part in ("f:members", "f:conditions")
                       for k in (st.get(part) or {}) if k.startswith("k:"))
        out[(m["manager"], m["operation"], m.get("subresource", ""))] = items
    return sorted(out.items())


def _keys(obj: Body) -> Any:
    st = obj.get("status") or {}
    return ([m.get("index") for m in st.get("members") or []],
            [(c["type"], c["status"]) for c in st.get("conditions") or []])


def _rv_same(obj: Body, resp: httpx.Response, ctx: Ctx) -> Any:
    same = obj["metadata"]["resourceVersion"] == ctx.get("rv")
    return same, _keys(obj)


def _table(obj: Body, resp: httpx.Response, ctx: Ctx) -> Any:
    cols = [(c["name"], c["type"], c["format"], c["priority"], c["description"])
            for c in obj["columnDefinitions"]]
    age = next(i for i, c in enumerate(obj["columnDefinitions"]) if c["name"] == "AGE")
    rows = sorted((r["cells"][:age] + r["cells"][age + 1:],
                   isinstance(r["cells"][age], str), (r.get("object") or {}).get("kind"))
                  for r in obj["rows"])
    return obj["kind"], cols, rows


def _event(ns: str, ctx: Ctx, **change: Any) -> Body:
    body: Body = {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": change.pop("name", "a.story"), "namespace": ns},
        "eventTime": "2026-12-01T10:00:00.123456Z",
        "reportingController": "imex-ensemble.io/host-agent",
        "reportingInstance": "imex-host-agent-0", "action": "Publish",
        "reason": "MemberJoined", "type": "Normal", "note": "slot 0 joined (10.1.0.5)",
        "regarding": {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                      "namespace": ns, "name": "a", "uid": ctx.get("uid", "")},
    }
    body.update(change)
    return {k: v for k, v in body.items() if v is not None}


def _bad_event(**change: Any) -> Callable[[str, Ctx], Body]:
    return lambda ns, ctx: _event(ns, ctx, name=f"bad-{uuid.uuid4().hex[:6]}", **change)


def _event_view(obj: Body, resp: httpx.Response, ctx: Ctx) -> Any:
    return (obj.get("eventTime"), obj.get("type"), obj.get("reason"), obj.get("action"),
            obj.get("note"), obj.get("series"), obj.get("reportingController"),
            {k: v for k, v in (obj.get("regarding") or {}).items() if k != "uid"},
            sorted(k for k in obj if k.startswith("deprecated")))


def _policy(ns: str, ctx: Ctx) -> Body:
    """A policy that matches nobody (its match condition is false)."""
    return {"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicy", "metadata": {"name": ctx["vap"]},
            "spec": {"failurePolicy": "Fail",
                     "matchConstraints": {"resourceRules": [{
                         "apiGroups": [""], "apiVersions": ["v1"],
                         "operations": ["CREATE"], "resources": ["services"]}]},
                     "matchConditions": [{"name": "nobody", "expression": "false"}],
                     "validations": [{"expression": "object.spec.type == 'ClusterIP'",
                                      "reason": "Forbidden", "message": "headless only"}]}}


def _binding(ns: str, ctx: Ctx) -> Body:
    return {"apiVersion": "admissionregistration.k8s.io/v1",
            "kind": "ValidatingAdmissionPolicyBinding", "metadata": {"name": ctx["vap"]},
            "spec": {"policyName": ctx["vap"], "validationActions": ["Deny"]}}


SCRIPT: list[Call] = [
    Call("the CRD is established with its names", "GET", CRD,
         project=lambda o, r, c: (sorted((x["type"], x["status"], x["reason"], x["message"])
                                         for x in o["status"]["conditions"]),
                                  o["status"]["acceptedNames"], o["status"]["storedVersions"])),
    Call("discovery of imex-ensemble.io/v1alpha1", "GET", "/apis/imex-ensemble.io/v1alpha1",
         project=lambda o, r, c: sorted((x["name"], x["namespaced"], x["kind"],
                                         sorted(x["verbs"]), x.get("shortNames"))
                                        for x in o["resources"])),
    Call("create: defaults applied, unknown field pruned with a warning", "POST", ENS,
         _create("a", maxMembers=4, foo=1),
         project=lambda o, r, c: (o["spec"], r.headers.get("warning"), o["metadata"]["generation"],
                                  sorted(o["metadata"]["managedFields"][0]["fieldsV1"]["f:spec"]))),
    Call("create without a spec: every default", "POST", ENS,
         lambda ns, ctx: {k: v for k, v in ensemble(ns, "bare").items() if k != "spec"},
         project=lambda o, r, c: o["spec"]),
    Call("strict field validation refuses an unknown field", "POST", ENS,
         _create("strict", foo=1), params={"fieldValidation": "Strict"}),
    Call("maxMembers 0, a 63-character tokenSHA256, an unknown mode", "POST", ENS,
         _create("bad", maxMembers=0, tokenSHA256="a" * 63, mode="hostnames")),
    Call("maxMembers as a string, port out of range", "POST", ENS,
         _create("bad", maxMembers="four", port=70000)),
    Call("maxMembers above the one bound (1000)", "POST", ENS, _create("bad", maxMembers=1001)),
    Call("authEncryption with mode ips", "POST", ENS,
         _create("bad", authEncryption=True, mode="ips")),
    Call("selector: In without values, a bad label key, a bad value", "POST", ENS,
         _create("bad", memberSelector={
             "matchLabels": {"not a key": "x", "rack": "bad value!"},
             "matchExpressions": [{"key": "rack", "operator": "In"},
                                  {"key": "row", "operator": "Exists", "values": ["1"]}]})),
    Call("a spec field of the wrong type blocks the CEL rules", "POST", ENS,
         _create("bad", authEncryption="yes", mode="ips")),
    Call("maxMembers changed after creation", "PATCH", ENS + "/a",
         lambda ns, ctx: {"spec": {"maxMembers": 5}}, MERGE),
    Call("maxMembers removed: re-defaulted to 18, still a change", "PATCH", ENS + "/a",
         lambda ns, ctx: {"spec": {"maxMembers": None}}, MERGE),
    Call("authEncryption changed after creation", "PATCH", ENS + "/a",
         lambda ns, ctx: {"spec": {"authEncryption": True}}, MERGE),
    Call("a spec change moves the generation", "PATCH", ENS + "/a",
         lambda ns, ctx: {"spec": {"port": 50001, "caRotation": "2026-12"}}, MERGE,
         project=lambda o, r, c: (o["spec"], o["metadata"]["generation"])),
    Call("the main resource ignores status", "PATCH", ENS + "/a",
         lambda ns, ctx: {"status": {"publishedSummary": "9/9"}}, MERGE,
         project=lambda o, r, c: (o.get("status"), o["metadata"]["generation"])),
    Call("status applied by agent-a", "PATCH", ENS + "/a/status", _status_apply(STATUS_A), APPLY,
         params={"fieldManager": "agent-a"},
         project=lambda o, r, c: (o["status"], o["metadata"]["generation"], _owners(o))),
    Call("the status endpoint ignores spec", "PATCH", ENS + "/a/status",
         lambda ns, ctx: {"spec": {"port": 1}, "status": {"imexReady": 0}}, MERGE,
         project=lambda o, r, c: (o["spec"]["port"], o["status"]["imexReady"],
                                  o["metadata"]["generation"])),
    Call("agent-b's apply merges members by index and conditions by type", "PATCH",
         ENS + "/a/status", _status_apply(STATUS_B), APPLY, params={"fieldManager": "agent-b"},
         project=lambda o, r, c: (_keys(o), _owners(o))),
    Call("agent-a applies no members: only its own item goes", "PATCH", ENS + "/a/status",
         _status_apply({**STATUS_A, "members": []}), APPLY, params={"fieldManager": "agent-a"},
         project=lambda o, r, c: (_keys(o), _owners(o))),
    Call("agent-b changing agent-a's condition conflicts", "PATCH", ENS + "/a/status",
         _status_apply({"conditions": [{**CONDITION, "status": "False"}]}), APPLY,
         params={"fieldManager": "agent-b"}),
    Call("forced, the condition changes hands", "PATCH", ENS + "/a/status",
         _status_apply({**STATUS_B, "conditions": [*STATUS_B["conditions"],
                                                   {**CONDITION, "status": "False"}]}), APPLY,
         params={"fieldManager": "agent-b", "force": "true"},
         project=lambda o, r, c: (_keys(o), _owners(o))),
    Call("the same apply again changes nothing, not even the resourceVersion", "PATCH",
         ENS + "/a/status",
         _status_apply({**STATUS_B, "conditions": [*STATUS_B["conditions"],
                                                   {**CONDITION, "status": "False"}]}), APPLY,
         params={"fieldManager": "agent-b", "force": "true"}, project=_rv_same),
    Call("status with an unknown domain status and a member without index", "PATCH",
         ENS + "/a/status",
         lambda ns, ctx: {"status": {"domainStatus": "SIDEWAYS", "members": [{"ip": "x"}]}},
         MERGE),
    Call("status with one member index twice", "PATCH", ENS + "/a/status",
         lambda ns, ctx: {"status": {"members": [{"index": 2}, {"index": 2}]}}, MERGE),
    Call("status with a condition lacking its required fields", "PATCH", ENS + "/a/status",
         lambda ns, ctx: {"status": {"conditions": [{"type": "Ready", "status": "Maybe",
                                                     "lastTransitionTime": "yesterday"}]}},
         MERGE),
    Call("kubectl get: the Table", "GET", ENS, headers=TABLE, project=_table),
    Call("one object as a Table with the whole object", "GET", ENS + "/a", headers=TABLE,
         params={"includeObject": "Object"}, project=_table),
    Call("an Event regarding the ensemble", "POST", EVENTS, lambda ns, ctx: _event(ns, ctx),
         project=_event_view),
    Call("a repeat: the series is patched", "PATCH", EVENTS + "/a.story",
         lambda ns, ctx: {"series": {"count": 2,
                                     "lastObservedTime": "2026-12-01T11:00:05.250000+01:00"}},
         MERGE, project=_event_view),
    Call("a series time without microseconds does not decode (patch)", "PATCH",
         EVENTS + "/a.story",
         lambda ns, ctx: {"series": {"count": 3, "lastObservedTime": "2026-12-01T10:00:09Z"}},
         MERGE, loose=True),
    Call("an eventTime without microseconds does not decode (create)", "POST", EVENTS,
         _bad_event(eventTime="2026-12-01T10:00:00Z")),
    Call("the note of a recorded Event is immutable", "PATCH", EVENTS + "/a.story",
         lambda ns, ctx: {"note": "rewritten"}, MERGE, messages=False),
    Call("an Event without reportingController, action or reason", "POST", EVENTS,
         _bad_event(reportingController=None, action=None, reason=None), messages=False),
    Call("an Event of type Info", "POST", EVENTS, _bad_event(type="Info"), messages=False),
    Call("an Event with a series of one", "POST", EVENTS, _bad_event(series={"count": 1}),
         messages=False),
    Call("an Event with the deprecated count", "POST", EVENTS, _bad_event(deprecatedCount=2),
         messages=False),
    Call("an Event with a note over 1024 characters", "POST", EVENTS,
         _bad_event(note="n" * 1025), messages=False),
    Call("an Event regarding an object without namespace", "POST", EVENTS,
         _bad_event(regarding={"kind": "ImexEnsemble", "name": "a"}), messages=False),
    Call("an Event without eventTime", "POST", EVENTS, _bad_event(eventTime=None),
         messages=False),
    Call("a ValidatingAdmissionPolicy", "POST", VAPS, _policy,
         project=lambda o, r, c: (o["spec"]["failurePolicy"], o["spec"]["matchConstraints"],
                                  o["spec"]["validations"], o["spec"]["matchConditions"])),
    Call("its binding", "POST", VAPBS, _binding,
         project=lambda o, r, c: o["spec"]),
    Call("delete the binding", "DELETE", VAPBS + "/{vap}",
         project=lambda o, r, c: o.get("kind")),
    Call("delete the policy", "DELETE", VAPS + "/{vap}", project=lambda o, r, c: o.get("kind")),
    Call("delete the ensemble", "DELETE", ENS + "/a",
         project=lambda o, r, c: (o.get("kind"), o.get("status"))),
    Call("the deleted ensemble is gone", "GET", ENS + "/a"),
]


def outcome(api: Api, ns: str, call: Call, ctx: Ctx) -> Any:
    path = call.path.format(ns=ns, vap=ctx["vap"])
    body = call.body(ns, ctx)
    data = None if body is None else json.dumps(body)
    headers = dict(call.headers)
    if data is not None:
        headers["Content-Type"] = call.content_type
    resp = api.client.request(call.method, path, content=data, headers=headers,
                              params=call.params or None)
    try:
        obj = resp.json()
    except ValueError:
        obj = {}
    if resp.status_code >= 400:
        causes = (obj.get("details") or {}).get("causes") or []
        if call.loose:
            return resp.status_code, obj.get("reason"), sorted(c.get("field") for c in causes)
        if resp.status_code == 422:
            key = "message" if call.messages else "reason"
            return resp.status_code, obj.get("reason"), sorted(
                (c.get("field", ""), c.get(key, "")) for c in causes)
        if resp.status_code == 409:
            return resp.status_code, obj.get("reason"), sorted(c.get("field") for c in causes)
        return resp.status_code, obj.get("reason"), obj.get("message")
    meta = obj.get("metadata") or {}
    if call.name.startswith("create: defaults"):
        ctx["uid"] = meta.get("uid")
    result = resp.status_code, call.project(obj, resp, ctx)
    if meta.get("resourceVersion") and call.path.startswith(ENS):
        ctx["rv"] = meta["resourceVersion"]
    return result


def run(api: Api, ns: str, vap: str) -> list[Any]:
    api.ok("POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    ctx: Ctx = {"vap": vap}
    return [outcome(api, ns, call, ctx) for call in SCRIPT]
