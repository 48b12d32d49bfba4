"""Leader election decisions (host_agent/kube/election.py) and the lease loop (election_io.py),
on injected clocks and an in-memory Lease with the apiserver's optimistic concurrency."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from host_agent.kube.client import KubeError
from host_agent.kube.election import ElectionConfig, Elector, LeaseRecord, jittered
from host_agent.kube.election_io import LeaseElection, lease_body, record_of
from tests.timing import measured

CFG = ElectionConfig(15.0, 10.0, 2.0)


def rec(holder: str, rv: str, instance: str | None = "i-other", duration: float | None = 15,
        transitions: int = 0) -> LeaseRecord:
    return LeaseRecord(holder, instance, duration, None, None, transitions, rv)


# -- config ----------------------------------------------------------------------------


@pytest.mark.parametrize(("lease", "renew", "retry", "flag"), [
    (15, 10, 0, "retry-period"),
    (15, 2.4, 2, "renew-deadline"),
    (10, 10, 2, "lease-duration"),
])
def test_config_rules_name_the_flag(lease: float, renew: float, retry: float, flag: str) -> None:
    with pytest.raises(ValueError, match=flag):
        ElectionConfig(lease, renew, retry).check()


def test_defaults_are_kube_controller_managers() -> None:
    ElectionConfig().check()
    assert (CFG.lease_duration, CFG.renew_deadline, CFG.retry_period) == (15, 10, 2)


def test_jitter_is_client_gos_factor() -> None:
    assert jittered(2.0, lambda: 0.0) == 2.0
    assert jittered(2.0, lambda: 1.0) == pytest.approx(4.4)


# -- the pure decisions ----------------------------------------------------------------


def test_nobody_ever_seen_creates_at_once() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(0.0, None)
    want = e.plan(0.0)
    assert want is not None and want.resource_version is None and want.holder == "a"


def test_a_held_lease_is_taken_only_after_lease_duration_on_our_own_clock() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(100.0, rec("b", "1"))
    assert e.plan(100.0) is None and e.last_reason == "held"
    assert e.plan(114.9) is None
    # the holder renewed: a new resourceVersion restarts our count
    e.observe(110.0, rec("b", "2"))
    assert e.plan(124.9) is None
    want = e.plan(125.0)
    assert want is not None and want.resource_version == "2" and want.acquire_now
    assert want.transitions == 1


def test_leader_stops_writing_at_its_renew_deadline() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(0.0, None)
    assert e.wrote(sent_at=0.0, now=0.1, lease=rec("a", "1", "i-a"))
    assert e.may_write(9.99)
    assert not e.may_write(10.0)
    assert e.check_deadline(10.0) and not e.leading


def test_leader_stops_at_once_when_it_sees_someone_else_hold_the_lease() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(0.0, None)
    e.wrote(0.0, 0.0, rec("a", "1", "i-a"))
    e.observe(1.0, rec("someone-by-hand", "2"))
    assert not e.leading and not e.may_write(1.0)


def test_missing_or_bad_duration_reads_as_our_own() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(0.0, rec("b", "1", duration=None))
    assert e.plan(14.0) is None
    assert e.plan(15.0) is not None


def test_released_lease_is_taken_at_once() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(0.0, rec("b", "1"))
    e.observe(1.0, rec("", "2"))
    want = e.plan(1.0)
    assert want is not None and want.resource_version == "2"


def test_same_identity_other_instance_is_someone_else() -> None:
    twin = Elector("x", "i-2", CFG)
    twin.observe(0.0, rec("x", "1", instance="i-1"))
    assert twin.plan(0.0) is None and twin.last_reason == "twin" and twin.twin == "i-1"
    twin.observe(5.0, rec("x", "2", instance="i-1"))  # the other one renews
    assert twin.plan(19.0) is None
    want = twin.plan(20.0)  # it stopped renewing 15 s ago: gone, take it
    assert want is not None and want.acquire_now


def test_a_deleted_lease_is_waited_out_by_followers_and_recreated_by_the_leader() -> None:
    follower = Elector("a", "i-a", CFG)
    follower.observe(0.0, rec("b", "1"))
    follower.observe(3.0, None)  # deleted by hand
    assert follower.plan(3.0) is None and follower.last_reason == "absent-wait"
    assert follower.plan(17.9) is None
    assert follower.plan(18.0) is not None
    leader = Elector("b", "i-b", CFG)
    leader.observe(0.0, None)
    leader.wrote(0.0, 0.0, rec("b", "1", "i-b"))
    leader.observe(3.0, None)
    want = leader.plan(3.0)
    assert want is not None and want.resource_version is None  # recreate at once


def test_renew_keeps_acquire_time_and_transitions() -> None:
    e = Elector("a", "i-a", CFG)
    e.observe(0.0, rec("a", "7", "i-a", transitions=4))
    want = e.plan(0.0)
    assert want is not None and not want.acquire_now and want.transitions == 4
    body = lease_body("ns", "l", want, {"metadata": {"labels": {"keep": "me"}},
                                        "spec": {"acquireTime": "2026-01-01T00:00:00.000000Z"}},
                      1795973999.5)
    assert body["spec"]["acquireTime"] == "2026-01-01T00:00:00.000000Z"
    assert body["spec"]["renewTime"] == "2026-11-29T17:39:59.500000Z"
    assert body["metadata"]["labels"] == {"keep": "me"}
    assert record_of(body).instance == "i-a"


def test_record_of_tolerates_hand_edits() -> None:
    r = record_of({"metadata": {"resourceVersion": "3", "annotations": "junk"},
                   "spec": {"holderIdentity": 7, "leaseDurationSeconds": -1,
                            "leaseTransitions": "x"}})
    assert (r.holder, r.instance, r.duration, r.transitions) == ("", None, None, 0)


# -- many candidates, skewed clocks, pauses: never two writers ------------------------------


@dataclass
class MemLease:
    """One Lease with the apiserver's rules: 409 on a stale resourceVersion or a second
    create, a new resourceVersion on every write."""

    obj: dict[str, Any] | None = None
    rv: int = 0
    writes: list[tuple[str, str]] = field(default_factory=list)
    refuse: set[str] = field(default_factory=set)

    gets: int = 0

    def get(self) -> dict[str, Any] | None:
        self.gets += 1
        if "get" in self.refuse:
            raise KubeError("get: 403: forbidden", 403)
        return copy.deepcopy(self.obj)

    def _store(self, body: dict[str, Any], verb: str) -> dict[str, Any]:
        self.rv += 1
        out = copy.deepcopy(body)
        out["metadata"]["resourceVersion"] = str(self.rv)
        self.obj = out
        self.writes.append((verb, body["spec"]["holderIdentity"]))
        return copy.deepcopy(out)

    def create(self, body: dict[str, Any]) -> dict[str, Any]:
        if "create" in self.refuse:
            raise KubeError("create: 403: forbidden", 403)
        if self.obj is not None:
            raise KubeError("create: 409: AlreadyExists", 409)
        return self._store(body, "create")

    def update(self, body: dict[str, Any]) -> dict[str, Any]:
        if "update" in self.refuse:
            raise KubeError("update: 403: forbidden", 403)
        if self.obj is None:
            raise KubeError("update: 404", 404)
        if body["metadata"].get("resourceVersion") != self.obj["metadata"]["resourceVersion"]:
            raise KubeError("update: 409: Conflict", 409)
        return self._store(body, "update")


@dataclass
class Candidate:
    elector: Elector
    offset: float  # its monotonic clock = true time + offset
    wall_skew: float  # its wall clock = true time + skew (written as renewTime only)
    next_at: float = 0.0
    paused_until: float = -1.0

    def now(self, t: float) -> float:
        return t + self.offset


def step(c: Candidate, lease: MemLease, t: float, rng: random.Random) -> None:
    e = c.elector
    obj = lease.get()
    e.observe(c.now(t), record_of(obj) if obj is not None else None)
    want = e.plan(c.now(t))
    if want is not None:
        body = lease_body("ns", "l", want, obj, 1.8e9 + t + c.wall_skew)
        sent = c.now(t)
        try:
            written = lease.create(body) if want.resource_version is None else lease.update(body)
        except KubeError:
            e.refused()
        else:
            e.wrote(sent, c.now(t), record_of(written))
    e.check_deadline(c.now(t))
    period = e.config.retry_period
    c.next_at = t + (period if e.leading else jittered(period, rng.random))


@pytest.mark.parametrize("seed", range(8))
def test_skewed_clocks_and_pauses_never_give_two_writers(seed: int) -> None:
    rng = random.Random(seed)
    lease = MemLease()
    cands = [
        Candidate(Elector(f"r{i}", f"i{i}", CFG), offset=rng.uniform(-1e4, 1e4),
                  wall_skew=skew)
        for i, skew in enumerate((-5.0, 0.0, 5.0))
    ]
    t, leaders_seen = 0.0, set()
    while t < 600.0:
        for c in cands:
            if c.paused_until > t:
                continue  # SIGSTOPped: no steps, but its clock runs on
            if t >= c.next_at:
                step(c, lease, t, rng)
            if c.elector.leading and rng.random() < 0.002:
                c.paused_until = t + rng.uniform(5.0, 40.0)  # a pause past the lease, often
        writers = [c for c in cands if c.elector.may_write(c.now(t))]
        assert len(writers) <= 1, f"t={t:.1f}: {[c.elector.identity for c in writers]}"
        # a paused leader that wakes past its deadline must not write before it steps
        for c in cands:
            if c.paused_until > t and c.elector.may_write(c.now(t)):
                assert c.now(t) < c.elector.renewed_at + CFG.renew_deadline
        leaders_seen |= {c.elector.identity for c in writers}
        t = round(t + 0.1, 6)
    assert len(leaders_seen) >= 2, "pauses should have moved the lease at least once"


# -- the async loop --------------------------------------------------------------------


class FakeApi:
    namespace = "imex-system"
    name = "imex-host-agent"

    def __init__(self, lease: MemLease) -> None:
        self.lease = lease

    async def get(self, timeout: float) -> dict[str, Any] | None:
        return self.lease.get()

    async def create(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self.lease.create(body)

    async def update(self, body: dict[str, Any], timeout: float) -> dict[str, Any]:
        return self.lease.update(body)


class Metrics:
    def __init__(self) -> None:
        self.leader: list[bool] = []
        self.transitions = 0

    def set_leader(self, leading: bool) -> None:
        self.leader.append(leading)

    def set_transitions(self, total: int) -> None:
        self.transitions = total


async def test_loop_leads_renews_and_releases() -> None:
    lease = MemLease()
    clock = [0.0]
    metrics = Metrics()
    started: list[int] = []
    el = LeaseElection(FakeApi(lease), "a", CFG, metrics=metrics, clock=lambda: clock[0],
                       on_started_leading=lambda: started.append(1))
    await el.step()
    assert el.leading and el.may_write() and started == [1] and metrics.leader[-1]
    clock[0] = 2.0
    await el.step()
    assert lease.writes == [("create", "a"), ("update", "a")] and started == [1]
    assert await el.release()
    assert not el.may_write()
    assert lease.obj is not None and lease.obj["spec"]["holderIdentity"] == ""
    assert lease.obj["spec"]["leaseDurationSeconds"] == 1
    assert metrics.leader[-1] is False and metrics.transitions == 1


@pytest.mark.parametrize("verb", ["get", "create", "update"])
async def test_missing_rbac_names_the_verb_once_and_never_leads(
        verb: str, caplog: pytest.LogCaptureFixture) -> None:
    lease = MemLease(refuse={verb})
    if verb == "update":
        lease.obj = lease_body("imex-system", "imex-host-agent",
                               Elector("b", "i-b").plan(0.0) or pytest.fail(), None, 0.0)
        lease.obj["metadata"]["resourceVersion"] = "1"
        lease.obj["spec"]["holderIdentity"] = ""  # released: update is what takes it
    clock = [0.0]
    el = LeaseElection(FakeApi(lease), "a", CFG, clock=lambda: clock[0])
    with caplog.at_level(logging.ERROR, logger="imex.host.election"):
        for i in range(4):
            clock[0] = i * 3.0
            await el.step()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1, errors
    assert f"lacks the verb {verb} on leases" in errors[0]
    assert not el.leading and not el.may_write()


async def test_twin_refuses_and_says_why(caplog: pytest.LogCaptureFixture) -> None:
    lease = MemLease()
    clock = [0.0]
    first = LeaseElection(FakeApi(lease), "same", CFG, clock=lambda: clock[0])
    twin = LeaseElection(FakeApi(lease), "same", CFG, clock=lambda: clock[0])
    await first.step()
    with caplog.at_level(logging.ERROR, logger="imex.host.election"):
        for i in range(1, 10):
            clock[0] = i * 2.0
            await first.step()
            await twin.step()
    assert first.leading and not twin.leading
    msgs = [r.getMessage() for r in caplog.records if "own identity" in r.getMessage()]
    assert len(msgs) == 1 and "'same'" in msgs[0] and "--identity" in msgs[0]


async def test_a_read_answered_after_a_pause_is_not_planned_from() -> None:
    """SIGSTOP with a GET's reply queued: the woken leader must not renew from it (the API
    would answer 409, but the audit log would still show a write from a fenced replica)."""
    lease = MemLease()
    clock = [0.0]

    class PausedApi(FakeApi):
        pause = False

        async def get(self, timeout: float) -> dict[str, Any] | None:
            before = self.lease.get()  # the reply, already on its way
            if self.pause:
                self.pause = False
                clock[0] += CFG.lease_duration + 5.0  # stopped meanwhile
                other = Elector("b", "i-b", CFG)
                other.observe(0.0, None)
                want = other.plan(0.0)
                assert want is not None and before is not None
                taken = lease_body("ns", "l", replace(want, resource_version=before[
                    "metadata"]["resourceVersion"], acquire_now=True), before, 0.0)
                self.lease.update(taken)  # the follower took over
            return before

    api = PausedApi(lease)
    el = LeaseElection(api, "a", CFG, clock=lambda: clock[0])
    await el.step()
    assert el.leading and lease.writes == [("create", "a")]
    api.pause = True
    await el.step()
    assert lease.writes == [("create", "a"), ("update", "b")], "no write planned from it"
    assert not el.leading and not el.may_write() and el._again
    await el.step()  # the fresh read shows the new holder: still nothing written
    assert lease.writes[-1] == ("update", "b") and not el.leading


# -- woken by the Lease watch ----------------------------------------------------------------


def held_by_b(lease: MemLease) -> dict[str, Any]:
    want = Elector("b", "i-b", CFG).plan(0.0)
    assert want is not None
    return lease.create(lease_body("imex-system", "imex-host-agent", want, None, 0.0))


def edited(obj: dict[str, Any], **spec: Any) -> dict[str, Any]:
    out = copy.deepcopy(obj)
    out["spec"].update(spec)
    return out


async def until(check: Callable[[], bool], timeout: float) -> float:
    """Poll ``check`` (the loop under test runs between polls) for up to ``timeout``;
    the seconds it took.

    A wake that must beat the 2 s retry sleep is bounded at 1 s: measured (the
    ``host.election.*`` figures) max 76 ms, 49 ms beside stress-ng (15 runs each,
    2026-12-02)."""
    t0 = time.monotonic()
    while not check():
        assert time.monotonic() < t0 + timeout, f"not within {timeout} s"
        await asyncio.sleep(0.01)
    return time.monotonic() - t0


@contextlib.asynccontextmanager
async def running(el: LeaseElection) -> AsyncIterator[None]:
    task = asyncio.create_task(el.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_a_nudge_during_a_step_is_not_lost() -> None:
    """The watch shows a release while the step's GET is in flight with the older reply
    already on its way: the loop must read again at once, not sleep its retry period."""
    lease = MemLease()
    held_by_b(lease)

    class RacingApi(FakeApi):
        armed = True

        async def get(self, timeout: float) -> dict[str, Any] | None:
            before = self.lease.get()
            if self.armed and before is not None:
                self.armed = False
                released = self.lease.update(edited(before, holderIdentity=""))
                el.lease_changed(before, released)  # the watch event, mid-step
            return before

    el = LeaseElection(RacingApi(lease), "a", CFG, rng=lambda: 0.0)  # sleeps 2 s
    async with running(el):
        # not after the 2 s sleep
        measured("host.election.nudge_mid_step", await until(lambda: el.leading, 1.0))
    assert lease.gets == 2 and lease.writes[-1] == ("update", "a")


async def test_a_release_seen_on_the_watch_is_taken_with_one_get_and_one_put() -> None:
    lease = MemLease()
    held = held_by_b(lease)
    el = LeaseElection(FakeApi(lease), "a", CFG, rng=lambda: 0.0)
    async with running(el):
        await until(lambda: el.steps == 1, 1.0)  # read: held by b; now sleeping 2 s
        assert not el.leading and lease.gets == 1
        writes = len(lease.writes)
        released = lease.update(edited(held, holderIdentity="", leaseDurationSeconds=1))
        el.lease_changed(held, released)
        measured("host.election.release_on_watch", await until(lambda: el.leading, 1.0))
    assert lease.gets == 2, "one GET after the wake"
    assert lease.writes[writes + 1:] == [("update", "a")], "one PUT: the take"


async def test_another_holders_renew_wakes_nobody_but_a_leader_sees_a_taker_at_once() -> None:
    lease = MemLease()
    held = held_by_b(lease)
    follower = LeaseElection(FakeApi(lease), "a", CFG, rng=lambda: 0.0)
    async with running(follower):
        await until(lambda: follower.steps == 1, 1.0)
        renewed = lease.update(edited(held, renewTime="2026-01-01T00:00:02.000000Z"))
        follower.lease_changed(held, renewed)  # b's routine renew: no extra read
        await asyncio.sleep(0.3)
        assert follower.steps == 1 and lease.gets == 1
        # a deletion does wake it (it starts timing the absence from a fresh read)
        lease.obj = None
        follower.lease_changed(renewed, None)
        measured("host.election.deletion_wakes", await until(lambda: follower.steps == 2, 1.0))

    mine = MemLease()
    leader = LeaseElection(FakeApi(mine), "a", CFG)
    async with running(leader):
        await until(lambda: leader.leading, 1.0)
        ours = mine.get()
        assert ours is not None
        leader.lease_changed(None, ours)  # our own renew, seen on the watch: no wake
        await asyncio.sleep(0.3)
        assert leader.steps == 1
        taken = mine.update(edited(ours, holderIdentity="someone-by-hand"))
        leader.lease_changed(ours, taken)
        # not at its next renew, 2 s on
        measured("host.election.taker_seen", await until(lambda: not leader.leading, 1.0))
    assert not leader.may_write() and mine.writes[-1] == ("update", "someone-by-hand")


async def test_a_renewal_that_lands_first_does_not_stop_the_release() -> None:
    """The loop's last renewal moved the resourceVersion after the loop's read: the
    release's update is refused (409), the lease is read again, still ours, and released;
    a lease someone else holds by then is left alone."""
    lease = MemLease()
    clock = [0.0]
    el = LeaseElection(FakeApi(lease), "a", CFG, clock=lambda: clock[0])
    await el.step()
    assert el.leading and lease.obj is not None
    renewed = copy.deepcopy(lease.obj)
    renewed["spec"]["renewTime"] = "2026-12-06T07:00:01.000000Z"
    lease.update(renewed)  # the renewal in flight when the stop began
    gets = lease.gets
    assert await el.release()
    assert lease.obj["spec"]["holderIdentity"] == ""
    assert lease.writes[-2:] == [("update", "a"), ("update", "")]
    assert lease.gets == gets + 1

    lease = MemLease()
    el = LeaseElection(FakeApi(lease), "a", CFG, clock=lambda: clock[0])
    await el.step()
    assert lease.obj is not None
    taken = copy.deepcopy(lease.obj)
    taken["spec"]["holderIdentity"] = "b"
    lease.update(taken)
    assert not await el.release()
    assert lease.obj["spec"]["holderIdentity"] == "b"
    assert [w for w in lease.writes if w[1] == ""] == []
