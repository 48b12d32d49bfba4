"""The API double answers the calls of leader election and fencing as kube-apiserver does.

The same script runs against both servers, each in a fresh namespace: Lease create,
a second create (409 AlreadyExists), get, a stale update (409 Conflict), an invalid
duration (422 naming the field), a renewTime without microseconds (400, as MicroTime
decoding fails), a release with the right resourceVersion; then the preconditions
the agent's writes carry: a Service merge patch with a stale resourceVersion, a
server-side apply of a slice with a stale one, with the current one, and a delete
with a stale precondition (409 each), and an apply that creates with a made-up one
(201: ignored on create); the membership annotation removed by a merge patch
with its precondition; an ImexEnsemble's status applied with the persisted pair
(milliseconds in ``since``, ``caBundleSHA256``, ``cliquesSplit``) with the current
resourceVersion, a stale one (409) and a ``since`` that is no date-time (422).
Answers are reduced to what clients act on (code, reason,
the fields a 422 names, a projection of the object) and must be equal.

The Lease watch (every electing replica list-watches its one Lease): a list with
``fieldSelector=metadata.name=l`` beside another Lease, a watch from that list's
resourceVersion that sees MODIFIED for an update and DELETED for a delete of ``l`` and
nothing of the other Lease, and a field the Lease kind does not select on (400).
"""

from __future__ import annotations

import copy
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest

from imex_shared.model import EnsembleId
from tests.realk8s.fixtures import contract_slice, ensemble_service
from tests.realk8s.harness import Api, ControlPlane
from tests.realk8s.kubeops import SERVICES, SLICES
from tests.sandbox.kube_api.server import ThreadedKubeApi

pytestmark = pytest.mark.realk8s

LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
APPLY = "application/apply-patch+yaml"
MERGE = "application/merge-patch+json"
Ctx = dict[str, Any]
Call = Callable[[Api, str, Ctx], httpx.Response]


def lease(ns: str, holder: str = "a", **spec: Any) -> dict[str, Any]:
    return {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
            "metadata": {"name": "l", "namespace": ns},
            "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15,
                     "acquireTime": "2026-01-01T00:00:00.000000Z",
                     "renewTime": "2026-01-01T00:00:00.000000Z", "leaseTransitions": 0,
                     **spec}}


def put_lease(mutate: Callable[[dict[str, Any], Ctx], None]) -> Call:
    def call(api: Api, ns: str, ctx: Ctx) -> httpx.Response:
        body = copy.deepcopy(ctx["lease"])
        mutate(body, ctx)
        return api.request("PUT", f"{LEASES.format(ns=ns)}/l", body)
    return call


def remember(key: str) -> Callable[[httpx.Response, Ctx], None]:
    def keep(resp: httpx.Response, ctx: Ctx) -> None:
        if resp.status_code < 300:
            ctx[key] = resp.json()
    return keep


def slice_body(ns: str, ctx: Ctx, rv: str | None = None) -> dict[str, Any]:
    body = contract_slice(EnsembleId(ns, "ens"), ctx["svc"]["metadata"]["uid"],
                          [{"index": 0, "ip": "10.1.0.5", "vmi": "ens-0", "node": "n1",
                            "ready": True}])
    if rv is not None:
        body["metadata"]["resourceVersion"] = rv
    return body


STEPS: list[tuple[str, Call, Callable[[httpx.Response, Ctx], None]]] = [
    ("create Lease",
     lambda api, ns, ctx: api.request("POST", LEASES.format(ns=ns), lease(ns)), remember("lease")),
    ("create Lease again: AlreadyExists",
     lambda api, ns, ctx: api.request("POST", LEASES.format(ns=ns), lease(ns)), remember("_")),
    ("get Lease", lambda api, ns, ctx: api.request("GET", f"{LEASES.format(ns=ns)}/l"),
     remember("lease")),
    ("update with a stale resourceVersion: Conflict",
     put_lease(lambda b, ctx: b["metadata"].update(resourceVersion="1")), remember("_")),
    ("leaseDurationSeconds 0: Invalid",
     put_lease(lambda b, ctx: b["spec"].update(leaseDurationSeconds=0)), remember("_")),
    ("renewTime without microseconds: BadRequest",
     put_lease(lambda b, ctx: b["spec"].update(renewTime="2026-01-01T00:00:00Z")),
     remember("_")),
    ("take it: holder b, current resourceVersion",
     put_lease(lambda b, ctx: b["spec"].update(holderIdentity="b", leaseTransitions=1)),
     remember("lease")),
    ("the old version again: Conflict",
     put_lease(lambda b, ctx: b["spec"].update(holderIdentity="a")), remember("_")),
    ("release: no holder",
     lambda api, ns, ctx: api.request("PUT", f"{LEASES.format(ns=ns)}/l", {
         **ctx["lease"], "spec": {**ctx["lease"]["spec"], "holderIdentity": "",
                                  "leaseDurationSeconds": 1}}), remember("lease")),
    ("get a missing Lease: NotFound",
     lambda api, ns, ctx: api.request("GET", f"{LEASES.format(ns=ns)}/nope"), remember("_")),
    ("create the ensemble Service",
     lambda api, ns, ctx: api.request("POST", SERVICES.format(ns=ns), ensemble_service(ns, "ens")),
     remember("svc")),
    ("merge patch with a stale resourceVersion: Conflict",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{SERVICES.format(ns=ns)}/ens",
         {"metadata": {"resourceVersion": "1", "annotations": {"x": "y"}}}, MERGE),
     remember("_")),
    ("merge patch with the current resourceVersion",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{SERVICES.format(ns=ns)}/ens",
         {"metadata": {"resourceVersion": ctx["svc"]["metadata"]["resourceVersion"],
                       "annotations": {"x": "y"}}}, MERGE, params={"fieldManager": "t"}),
     remember("svc")),
    ("apply a new slice with a made-up resourceVersion: created",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{SLICES.format(ns=ns)}/ens-imex", slice_body(ns, ctx, "12345"), APPLY,
         params={"fieldManager": "imex-host-agent", "force": "true"}), remember("slice")),
    ("apply with a stale resourceVersion: Conflict",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{SLICES.format(ns=ns)}/ens-imex", slice_body(ns, ctx, "1"), APPLY,
         params={"fieldManager": "imex-host-agent", "force": "true"}), remember("_")),
    ("apply with the current resourceVersion",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{SLICES.format(ns=ns)}/ens-imex",
         slice_body(ns, ctx, ctx["slice"]["metadata"]["resourceVersion"]), APPLY,
         params={"fieldManager": "imex-host-agent", "force": "true"}), remember("slice")),
    ("delete with a stale precondition: Conflict",
     lambda api, ns, ctx: api.request(
         "DELETE", f"{SLICES.format(ns=ns)}/ens-imex",
         {"apiVersion": "v1", "kind": "DeleteOptions", "preconditions": {"resourceVersion": "1"}}),
     remember("_")),
    ("delete with the current precondition",
     lambda api, ns, ctx: api.request(
         "DELETE", f"{SLICES.format(ns=ns)}/ens-imex",
         {"apiVersion": "v1", "kind": "DeleteOptions",
          "preconditions": {"resourceVersion": ctx["slice"]["metadata"]["resourceVersion"]}}),
     remember("_")),
    # the persisted pair (issue 16): the annotation removed once it moved into a CR's
    # status, and the status apply that carries it, with its precondition
    ("merge patch removing an annotation, current resourceVersion",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{SERVICES.format(ns=ns)}/ens",
         {"metadata": {"resourceVersion": ctx["svc"]["metadata"]["resourceVersion"],
                       "annotations": {"x": None}}}, MERGE, params={"fieldManager": "t"}),
     remember("svc")),
    ("create an ImexEnsemble",
     lambda api, ns, ctx: api.request("POST", ENSEMBLES.format(ns=ns), ensemble(ns)),
     remember("cr")),
    ("status apply with the pair and the current resourceVersion",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{ENSEMBLES.format(ns=ns)}/ens/status",
         status_apply(ns, ctx["cr"]["metadata"]["resourceVersion"]), APPLY,
         params={"fieldManager": "imex-host-agent", "force": "true"}), remember("cr")),
    ("status apply with a stale resourceVersion: Conflict",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{ENSEMBLES.format(ns=ns)}/ens/status", status_apply(ns, "1"), APPLY,
         params={"fieldManager": "imex-host-agent", "force": "true"}), remember("_")),
    ("status apply with a since that is no date-time: Invalid",
     lambda api, ns, ctx: api.request(
         "PATCH", f"{ENSEMBLES.format(ns=ns)}/ens/status",
         status_apply(ns, None, since="yesterday"), APPLY,
         params={"fieldManager": "imex-host-agent", "force": "true"}), remember("_")),
]

ENSEMBLES = "/apis/imex-ensemble.io/v1alpha1/namespaces/{ns}/imexensembles"


def ensemble(ns: str) -> dict[str, Any]:
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
            "metadata": {"name": "ens", "namespace": ns}, "spec": {"maxMembers": 4}}


def status_apply(ns: str, rv: str | None, since: str = "2026-11-29T17:39:59.097Z"
                 ) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": "ens", "namespace": ns}
    if rv is not None:
        meta["resourceVersion"] = rv
    return {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble", "metadata": meta,
            "status": {"membershipGeneration": 1795973999097, "caBundleSHA256": "ab" * 32,
                       "cliquesSplit": True,
                       "members": [{"index": 0, "ip": "10.1.0.5", "since": since,
                                    "clique": "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10.1"}]}}


def reduce(resp: httpx.Response) -> Any:
    try:
        obj = resp.json()
    except ValueError:
        obj = {}
    if resp.status_code >= 400:
        causes = sorted({c.get("field", "") for c in (obj.get("details") or {}).get("causes")
                         or []}) if resp.status_code == 422 else None
        return (resp.status_code, obj.get("reason"), causes)
    if obj.get("kind") == "Service":  # which annotations it carries
        return (resp.status_code, "Service", sorted(obj["metadata"].get("annotations") or {}))
    if obj.get("kind") == "ImexEnsemble":  # the pair as stored, unnormalised
        st = obj.get("status") or {}
        return (resp.status_code, "ImexEnsemble",
                {k: st.get(k) for k in ("membershipGeneration", "caBundleSHA256",
                                        "cliquesSplit", "members")})
    spec = obj.get("spec") if obj.get("kind") == "Lease" else None
    return (resp.status_code, obj.get("kind"),
            (spec.get("holderIdentity"), spec.get("leaseDurationSeconds"),
             spec.get("leaseTransitions")) if spec else None)


def run(api: Api, ns: str) -> list[Any]:
    api.ok("POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    ctx: Ctx = {}
    out = []
    for _, call, after in STEPS:
        resp = call(api, ns, ctx)
        after(resp, ctx)
        out.append(reduce(resp))
    return out


@pytest.fixture
def double() -> Iterator[Api]:
    with ThreadedKubeApi() as srv:
        api = Api(srv.url, None, srv.token)
        try:
            yield api
        finally:
            api.close()


def on_both(control_plane: ControlPlane, double: Api, prefix: str,
            story: Callable[[Api, str], list[Any]]) -> tuple[list[Any], list[Any]]:
    """``story`` on the real apiserver (in a namespace deleted afterwards), then on the
    double in a namespace of the same name: the two answers, to compare."""
    admin = control_plane.admin
    assert admin is not None
    ns = f"{prefix}-{uuid.uuid4().hex[:6]}"
    try:
        real = story(admin, ns)
    finally:
        admin.delete(f"/api/v1/namespaces/{ns}")
    return real, story(double, ns)


def test_double_answers_leases_and_preconditions_as_the_real_apiserver(
        control_plane: ControlPlane, imex_crd: dict[str, Any], double: Api) -> None:
    real, fake = on_both(control_plane, double, "rk8s-lease", run)
    diffs = [f"{name}:\n    real:   {r!r}\n    double: {f!r}"
             for (name, _, _), r, f in zip(STEPS, real, fake, strict=True) if r != f]
    assert not diffs, "the API double disagrees with kube-apiserver:\n" + "\n".join(diffs)
    # the script means what it says on the real server
    codes = [r[0] for r in real]
    assert codes[1] == 409 and codes[3] == 409 and codes[4] == 422 and codes[5] == 400
    assert codes[14] == 409 and codes[16] == 409
    assert "x" in real[12][2] and "x" not in real[18][2]  # the annotation went
    assert codes[20] == 200 and codes[21] == 409 and codes[22] == 422


def watch_story(api: Api, ns: str) -> list[Any]:
    """The Lease watch's calls, reduced to what the informer acts on."""
    api.ok("POST", "/api/v1/namespaces",
           {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    leases = LEASES.format(ns=ns)
    mine = api.create(leases, lease(ns))
    other = api.create(leases, {**lease(ns, "z"), "metadata": {"name": "other", "namespace": ns}})
    only = {"fieldSelector": "metadata.name=l"}
    out: list[Any] = []
    listed = api.request("GET", leases, params=only)
    body = listed.json()
    out.append((listed.status_code, body.get("kind"),
                [i["metadata"]["name"] for i in body.get("items") or []]))
    bad = api.request("GET", leases, params={"fieldSelector": "spec.holderIdentity=a"})
    out.append(reduce(bad))
    with api.watch(leases, body["metadata"]["resourceVersion"], timeout=15,
                   params=only) as (status, events):
        out.append(status)
        released = api.ok("PUT", f"{leases}/l", {
            **mine, "spec": {**mine["spec"], "holderIdentity": "", "leaseDurationSeconds": 1}})
        api.ok("PUT", f"{leases}/other", {**other, "spec": {**other["spec"],
                                                            "holderIdentity": "y"}})
        assert api.delete(f"{leases}/other").status_code == 200
        assert api.delete(f"{leases}/l").status_code == 200
        seen = []
        for ev in events:
            obj = ev.get("object") or {}
            meta = obj.get("metadata") or {}
            seen.append((ev.get("type"), obj.get("kind"), meta.get("name"),
                         (obj.get("spec") or {}).get("holderIdentity"),
                         meta.get("resourceVersion") == released["metadata"]["resourceVersion"]))
            if ev.get("type") == "DELETED":
                break
        out.append(seen)
    return out


def test_double_list_watches_one_lease_by_field_selector_as_the_real_apiserver(
        control_plane: ControlPlane, double: Api) -> None:
    real, fake = on_both(control_plane, double, "rk8s-lwatch", watch_story)
    assert fake == real, f"the API double disagrees with kube-apiserver:\n  real:   {real!r}" \
        f"\n  double: {fake!r}"
    # the story means what it says on the real server
    assert real[0] == (200, "LeaseList", ["l"]) and real[1][0] == 400 and real[2] == 200
    assert [(t, name, holder) for t, _, name, holder, _ in real[3]] == [
        ("MODIFIED", "l", ""), ("DELETED", "l", "")]
