"""Desired EndpointSlices and the write decision (no I/O)."""

from __future__ import annotations

from typing import Any

import pytest

from host_agent.ensembles.slices import Written, contains, desired_slices, needs_write, slice_name
from host_agent.ensembles.slices_io import SliceApplier
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member

ENS = EnsembleId("rack1", "gb200")
SPEC = EnsembleSpec(ENS, max_members=18, port=50001, uid="u-1")


def snap(*members: Member, spec: EnsembleSpec = SPEC) -> Any:
    return State().set(spec, members, [])[0]


def test_names() -> None:
    assert slice_name("gb200", "IPv4") == "gb200-imex"
    assert slice_name("gb200", "IPv6") == "gb200-imex-v6"
    assert slice_name("gb200", "IPv4", "gb200-3") == "gb200-imex-vmi-gb200-3"
    assert slice_name("gb200", "IPv6", "gb200-3") == "gb200-imex-v6-vmi-gb200-3"


def test_families_split_and_empty_family_is_deleted() -> None:
    s = snap(
        Member(0, "10.0.0.1", "gb200-0", "n", "Running", True),
        Member(1, "fd00::1", "gb200-1", "n", "Running", True),
    )
    out = desired_slices(s)
    assert set(out) == {"gb200-imex", "gb200-imex-v6"}
    assert out["gb200-imex"] is not None and out["gb200-imex-v6"] is not None
    assert [e["addresses"] for e in out["gb200-imex"]["endpoints"]] == [["10.0.0.1"]]
    assert out["gb200-imex-v6"]["addressType"] == "IPv6"
    assert out["gb200-imex"]["ports"] == [{"name": "imex", "port": 50001, "protocol": "TCP"}]
    only_v4 = desired_slices(snap(Member(0, "10.0.0.1", "gb200-0")))
    assert only_v4["gb200-imex-v6"] is None
    assert desired_slices(snap()) == {"gb200-imex": None, "gb200-imex-v6": None}


def test_endpoints_in_index_order_with_slot_hostnames() -> None:
    s = snap(Member(5, "10.0.0.5", "gb200-5"), Member(2, "10.0.0.2", "gb200-2"))
    body = desired_slices(s)["gb200-imex"]
    assert body is not None
    assert [e["hostname"] for e in body["endpoints"]] == [ENS.slot(2), ENS.slot(5)]
    assert body["endpoints"][0]["conditions"] == {"ready": False}
    assert "nodeName" not in body["endpoints"][0]


def test_no_owner_reference_without_uid() -> None:
    spec = EnsembleSpec(ENS, max_members=18, port=50000)
    body = desired_slices(snap(Member(0, "10.0.0.1", "gb200-0"), spec=spec))["gb200-imex"]
    assert body is not None and "ownerReferences" not in body["metadata"]


def test_sidecar_scope_only_its_own_vmi() -> None:
    s = snap(Member(0, "10.0.0.1", "gb200-0"), Member(1, "10.0.0.2", "gb200-1"))
    out = desired_slices(s, vmi="gb200-1")
    assert set(out) == {"gb200-imex-vmi-gb200-1", "gb200-imex-v6-vmi-gb200-1"}
    body = out["gb200-imex-vmi-gb200-1"]
    assert body is not None
    assert [e["hostname"] for e in body["endpoints"]] == [ENS.slot(1)]


def test_contains() -> None:
    desired = {"a": {"b": [1, {"c": 2}]}, "d": "x"}
    assert contains(desired, {"a": {"b": [1, {"c": 2, "extra": 1}], "z": 0}, "d": "x", "q": 1})
    assert not contains(desired, {"a": {"b": [1, {"c": 3}]}, "d": "x"})
    assert not contains(desired, {"a": {"b": [1, {"c": 2}, 3]}, "d": "x"})
    assert not contains(desired, {"a": {"b": [1, {"c": 2}]}})


BODY = {"metadata": {"name": "s"}, "endpoints": [{"addresses": ["10.0.0.1"]}]}


def obs(rv: str, endpoints: list[Any] | None = None) -> dict[str, Any]:
    return {
        "metadata": {"name": "s", "resourceVersion": rv, "uid": "x"},
        "endpoints": endpoints if endpoints is not None else [{"addresses": ["10.0.0.1"]}],
    }


@pytest.mark.parametrize(
    ("desired", "observed", "last", "write"),
    [
        (BODY, obs("5"), None, False),  # observed equals desired
        (BODY, None, None, True),  # missing
        (BODY, obs("5", []), None, True),  # differs
        (BODY, None, Written.of(BODY, None, "6"), False),  # we created it; informer lags
        (BODY, obs("5", []), Written.of(BODY, "5", "6"), False),  # we updated; informer lags
        (BODY, obs("7", []), Written.of(BODY, "5", "6"), True),  # someone changed it after us
        (BODY, None, Written.of(BODY, "6", "7"), True),  # someone deleted it after us
        (None, None, None, False),
        (None, obs("5"), None, True),
        (None, obs("5"), Written.of(None, "5", None), False),  # our delete not observed yet
        (None, obs("9"), Written.of(None, "5", None), True),  # re-created by someone
    ],
)
def test_needs_write(desired: Any, observed: Any, last: Any, write: bool) -> None:
    assert needs_write(desired, observed, last) is write


class FakeClient:
    def __init__(self) -> None:
        self.calls: list[str] = []
        self.preconditions: list[str | None] = []
        self.rv = 10

    async def apply_slice(self, body: dict[str, Any], resource_version: str | None = None
                          ) -> str | None:
        self.preconditions.append(resource_version)
        self.calls.append("apply:" + body["metadata"]["name"])
        self.rv += 1
        return str(self.rv)

    async def delete_slice(self, namespace: str, name: str,
                           resource_version: str | None = None) -> None:
        self.preconditions.append(resource_version)
        self.calls.append("delete:" + name)


async def test_applier_writes_once_and_heals() -> None:
    observed: dict[tuple[str, str], dict[str, Any]] = {}
    client = FakeClient()
    applier = SliceApplier(client, lambda ns, n: observed.get((ns, n)))
    s = snap(Member(0, "10.0.0.1", "gb200-0"))
    desired = desired_slices(s)
    assert await applier.sync("rack1", desired) == ["apply:gb200-imex"]
    assert await applier.sync("rack1", desired) == []  # informer has not seen it yet
    body = desired["gb200-imex"]
    assert body is not None
    observed[("rack1", "gb200-imex")] = {
        **body,
        "metadata": {**body["metadata"], "resourceVersion": "11"},
    }
    assert await applier.sync("rack1", desired) == []
    # Someone else deletes it: repaired.
    del observed[("rack1", "gb200-imex")]
    assert await applier.sync("rack1", desired) == ["apply:gb200-imex"]
    # Last member goes: the slice is deleted once.
    observed[("rack1", "gb200-imex")] = {
        **body,
        "metadata": {**body["metadata"], "resourceVersion": "12"},
    }
    empty = desired_slices(snap())
    assert await applier.sync("rack1", empty) == ["delete:gb200-imex"]
    assert await applier.sync("rack1", empty) == []
    assert client.calls == ["apply:gb200-imex", "apply:gb200-imex", "delete:gb200-imex"]


async def test_echo_of_our_write_is_recognised_and_later_edits_still_heal() -> None:
    """The slice event carrying our write's resourceVersion is an echo (no pass
    needed); after it, a deletion or edit by someone else is still repaired."""
    observed: dict[tuple[str, str], dict[str, Any]] = {}
    client = FakeClient()
    applier = SliceApplier(client, lambda ns, n: observed.get((ns, n)))
    desired = desired_slices(snap(Member(0, "10.0.0.1", "gb200-0")))
    body = desired["gb200-imex"]
    assert body is not None
    assert not applier.is_echo("rack1", "gb200-imex", {**body})  # never written by us
    assert await applier.sync("rack1", desired) == ["apply:gb200-imex"]
    ours = {**body, "metadata": {**body["metadata"], "resourceVersion": "11"}}
    theirs = {**body, "metadata": {**body["metadata"], "resourceVersion": "12"}}
    assert not applier.is_echo("rack1", "gb200-imex", theirs)  # not the version we produced
    assert not applier.is_echo("rack1", "other-imex", ours)
    assert applier.is_echo("rack1", "gb200-imex", ours)
    assert not applier.is_echo("rack1", "gb200-imex", None)  # a deletion is not our write
    # The slice was created by us (no version before), so without the refresh
    # done by is_echo the deletion would look like informer lag.
    assert await applier.sync("rack1", desired) == ["apply:gb200-imex"]
    observed[("rack1", "gb200-imex")] = {**body, "metadata": {**body["metadata"],
                                                               "resourceVersion": "12"}}
    empty = desired_slices(snap())
    assert await applier.sync("rack1", empty) == ["delete:gb200-imex"]
    assert applier.is_echo("rack1", "gb200-imex", None)  # our delete coming back
    assert not applier.is_echo("rack1", "gb200-imex", theirs)  # re-created by someone


async def test_observed_own_write_is_compared_with_what_was_written() -> None:
    """When the observation carries our write's resourceVersion, sync compares the
    desired body with the body written: equal -> nothing, different -> one write."""
    observed: dict[tuple[str, str], dict[str, Any]] = {}
    client = FakeClient()
    applier = SliceApplier(client, lambda ns, n: observed.get((ns, n)))
    one = desired_slices(snap(Member(0, "10.0.0.1", "gb200-0")))
    assert await applier.sync("rack1", one) == ["apply:gb200-imex"]
    body = one["gb200-imex"]
    assert body is not None
    # the informer shows our write (server fields added, as a real apiserver does)
    observed[("rack1", "gb200-imex")] = {
        **body, "metadata": {**body["metadata"], "resourceVersion": "11", "uid": "u1",
                             "generation": 1}}
    assert await applier.sync("rack1", one) == []
    two = desired_slices(snap(Member(0, "10.0.0.2", "gb200-0")))
    assert await applier.sync("rack1", two) == ["apply:gb200-imex"]


def test_write_memory_keeps_compact_json_not_the_body() -> None:
    import copy
    import json

    from host_agent.ensembles.slices import encode_body

    w = Written.of(BODY, "5", "6")
    assert isinstance(w.encoded, bytes) and json.loads(w.encoded) == BODY
    assert w.wrote(encode_body(copy.deepcopy(BODY)))  # an equal body built afresh
    changed = copy.deepcopy(BODY)
    changed["addressType"] = "IPv6"
    assert not w.wrote(encode_body(changed))
    assert not w.deleted and Written.of(None, "5", None).deleted
    assert Written.of(None, "5", None).wrote(encode_body(None))
