"""Invariant 6's bookkeeping (tests/soak/observed.py): what a replica was sent, when it
must serve it, and what a pause or a restart changes."""

from __future__ import annotations

from host_agent.persist.pair import MEMBERSHIP_ANNOTATION
from tests.soak.observed import Observed, generation_of


def test_a_replica_owes_what_it_was_sent_only_after_the_bound() -> None:
    o = Observed(bound=10.0)
    o.deliver("h-a", "a", 100.0, 7)
    assert o.check("h-a", "a", 6, 105.0) is None  # still within the bound
    why = o.check("h-a", "a", 6, 110.5)
    assert why is not None and "h-a" in why and "serves generation 6" in why and " 7" in why
    assert o.check("h-a", "a", 6, 120.0) is None  # reported once, not at every look


def test_serving_it_or_more_meets_the_obligation_and_other_keys_are_apart() -> None:
    o = Observed(bound=10.0)
    o.deliver("h-a", "a", 100.0, 7)
    o.deliver("h-a", "b", 100.0, 3)
    assert o.check("h-a", "a", 8, 120.0) is None
    assert o.due[("h-a", "a")] == []
    assert o.check("h-b", "a", 1, 120.0) is None  # h-b was sent nothing
    assert o.check("h-a", "b", 2, 120.0) is not None
    assert o.check("h-a", "a", None, 130.0) is None  # not serving it: owes nothing yet


def test_a_pause_moves_the_bound_and_a_restart_forgets_the_old_process() -> None:
    o = Observed(bound=10.0)
    o.deliver("h-a", "a", 100.0, 7)
    o.paused("h-a", 115.0)  # SIGSTOPped until then: it could not read its socket
    assert o.check("h-a", "a", 6, 120.0) is None
    assert o.check("h-a", "a", 6, 125.5) is not None
    o.deliver("h-b", "a", 100.0, 9)
    o.restarted("h-b", 101.0)
    o.deliver("h-b", "a", 102.0, 9)  # the new process's own list
    assert o.due[("h-b", "a")] == [(102.0, 9)]
    assert o.check("h-b", "a", 5, 111.5) is None  # 10 s from the restart, not the list
    assert o.check("h-b", "a", 5, 112.5) is not None


def test_the_generation_comes_from_the_annotation_or_the_status() -> None:
    pair = ('{"v":1,"generation":42,"view":{"pins":[[0,"10.0.0.1"]],'
            '"ca_bundle_sha256":null,"cliques":[]},"since":[[0,1]]}')
    svc = {"metadata": {"name": "x", "namespace": "n",
                        "annotations": {MEMBERSHIP_ANNOTATION: pair}}}
    assert generation_of("services", svc) == 42
    assert generation_of("services", {"metadata": {"name": "x"}}) is None
    bad = {"metadata": {"annotations": {MEMBERSHIP_ANNOTATION: "{not json"}}}
    assert generation_of("services", bad) is None
    assert generation_of("imexensembles/status", {"status": {}}) is None
    assert generation_of("imexensembles", {"status": "junk"}) is None
