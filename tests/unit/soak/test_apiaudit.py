"""Invariant 4 on the real apiserver's audit log (tests/soak/apiaudit.py), on lines shaped
as kube-apiserver writes them (JSON, ResponseComplete, Lease answers at RequestResponse),
and the realk8s soak's schedule (tests/soak/realk8s.py's ``draw``)."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

from tests.soak.apiaudit import HOLD_BACK_S, Ledger, parse
from tests.soak.realk8s import KIND_NAMES, draw

T0 = dt.datetime(2026, 12, 3, 18, 0, 0, tzinfo=dt.UTC)


def _at(s: float) -> str:
    return (T0 + dt.timedelta(seconds=s)).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def line(received: float, completed: float, verb: str, resource: str, name: str,
         code: int = 200, ident: str = "ha-1", holder: str | None = None,
         subresource: str = "", namespace: str = "soak") -> str:
    ev: dict[str, Any] = {
        "kind": "Event", "apiVersion": "audit.k8s.io/v1", "level": "Metadata",
        "stage": "ResponseComplete", "verb": verb,
        "userAgent": f"imex-host-agent/0.3.0 ({ident})",
        "objectRef": {"resource": resource, "namespace": namespace, "name": name,
                      **({"subresource": subresource} if subresource else {})},
        "responseStatus": {"metadata": {}, "code": code},
        "requestReceivedTimestamp": _at(received), "stageTimestamp": _at(completed)}
    if holder is not None:
        ev["level"] = "RequestResponse"
        ev["responseObject"] = {"kind": "Lease", "spec": {"holderIdentity": holder}}
    return json.dumps(ev)


def lease(received: float, completed: float, holder: str, ident: str | None = None,
          code: int = 200, verb: str = "update") -> str:
    return line(received, completed, verb, "leases", "imex-host-agent", code,
                ident or holder, holder, namespace="imex-system")


def judge(*lines: str) -> tuple[Ledger, list[str]]:
    ledger = Ledger("imex-system", "imex-host-agent")
    events = [ev for ln in lines if (ev := parse(ln)) is not None]
    return ledger, ledger.feed(events, final=True)


def test_a_write_by_the_holder_is_fine_and_counted() -> None:
    ledger, found = judge(lease(0, 0.01, "ha-1", verb="create"),
                          line(1, 1.02, "patch", "endpointslices", "gb200-imex"))
    assert found == []
    assert (ledger.guarded_writes, ledger.writes_seen) == (1, 1)
    assert ledger.holder_at(0.5 + T0.timestamp()) == "ha-1"


def test_a_2xx_write_received_after_a_takeover_completed_is_stale() -> None:
    _, found = judge(
        lease(0, 0.01, "ha-1"),
        lease(10, 10.02, "ha-2"),  # ha-2 takes over
        line(11, 11.05, "update", "imexensembles", "gb300", ident="ha-1",
             subresource="status"))
    assert len(found) == 1
    assert found[0].startswith("ha-1 wrote update imexensembles/status soak/gb300 (200)")
    assert found[0].endswith("while the Lease holder was ha-2")


def test_a_write_received_while_the_takeover_was_in_flight_is_not_judged_stale() -> None:
    _, found = judge(lease(0, 0.01, "ha-1"), lease(10, 10.50, "ha-2"),
                     line(10.2, 10.6, "patch", "services", "gb200", ident="ha-1"))
    assert found == []


def test_refused_stale_attempts_and_stale_events_are_counted_not_violations() -> None:
    ledger, found = judge(
        lease(0, 0.01, "ha-2"),
        line(1, 1.1, "update", "endpointslices", "s", code=409, ident="ha-1"),
        line(2, 2.1, "create", "events", "e1", code=201, ident="ha-1"),
        line(3, 3.1, "patch", "configmaps", "imex-reports-x", ident="ha-1"))
    assert found == []
    assert (ledger.stale_refused, ledger.stale_events, ledger.guarded_writes) == (1, 1, 1)


def test_a_released_lease_makes_every_later_write_stale() -> None:
    _, found = judge(lease(0, 0.01, "ha-1"), lease(5, 5.01, ""),  # released at SIGTERM
                     line(6, 6.1, "delete", "secrets", "imex-ca", ident="ha-1"))
    assert found and found[0].endswith("while the Lease holder was nobody")


def test_a_refused_lease_write_does_not_change_the_holder() -> None:
    _, found = judge(lease(0, 0.01, "ha-1"),
                     lease(5, 5.01, "ha-2", code=409),
                     line(6, 6.1, "patch", "services", "gb200", ident="ha-1"))
    assert found == []


def test_a_lease_line_written_after_the_write_it_precedes_still_counts() -> None:
    """The log is written at completion: a takeover that completed first can land on a
    later line. Writes wait HOLD_BACK_S before they are judged."""
    ledger = Ledger("imex-system", "imex-host-agent")
    first = [parse(lease(0, 0.01, "ha-1")),
             parse(line(10.3, 10.4, "patch", "services", "gb200", ident="ha-1"))]
    assert ledger.feed([e for e in first if e]) == []  # held back, not judged yet
    late = parse(lease(10.0, 10.2, "ha-2"))
    after = parse(line(10 + HOLD_BACK_S + 1, 10 + HOLD_BACK_S + 1.1, "get", "services", "x"))
    assert late and after
    found = ledger.feed([late, after])
    assert len(found) == 1 and "holder was ha-2" in found[0]


def test_lines_that_are_not_complete_events_are_skipped() -> None:
    assert parse("not json") is None
    assert parse(json.dumps({"stage": "ResponseStarted"})) is None
    assert parse(json.dumps({"stage": "ResponseComplete"})) is None  # no timestamps
    ev = parse(line(0, 1, "get", "services", "gb200", ident="ha-7"))
    assert ev is not None and ev.ident == "ha-7" and ev.holder is None


def test_the_schedule_is_the_seeds_and_only_the_seeds() -> None:
    members = ["gb200-0", "gb300-1"]
    a, b = draw(7, 40, members), draw(7, 40, list(reversed(members)))
    assert a == b
    assert a != draw(8, 40, members)
    assert {f.kind for f in a} <= set(KIND_NAMES)
    assert len({f.kind for f in draw(7, 200, members)}) == len(KIND_NAMES)
    assert all(not f.churn for f in a if f.kind in ("migration", "vm-crash"))
    assert all(f.target in members and f.gap >= 2 for f in a)
