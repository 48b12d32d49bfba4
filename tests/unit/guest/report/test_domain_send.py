"""The guest's "send imex_domain with this report or not" decision (pure parts)."""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

from guest_agent.config import Settings
from guest_agent.http import Response
from guest_agent.report.report import (
    DOMAIN_REFRESH,
    DomainAccepted,
    Report,
    domain_key,
    domain_refresh,
    send_domain,
)
from guest_agent.report.report_io import Reporter, asks_for_domain, boot_stamper, lists_itself
from tests.unit.shared.test_imex_domain import domain_doc


def test_key_ignores_the_timestamp_but_not_a_link_or_its_changed_stamp() -> None:
    a = domain_doc(4)
    a["timestamp"] = 1795974000
    later = {**copy.deepcopy(a), "timestamp": 1795974010}
    assert domain_key(a) == domain_key(later)
    flipped = copy.deepcopy(a)
    flipped["nodes"]["0"]["connections"]["2"]["status"] = "DISCONNECTED"
    assert domain_key(flipped) != domain_key(a)
    stamped = copy.deepcopy(a)
    stamped["nodes"]["0"]["connections"]["2"]["changed"] = 1795974005
    assert domain_key(stamped) != domain_key(a)
    assert domain_key({**a, "status": "DEGRADED"}) != domain_key(a)
    assert domain_key(None) not in (domain_key({}), domain_key(a))


def test_send_when_nothing_accepted_changed_or_a_minute_old() -> None:
    key = domain_key(domain_doc(4))
    assert send_domain(key, None, 100.0)  # first report, or after a failure
    accepted = DomainAccepted(key, 100.0)
    assert not send_domain(key, accepted, 110.0)
    assert send_domain(domain_key(None), accepted, 110.0)  # the view went away
    assert send_domain(domain_key(domain_doc(3)), accepted, 100.5)
    assert not send_domain(key, accepted, 100.0 + DOMAIN_REFRESH - 0.001)
    assert send_domain(key, accepted, 100.0 + DOMAIN_REFRESH)


def test_an_unchanged_view_reaches_the_registry_at_least_once_a_minute() -> None:
    # reports every report_interval plus the collection's time: the full view goes on
    # the first one and then never more than 60 s after the previous full one
    for interval, took in ((10.0, 0.0), (10.0, 0.3), (7.0, 0.9), (30.0, 0.1), (90.0, 0.0)):
        refresh = domain_refresh(interval)
        key, accepted, sent = domain_key(domain_doc(4)), None, []
        t = 0.0
        while t < 600.0:
            if send_domain(key, accepted, t, refresh):
                accepted = DomainAccepted(key, t)
                sent.append(t)
            t += interval + took
        gaps = [b - a for a, b in itertools.pairwise(sent)]
        bound = max(DOMAIN_REFRESH, interval + took)  # no report, nothing to carry it
        assert sent[0] == 0.0 and gaps and max(gaps) <= bound, (interval, gaps)
        reports = int(600 / (interval + took)) + 1
        if interval <= 10:
            assert len(sent) <= reports / 4, (interval, len(sent), reports)  # most omit it
        if interval > DOMAIN_REFRESH:
            assert len(sent) == reports  # every report is a minute apart or more


def test_wire_body_leaves_out_only_an_unchanged_accepted_view() -> None:
    now = [1000.0]
    reporter = Reporter(Settings(ensemble="e", namespace="n", max_members=4),
                        clock=lambda: now[0], stamp=lambda: None)
    view = {**domain_doc(4), "timestamp": 1}
    body = {"imex_state": "READY", "imex_domain": view}
    ready = {"imex_state": "READY", "registry_ca_sha256": None}  # 0.2: always said
    wire, key = reporter.wire_body(Report(0, body))
    assert wire == {**ready, "imex_domain": view} and key == domain_key(view)
    reporter.domain_accepted = DomainAccepted(key, now[0])
    now[0] += 10
    wire, key = reporter.wire_body(Report(0, {**body, "imex_domain": {**view, "timestamp": 2}}))
    assert wire == ready and key is None
    wire, key = reporter.wire_body(Report(0, {**body, "imex_domain": None}))
    assert wire == {**ready, "imex_domain": None} and key == domain_key(None)
    wire, key = reporter.wire_body(Report(0, {"imex_state": "READY"}))  # nothing collected
    assert wire == ready and key is None


def test_only_a_json_true_domain_needed_asks_for_the_view() -> None:
    """The answer's ``domain_needed``: a registry that does not send it, or an answer
    that is not what the registry sends (a proxy's page, a string), asks for nothing
    and never raises."""
    def answer(body: bytes) -> Response:
        return Response(200, "OK", {}, body)

    assert asks_for_domain(answer(b'{"generation": 3, "received_at": "x", '
                                  b'"domain_needed": true}'))
    for body in (b'{"generation": 3, "received_at": "x"}',  # an older registry
                 b'{"domain_needed": false}', b'{"domain_needed": "true"}',
                 b'{"domain_needed": 1}', b'[true]', b'<html>', b'', b'\xff\xfe'):
        assert not asks_for_domain(answer(body)), body


def test_a_view_is_resent_on_request_only_when_it_lists_the_member_itself() -> None:
    """The registry keeps only the member's own entry of a view: a view without it
    cannot answer a request for a row, so it is not resent for one."""
    doc = domain_doc(3)
    assert lists_itself(Report(1, {"imex_domain": doc}))
    assert not lists_itself(Report(7, {"imex_domain": doc}))  # not among its nodes
    assert not lists_itself(Report(1, {"imex_state": "READY"}))  # no view in the report
    assert not lists_itself(Report(1, {"imex_domain": None}))  # "no view"
    odd = copy.deepcopy(doc)
    odd["nodes"]["1"] = "CONNECTED"
    assert not lists_itself(Report(1, {"imex_domain": odd}))
    assert not lists_itself(Report(1, {"imex_domain": {"nodes": ["1"]}}))


def test_every_body_is_stamped_as_it_goes_and_the_stamp_is_left_out_where_refused(
    tmp_path: Path,
) -> None:
    """``sent``: the boot's id and CLOCK_BOOTTIME of each attempt, so the registry orders
    a member's reports as they were sent (a late-handled request is older); a 0.1
    registry refuses the field and it is left out like any 0.2 field."""
    boot = tmp_path / "boot_id"
    boot.write_text("6f1c2a4e-0000-4000-8000-00000000abcd\n")
    reporter = Reporter(Settings(ensemble="e", namespace="n", max_members=4),
                        stamp=boot_stamper(boot))
    first, _ = reporter.wire_body(Report(0, {"imex_state": "READY"}))
    second, _ = reporter.wire_body(Report(0, {"imex_state": "READY"}))
    assert first["sent"]["boot_id"] == second["sent"]["boot_id"] == \
        "6f1c2a4e-0000-4000-8000-00000000abcd"
    assert second["sent"]["boottime_ns"] > first["sent"]["boottime_ns"]
    reporter.dropped["sent"] = reporter.clock()
    assert "sent" not in reporter.wire_body(Report(0, {"imex_state": "READY"}))[0]
    # no boot id to read (an odd guest): reports go unstamped, ordered by receipt
    assert boot_stamper(tmp_path / "missing")() is None
    boot.write_text("")
    assert boot_stamper(boot)() is None
