"""events.k8s.io/v1 Events in the API double: create, repeat by patching series, and
the registry's validation naming internal fields as kube-apiserver does."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.sandbox.kube_api.server import ThreadedKubeApi

EVENTS = "/apis/events.k8s.io/v1/namespaces/gpu-jobs/events"
MERGE = {"content-type": "application/merge-patch+json"}


def event(name: str = "ens.1", **change: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "apiVersion": "events.k8s.io/v1", "kind": "Event",
        "metadata": {"name": name, "namespace": "gpu-jobs"},
        "eventTime": "2026-12-01T11:00:00.000000+01:00",
        "reportingController": "imex-ensemble.io/host-agent",
        "reportingInstance": "imex-host-agent-0", "action": "Publish",
        "reason": "MemberJoined", "type": "Normal", "note": "slot 3 joined",
        "regarding": {"apiVersion": "imex-ensemble.io/v1alpha1", "kind": "ImexEnsemble",
                      "namespace": "gpu-jobs", "name": "ens", "uid": "u1"},
    }
    body.update(change)
    return {k: v for k, v in body.items() if v is not None}


@pytest.fixture
def api() -> Iterator[httpx.Client]:
    with ThreadedKubeApi() as srv, httpx.Client(base_url=srv.url, timeout=10) as client:
        client.post("/api/v1/namespaces", json={"metadata": {"name": "gpu-jobs"}})
        yield client


def fields(resp: httpx.Response) -> set[str]:
    assert resp.status_code == 422, resp.text
    return {c["field"] for c in resp.json()["details"]["causes"]}


def test_create_and_repeat_with_a_series(api: httpx.Client) -> None:
    created = api.post(EVENTS, json=event())
    assert created.status_code == 201, created.text
    assert created.json()["eventTime"] == "2026-12-01T10:00:00.000000Z"  # stored in UTC
    assert created.json()["deprecatedSource"] == {}  # rendered empty, as the server does
    repeat = api.patch(f"{EVENTS}/ens.1", headers=MERGE, json={
        "series": {"count": 2, "lastObservedTime": "2026-12-01T10:00:05.500000Z"}})
    assert repeat.status_code == 200, repeat.text
    assert repeat.json()["series"] == {"count": 2,
                                       "lastObservedTime": "2026-12-01T10:00:05.500000Z"}
    listed = api.get(EVENTS).json()["items"]
    assert [e["reason"] for e in listed] == ["MemberJoined"]


@pytest.mark.parametrize(("change", "named"), [
    ({"eventTime": None}, {"eventTime"}),
    ({"reportingController": None}, {"reportingController"}),
    ({"reportingInstance": "x" * 129}, {"reportingInstance"}),
    ({"action": None, "reason": None}, {"action", "reason"}),
    ({"type": "Info"}, {"type"}),
    ({"note": "n" * 1025}, {"message"}),  # validated as the internal core.Event
    ({"series": {"count": 1}}, {"series.count", "series.lastObservedTime"}),
    ({"deprecatedCount": 3}, {"count"}),
    ({"regarding": {"kind": "ImexEnsemble", "name": "ens"}}, {"involvedObject.namespace"}),
])
def test_invalid_events_are_refused_naming_the_field(
        api: httpx.Client, change: dict[str, Any], named: set[str]) -> None:
    assert fields(api.post(EVENTS, json=event(**change))) == named


def test_the_story_is_immutable_only_the_series_moves(api: httpx.Client) -> None:
    api.post(EVENTS, json=event())
    assert fields(api.patch(f"{EVENTS}/ens.1", headers=MERGE,
                            json={"note": "rewritten"})) == {"message"}
    assert fields(api.patch(f"{EVENTS}/ens.1", headers=MERGE,
                            json={"series": {"count": 1, "lastObservedTime":
                                             "2026-12-01T10:00:05.000000Z"}})) == {"series.count"}


def test_micro_times_need_six_fractional_digits(api: httpx.Client) -> None:
    """metav1.MicroTime decodes only RFC3339 with microseconds (kube-apiserver v1.37.2)."""
    bad = api.post(EVENTS, json=event(eventTime="2026-12-01T10:00:00Z"))
    assert bad.status_code == 400
    assert bad.json()["message"] == (
        'Event in version "v1" cannot be handled as a Event: parsing time '
        '"2026-12-01T10:00:00Z" as "2006-01-02T15:04:05.000000Z07:00": cannot parse "Z" '
        'as ".000000"')
    api.post(EVENTS, json=event())
    patched = api.patch(f"{EVENTS}/ens.1", headers=MERGE, json={
        "series": {"count": 2, "lastObservedTime": "2026-12-01T10:00:05.5Z"}})
    assert fields(patched) == {"patch"}
