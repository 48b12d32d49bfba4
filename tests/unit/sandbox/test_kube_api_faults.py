"""Fault rules and counters of the API double: pure decisions on a fake clock."""

from __future__ import annotations

import pytest

from tests.sandbox.kube_api.faults import Counters, Faults


def test_count_rule_is_spent_after_n_matching_requests() -> None:
    f = Faults()
    f.add(status=500, count=2, verbs=["apply"], now=0)
    assert f.decide("get", "endpointslices", 0) == (0.0, None)  # not matching: not counted
    codes = [f.decide("apply", "endpointslices", 0)[1] for _ in range(3)]
    assert [e.code if e else None for e in codes] == [500, 500, None]
    assert f.rules == []


def test_duration_rule_expires() -> None:
    f = Faults()
    f.add(status=503, duration=1.0, now=10.0)
    assert f.decide("list", "services", 10.5)[1] is not None
    assert f.decide("list", "services", 11.0)[1] is None
    assert f.rules == []


def test_429_defaults_retry_after_and_resources_narrow() -> None:
    f = Faults()
    f.add(status=429, resources=["virtualmachineinstances"], now=0)
    assert f.decide("watch", "services", 0)[1] is None
    err = f.decide("watch", "virtualmachineinstances/status", 0)[1]
    assert err is not None and err.code == 429 and err.headers == {"Retry-After": "1"}
    assert err.status()["details"] == {"retryAfterSeconds": 1}
    assert f.rules  # no count, no duration: stays until cleared
    f.clear()
    assert f.decide("watch", "virtualmachineinstances", 0)[1] is None


def test_delays_combine_with_failures() -> None:
    f = Faults()
    f.add(delay=0.5, count=1, now=0)
    f.add(status=500, delay=0.2, count=1, now=0)
    delay, err = f.decide("get", "services", 0)
    assert delay == 0.5 and err is not None and err.code == 500
    assert f.decide("get", "services", 0) == (0.0, None)


@pytest.mark.parametrize("kwargs", [{"status": 404}, {"status": 500, "count": 0},
                                    {"status": 500, "verbs": ["frobnicate"]}])
def test_bad_rules_are_refused(kwargs: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        Faults().add(now=0, **kwargs)  # type: ignore[arg-type]


def test_counters_count_writes_and_faulted() -> None:
    c = Counters()
    for verb, res in [("apply", "endpointslices"), ("apply", "endpointslices"),
                      ("patch", "virtualmachineinstances/status"), ("get", "services"),
                      ("delete", "services")]:
        c.count(verb, res)
    c.faulted[("apply", "endpointslices")] += 1
    assert c.writes() == 4
    assert c.writes("endpointslices") == 2
    assert c.writes("endpointslices", served_only=True) == 1
    assert c.writes("virtualmachineinstances") == 1  # subresources count for their kind
    assert c.writes(verb="delete") == 1
    assert c.snapshot()["endpointslices"] == {"apply": 2}
