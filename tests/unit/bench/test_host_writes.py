"""What the host benchmarks count as an API write (tests/bench/host_writes.py)."""

from __future__ import annotations

from tests.bench.host_writes import _no_lease, reviews, split


def test_reviews_and_leases_are_not_writes_and_events_are_apart() -> None:
    made = {"endpointslices": 1000, "services": 1000, "events": 7, "leases": 40,
            "selfsubjectaccessreviews": 21, "imexensembles/status": 3}
    assert split(made) == (2003, 7)
    assert reviews(made) == 21
    assert _no_lease(made) == {"endpointslices": 1000, "services": 1000, "events": 7,
                               "imexensembles/status": 3}


def test_a_stored_write_is_never_taken_for_a_review() -> None:
    assert split({"selfsubjectaccessreviews": 5}) == (0, 0)
    assert split({"subjectaccessreviews-like": 5, "secrets": 1}) == (6, 0)
