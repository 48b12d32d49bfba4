"""The reconciler with ImexEnsembles: the owned Service, adoption, conflicts, one code path.

No API: a fake Service client whose writes land in the Service store (as the informer
would deliver them, or later, to imitate informer lag) and the fake slice client of
test_reconcile.py.
"""

from __future__ import annotations

import asyncio
import copy
from dataclasses import replace
from typing import Any

from prometheus_client import CollectorRegistry

from host_agent.ensembles.cr_spec import Declaration
from host_agent.ensembles.owned_service_io import ServiceApplier
from host_agent.ensembles.slices_io import SliceApplier
from host_agent.kube.cache import Store
from host_agent.kube.client import AlreadyExists
from host_agent.metrics import HostMetrics
from host_agent.reconcile.reconcile import new_stores
from host_agent.reconcile.reconcile_io import Reconciler
from host_agent.state.store import State
from imex_shared.model import EnsembleId
from tests.host_support.ensembles import CR_UID, imex_ensemble
from tests.host_support.kubevirt import service, vmi
from tests.unit.host.reconcile.test_reconcile import SETTINGS, FakeClient, _idle, cancel, put

ENS = EnsembleId("rack1", "gb200")


class FakeServices:
    """create/apply as the API answers them; ``deliver=False`` holds writes back from the
    store (informer lag) until ``flush``."""

    def __init__(self, store: Store, rec: list[Reconciler]) -> None:
        self.store = store
        self.rec = rec
        self.calls: list[str] = []
        self.taken: set[str] = set()  # names held by Services the informer cannot see
        self.deliver = True
        self.held: list[dict[str, Any]] = []
        self.rv = 500

    def _stored(self, body: dict[str, Any], old: dict[str, Any] | None) -> dict[str, Any]:
        self.rv += 1
        obj = copy.deepcopy(old) if old is not None else {"metadata": {}}
        meta = obj["metadata"]
        for key in ("labels", "annotations"):
            meta[key] = {**meta.get(key, {}), **body["metadata"].get(key, {})}
        refs = [r for r in meta.get("ownerReferences", [])
                if r["uid"] not in {b["uid"] for b in body["metadata"]["ownerReferences"]}]
        meta["ownerReferences"] = refs + body["metadata"]["ownerReferences"]
        meta.update(name=body["metadata"]["name"], namespace=body["metadata"]["namespace"],
                    resourceVersion=str(self.rv))
        meta.setdefault("uid", f"svc-{self.rv}")
        obj.update(apiVersion="v1", kind="Service")
        obj["spec"] = {**obj.get("spec", {}), **body["spec"]}
        return obj

    def _land(self, obj: dict[str, Any]) -> None:
        if self.deliver:
            old = self.store.put(obj)
            self.rec[0].on_service(old, obj)
        else:
            self.held.append(obj)

    def flush(self) -> None:
        self.deliver = True
        for obj in self.held:
            self._land(obj)
        self.held.clear()

    async def create_service(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        self.calls.append("create:" + name)
        if name in self.taken or self.store.get("rack1", name) is not None:
            raise AlreadyExists("409", 409)
        obj = self._stored(body, None)
        self._land(obj)
        return obj

    async def apply_service(self, body: dict[str, Any]) -> dict[str, Any]:
        name = body["metadata"]["name"]
        self.calls.append("apply:" + name)
        obj = self._stored(body, self.store.get("rack1", name))
        self._land(obj)
        return obj


class World:
    def __init__(self) -> None:
        self.vmis, self.services, self.slices = new_stores()
        self.crs = Store("imexensemble")
        self.slice_client = FakeClient(self.slices)
        self.metrics = HostMetrics(CollectorRegistry())
        self.state = State()
        box: list[Reconciler] = []
        self.svc_client = FakeServices(self.services, box)
        self.declared: list[tuple[Any, Declaration | None]] = []
        self.rec = Reconciler(
            replace(SETTINGS, conflict_recheck=0.05), self.state, self.vmis, self.services,
            self.slices, SliceApplier(self.slice_client, self.slices.get), self.metrics,
            crs=self.crs, owned=ServiceApplier(self.svc_client, self.services.get),
            on_declared=lambda k, d: self.declared.append((k, d)))
        box.append(self.rec)
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        ready = asyncio.Event()
        ready.set()
        self.task = asyncio.create_task(self.rec.run([ready]))
        await self.idle()

    async def idle(self) -> None:
        await asyncio.wait_for(_idle(self.rec), 5)

    async def stop(self) -> None:
        assert self.task is not None
        await cancel(self.task)

    def last(self) -> Declaration | None:
        return self.declared[-1][1]


async def test_a_cr_creates_its_service_and_publishes_through_it() -> None:
    w = World()
    put(w.crs, w.rec, imex_ensemble(maxMembers=4, tokenSHA256="ab" * 32), "cr")
    put(w.vmis, w.rec, vmi("gb200-1", ip="10.0.0.2"), "vmi")
    await w.start()
    assert w.svc_client.calls == ["create:gb200"]
    svc = w.services.get("rack1", "gb200")
    assert svc is not None
    assert svc["metadata"]["ownerReferences"][0]["uid"] == CR_UID
    assert svc["metadata"]["annotations"]["imex-ensemble.io/max-members"] == "4"
    snap = w.state.get(ENS)
    assert snap is not None and snap.spec.source == "cr" and snap.spec.max_members == 4
    assert snap.spec.uid == svc["metadata"]["uid"]  # the slices' owner is the Service
    assert [m.member.index for m in snap.members] == [1]
    owner = w.slices.get("rack1", "gb200-imex")["metadata"]["ownerReferences"][0]  # type: ignore[index]
    assert (owner["kind"], owner["uid"]) == ("Service", svc["metadata"]["uid"])
    actions = [d.service_action for _, d in w.declared if d is not None]
    assert actions == ["create", "own"]  # the Service's event coming back: one more pass
    d = w.last()
    assert d is not None and d.refusals == () and d.service_wrote is None
    assert d.uid == CR_UID and d.generation == 1
    # the Service's own event and more passes write nothing more
    w.rec.enqueue(("rack1", "gb200"), 0)
    await w.idle()
    assert w.svc_client.calls == ["create:gb200"]
    assert w.slice_client.calls == ["apply:gb200-imex"]
    await w.stop()


async def test_informer_lag_after_create_is_not_a_foreign_service() -> None:
    w = World()
    w.svc_client.deliver = False
    put(w.crs, w.rec, imex_ensemble(), "cr")
    await w.start()
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1"), "vmi")  # a pass before the echo
    await w.idle()
    assert w.svc_client.calls == ["create:gb200"]
    d = w.last()
    assert d is not None and d.refusals == () and d.service_action == "own"
    w.svc_client.flush()
    await w.idle()
    assert w.svc_client.calls == ["create:gb200"]
    snap = w.state.get(ENS)
    assert snap is not None and len(snap.members) == 1
    await w.stop()


async def test_adoption_keeps_domain_generation_and_slices() -> None:
    """Service-only ensemble -> ImexEnsemble of the same name: nothing a guest sees moves."""
    w = World()
    put(w.services, w.rec, service(annotations={"imex-ensemble.io/max-members": "18"}),
        "service")
    for i in range(3):
        put(w.vmis, w.rec, vmi(f"gb200-{i}", ip=f"10.0.0.{i + 1}"), "vmi")
    await w.start()
    before = w.state.get(ENS)
    assert before is not None and before.spec.source == "service"
    slice_before = w.slices.get("rack1", "gb200-imex")
    put(w.crs, w.rec, imex_ensemble(), "cr")
    await w.idle()
    assert w.svc_client.calls == ["apply:gb200"]
    svc = w.services.get("rack1", "gb200")
    assert svc is not None and svc["metadata"]["uid"] == "6f0f1d5e-0000-4000-8000-000000000001"
    assert svc["metadata"]["ownerReferences"][0]["controller"] is True
    after = w.state.get(ENS)
    assert after is not None and after.spec.source == "cr"
    assert after.generation == before.generation  # no guest wakes up
    assert after.ens.domain_id == before.ens.domain_id
    assert w.slice_client.calls == ["apply:gb200-imex"]  # the slice was already right
    assert w.slices.get("rack1", "gb200-imex") == slice_before
    adopted = [d for _, d in w.declared if d is not None and d.service_action == "adopt"]
    assert len(adopted) == 1 and adopted[0].service_wrote == "apply"
    assert w.metrics.service_writes.labels("adopt")._value.get() == 1  # type: ignore[attr-defined]
    await w.stop()


async def test_a_foreign_service_is_left_alone_and_looked_at_again() -> None:
    w = World()
    w.svc_client.taken.add("gb200")  # an unlabelled Service the informer does not show
    put(w.crs, w.rec, imex_ensemble(), "cr")
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1"), "vmi")
    ready = asyncio.Event()
    ready.set()
    w.task = asyncio.create_task(w.rec.run([ready]))
    await until(lambda: bool(w.declared))
    assert w.state.get(ENS) is None and w.slice_client.calls == []
    d = w.last()
    assert d is not None and d.spec is None
    assert d.refusals[0][0] == "ServiceConflict"
    assert "exists and is not labelled imex-ensemble.io/ensemble=gb200" in d.refusals[0][1]
    await until(lambda: w.svc_client.calls.count("create:gb200") >= 2)  # looked at again
    assert w.state.get(ENS) is None
    w.svc_client.taken.clear()  # the other Service is deleted: no event tells us
    await until(lambda: w.state.get(ENS) is not None)
    assert w.svc_client.calls[-1] == "create:gb200"
    await w.stop()


async def until(probe: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not probe():  # noqa: ASYNC110 - the reconciler offers no event for these
            await asyncio.sleep(0.01)


async def test_a_service_of_another_controller_keeps_working_as_before() -> None:
    w = World()
    svc = service(annotations={"imex-ensemble.io/max-members": "4"})
    svc["metadata"]["ownerReferences"] = [{"apiVersion": "apps/v1", "kind": "Deployment",
                                           "name": "x", "uid": "dep-1", "controller": True}]
    put(w.services, w.rec, svc, "service")
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1"), "vmi")
    put(w.crs, w.rec, imex_ensemble(maxMembers=8), "cr")
    await w.start()
    assert w.svc_client.calls == []
    snap = w.state.get(ENS)
    assert snap is not None and snap.spec.source == "service" and snap.spec.max_members == 4
    assert any("is controlled by Deployment x (uid dep-1)" in p for p in snap.problems)
    d = w.last()
    assert d is not None and [r for r, _ in d.refusals] == ["ServiceConflict"]
    assert d.spec is not None and d.spec.source == "service"
    await w.stop()


async def test_a_refused_cr_leaves_the_service_only_ensemble_running() -> None:
    w = World()
    put(w.services, w.rec, service(), "service")
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1"), "vmi")
    put(w.crs, w.rec, imex_ensemble(
        memberSelector={"matchLabels": {"imex-ensemble.io/ensemble": "other"}}), "cr")
    await w.start()
    assert w.svc_client.calls == []
    snap = w.state.get(ENS)
    assert snap is not None and snap.spec.source == "service" and len(snap.members) == 1
    d = w.last()
    assert d is not None and [r for r, _ in d.refusals] == ["SelectorConflict"]
    await w.stop()


async def test_a_cr_that_turns_bad_keeps_its_last_valid_spec() -> None:
    w = World()
    put(w.crs, w.rec, imex_ensemble(maxMembers=4), "cr")
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1"), "vmi")
    await w.start()
    put(w.crs, w.rec, imex_ensemble(maxMembers=4, generation=2, memberSelector={
        "matchExpressions": [{"key": "a", "operator": "Exists"},
                             {"key": "a", "operator": "DoesNotExist"}]}), "cr")
    await w.idle()
    snap = w.state.get(ENS)
    assert snap is not None and snap.spec.source == "cr" and len(snap.members) == 1
    assert any("still using its last valid settings (maxMembers 4)" in p for p in snap.problems)
    d = w.last()
    assert d is not None and d.generation == 2 and d.refusals[0][0] == "SelectorConflict"
    await w.stop()


async def test_member_selector_narrows_the_members() -> None:
    w = World()
    put(w.crs, w.rec, imex_ensemble(memberSelector={"matchLabels": {"rack": "a"}}), "cr")
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1", extra_labels={"rack": "a"}), "vmi")
    put(w.vmis, w.rec, vmi("gb200-1", ip="10.0.0.2", extra_labels={"rack": "b"}), "vmi")
    put(w.vmis, w.rec, vmi("gb200-2", ip="10.0.0.3"), "vmi")
    # labelled rack=a but for another ensemble: never taken
    put(w.vmis, w.rec, vmi("gb300-3", ensemble="gb300", ip="10.0.0.4",
                           extra_labels={"rack": "a"}), "vmi")
    await w.start()
    snap = w.state.get(ENS)
    assert snap is not None and [m.member.vmi for m in snap.members] == ["gb200-0"]
    assert snap.problems == ()
    await w.stop()


async def test_status_writes_coming_back_cost_no_pass() -> None:
    w = World()
    cr = imex_ensemble(resource_version="1")
    put(w.crs, w.rec, cr, "cr")
    await w.start()
    passes = w.rec.passes
    put(w.crs, w.rec, imex_ensemble(resource_version="2", status={"imexReady": 1}), "cr")
    await w.idle()
    assert w.rec.passes == passes
    await w.stop()


async def test_cr_deleted_service_left_for_the_gc_changes_nothing() -> None:
    w = World()
    put(w.crs, w.rec, imex_ensemble(maxMembers=4, tokenSHA256="cd" * 32), "cr")
    put(w.vmis, w.rec, vmi("gb200-0", ip="10.0.0.1"), "vmi")
    await w.start()
    before = w.state.get(ENS)
    old = w.crs.pop(("rack1", "gb200"))
    w.rec.on_cr(old, None)
    await w.idle()
    after = w.state.get(ENS)
    assert before is not None and after is not None
    assert after.spec.source == "service"  # the owned Service says the same
    assert (after.spec.max_members, after.spec.token_sha256) == (4, "cd" * 32)
    assert after.generation == before.generation
    assert w.slice_client.calls == ["apply:gb200-imex"]
    d = w.last()  # a Service-only ensemble now: its Events go on the Service
    assert d is not None and d.kind == "Service" and d.generation == 0
    assert d.uid == w.services.get("rack1", "gb200")["metadata"]["uid"]  # type: ignore[index]
    await w.stop()
