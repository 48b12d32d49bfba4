"""The CA Secret over HTTP (lightkube against the API double): created once by the leader,
read by any replica, rotated with a resourceVersion precondition, never re-minted when
edited into garbage, and the registry's CaSource reading the same Secret.

The double's Secrets are checked against the real apiserver in
tests/realk8s/test_double_parity.py.
"""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import AsyncIterator

import pytest
from lightkube import AsyncClient, KubeConfig
from lightkube.resources.core_v1 import Namespace

from host_agent.ca import authority as ca_mod
from host_agent.ca.secret_io import CaManager, CaUnavailable
from host_agent.kube.client import KubeError
from host_agent.kube.leadership import ALWAYS, NotLeader
from host_agent.kube.writers import SecretWriter
from host_agent.state.snapshot import EnsembleSpec
from imex_shared.model import EnsembleId
from tests.sandbox.kube_api.fixtures import KubeApiHandle, kube_api_fixture  # noqa: F401

pytestmark = pytest.mark.timeout(60)

ENS = EnsembleId("gpu", "gb200")
NS = "imex-system"


class NotTheLeader:
    def may_write(self) -> bool:
        return False

    def ensure(self) -> None:
        raise NotLeader("not the leader")


@pytest.fixture
async def client(kube_api: KubeApiHandle) -> AsyncIterator[AsyncClient]:
    c = AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path))
    await c.create(Namespace.from_dict({"apiVersion": "v1", "kind": "Namespace",
                                        "metadata": {"name": NS}}))
    try:
        yield c
    finally:
        await c.close()


def spec(rotation: str | None = None) -> EnsembleSpec:
    return EnsembleSpec(ENS, 18, 50000, auth_encryption=True, ca_rotation=rotation)


async def test_leader_creates_once_others_read_the_same_ca(client: AsyncClient,
                                                           kube_api: KubeApiHandle) -> None:
    api = SecretWriter(client, "imex-host-agent")
    follower = CaManager(api, NS, NotTheLeader(), cache_seconds=0)
    waiting = await follower.reconcile(spec())
    assert waiting.published is None
    assert waiting.problems == (f"Secret {NS}/imex-ca-gpu.gb200 does not exist yet; the leader "
                                "creates it",)
    with pytest.raises(CaUnavailable, match="does not exist yet"):
        await follower.load(ENS)
    assert kube_api.writes("secrets") == 0
    leader = CaManager(api, NS, ALWAYS)
    made = await leader.reconcile(spec())
    assert made.published is not None and made.problems == ()
    again = await leader.reconcile(spec())
    assert again.published == made.published
    assert kube_api.writes("secrets") == 1
    read = await follower.reconcile(spec())
    assert read.published == made.published
    assert (await follower.load(ENS)).sha256 == made.published.sha256
    obj = await api.get_secret(NS, "imex-ca-gpu.gb200")
    assert obj is not None and obj["type"] == "Opaque"
    assert set(obj["data"]) == {"ca.crt", "ca.key"}
    assert obj["metadata"]["annotations"]["imex-ensemble.io/ensemble"] == "gpu/gb200"


async def test_rotation_cross_signs_then_the_overlap_ends(client: AsyncClient,
                                                          kube_api: KubeApiHandle) -> None:
    now = [dt.datetime.now(dt.UTC)]
    leader = CaManager(SecretWriter(client, "m"), NS, ALWAYS, overlap=dt.timedelta(minutes=5),
                       cache_seconds=0, clock=lambda: now[0])
    first = await leader.reconcile(spec())
    rotated = await leader.reconcile(spec("2026-12-01"))
    assert rotated.published is not None and first.published is not None
    # trust step: the old CA still signs (and is what is published), the bundle changed
    assert rotated.published.sha256 == first.published.sha256
    assert rotated.published.bundle_sha256 != first.published.bundle_sha256
    assert rotated.recheck_after == 60.0  # the periodic re-check comes before the switch
    state = await leader.load(ENS)
    assert state.step == "trust" and state.previous is not None
    assert ca_mod.fingerprint(state.previous) == first.published.sha256
    assert state.cross is not None and ca_mod.verify_signed_by(state.cross, state.previous)
    assert (await leader.reconcile(spec("2026-12-01"))).published == rotated.published
    assert kube_api.writes("secrets") == 2
    now[0] += dt.timedelta(seconds=150)
    switched = await leader.reconcile(spec("2026-12-01"))
    assert switched.published is not None
    assert switched.published.sha256 == state.current.sha256  # the new CA signs now
    assert (await leader.load(ENS)).step == "switch"
    obj = await SecretWriter(client, "m").get_secret(NS, "imex-ca-gpu.gb200")
    assert obj is not None and "previous.key" not in obj["data"]  # the old key is gone
    now[0] += dt.timedelta(seconds=150)
    ended = await leader.reconcile(spec("2026-12-01"))
    assert ended.published is not None
    assert ended.published.sha256 == switched.published.sha256
    assert ended.published.bundle_sha256 != switched.published.bundle_sha256
    assert (await leader.load(ENS)).previous is None
    # a follower never rotates, even when the spec asks for it
    follower = CaManager(SecretWriter(client, "m"), NS, NotTheLeader(), cache_seconds=0)
    assert (await follower.reconcile(spec("again"))).published == ended.published
    assert kube_api.writes("secrets") == 4


async def test_a_garbage_secret_is_a_problem_never_a_new_ca(client: AsyncClient,
                                                            kube_api: KubeApiHandle) -> None:
    api = SecretWriter(client, "m")
    leader = CaManager(api, NS, ALWAYS, cache_seconds=0)
    await leader.reconcile(spec())
    obj = await api.get_secret(NS, "imex-ca-gpu.gb200")
    assert obj is not None
    obj["data"]["ca.crt"] = base64.b64encode(b"edited by hand").decode()
    await api.replace_secret(obj)
    writes = kube_api.writes("secrets")
    outcome = await leader.reconcile(spec())
    assert outcome.published is None
    assert len(outcome.problems) == 1
    assert "ca.crt is not a PEM certificate" in outcome.problems[0]
    assert "not minting a new CA" in outcome.problems[0]
    assert kube_api.writes("secrets") == writes
    with pytest.raises(CaUnavailable, match=r"ca\.crt is not a PEM certificate"):
        await leader.load(ENS)


async def test_a_stale_update_is_refused_by_the_resource_version(client: AsyncClient) -> None:
    api = SecretWriter(client, "m")
    leader = CaManager(api, NS, ALWAYS, cache_seconds=0)
    await leader.reconcile(spec())
    obj = await api.get_secret(NS, "imex-ca-gpu.gb200")
    assert obj is not None
    edited = {**obj, "metadata": {**obj["metadata"], "labels": {"edited": "yes"}}}
    await api.replace_secret(edited)  # someone else wrote in between
    with pytest.raises(KubeError) as err:
        await api.replace_secret(obj)  # the old resourceVersion
    assert err.value.status == 409
