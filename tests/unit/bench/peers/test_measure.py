"""The peers benchmark's readings: attempt logs, audit events, CoreDNS metrics, ratios."""

from __future__ import annotations

import json

import pytest

from tests.bench.peers.measure import (
    Attempt,
    MeasureError,
    all_connected_at,
    attempts_by_ip,
    by_label,
    events_since,
    fewer,
    first_connected,
    metric_sum,
    parse_attempts,
    parse_audit,
    parse_prometheus,
    percentile,
    qps,
    received_at,
    rfc3339,
    speedup,
    stale_attempts,
)


def line(**kw: object) -> str:
    return json.dumps(kw) + "\n"


def att(t: float, peer: int, ip: str | None, outcome: str, te: float | None = None) -> Attempt:
    return Attempt("attempt", t, t if te is None else te, peer, ip, outcome)


def test_attempt_log_lines_parse_and_a_torn_last_line_waits() -> None:
    text = (line(ev="attempt", t=1.0, te=1.2, peer=3, host="h", ip="10.0.0.3",
                 outcome="refused", error="x")
            + line(ev="lost", t=2.0, peer=3, host="h", ip="10.0.0.3", error="closed")
            + line(ev="listening", t=2.5, ip="10.0.0.9", port=50000)
            + '{"ev": "attempt", "t": 3')
    got = parse_attempts(text)
    assert got == [Attempt("attempt", 1.0, 1.2, 3, "10.0.0.3", "refused"),
                   Attempt("lost", 2.0, 2.0, 3, "10.0.0.3", "lost"),
                   Attempt("listening", 2.5, 2.5, -1, "10.0.0.9", "")]


def test_a_complete_bad_line_is_an_error_naming_it() -> None:
    with pytest.raises(MeasureError, match="line 2"):
        parse_attempts(line(ev="lost", t=1, peer=0) + "not json\n")


def test_first_connected_wants_that_peer_that_address_after_the_moment() -> None:
    log = [att(1.0, 2, "10.0.0.2", "connected", 1.1),   # before t0
           att(5.0, 2, "10.0.0.9", "refused"),
           att(5.5, 1, "10.0.0.9", "connected", 5.6),   # another peer id
           att(6.0, 2, "10.0.0.8", "connected", 6.1),   # another address
           att(7.0, 2, "10.0.0.9", "connected", 7.2),
           att(9.0, 2, "10.0.0.9", "connected", 9.1)]
    assert first_connected(log, 2, "10.0.0.9", after=4.0) == 7.2
    assert first_connected(log, 2, "10.0.0.2", after=4.0) is None


def test_events_since_keeps_what_started_or_ended_from_then_on() -> None:
    log = [att(float(t), 0, "ip", "refused", t + 0.5) for t in range(100)]
    log.insert(60, att(47.0, 0, "ip", "timeout", 50.2))  # a long dial, logged late
    got = events_since(log, 50.0)
    assert [a.t for a in got][:2] == [50.0, 51.0] and 47.0 in [a.t for a in got]
    assert len(got) == 51  # 50..99 and the long dial
    assert events_since(log, 1000.0) == []
    assert len(events_since(log, 0.0)) == 101


def test_all_connected_is_the_last_peer_and_none_until_every_one() -> None:
    logs = {"a": [att(5.0, 0, "ip", "connected", 5.3)],
            "b": [att(5.0, 0, "ip", "connected", 6.0)]}
    assert all_connected_at(logs, 0, "ip", 4.0) == 6.0
    logs["c"] = [att(5.0, 0, "ip", "refused")]
    assert all_connected_at(logs, 0, "ip", 4.0) is None


def test_stale_attempts_count_only_that_address_from_the_moment_on() -> None:
    logs = {"a": [att(1.0, 4, "old", "timeout"), att(3.0, 4, "old", "timeout"),
                  att(3.5, 4, None, "no_address")],
            "b": [att(2.5, 4, "old", "refused"), att(4.0, 4, "127.0.0.2", "refused")]}
    s = stale_attempts(logs, "old", after=2.0)
    assert (s.attempts, s.last, s.per_peer) == (2, 3.0, {"a": 1, "b": 1})
    none = stale_attempts(logs, "old", after=10.0)
    assert (none.attempts, none.last) == (0, None)
    assert attempts_by_ip(logs["a"] + logs["b"]) == {"old": 3, "127.0.0.2": 1}


def audit_line(ua: str, code: int = 200, stage: str = "ResponseComplete",
               received: str = "2026-12-01T11:22:33.123456Z") -> str:
    return json.dumps({"stage": stage, "userAgent": ua, "verb": "patch",
                       "objectRef": {"resource": "pods", "subresource": "status", "name": "p"},
                       "responseStatus": {"code": code}, "requestReceivedTimestamp": received,
                       "stageTimestamp": "2026-12-01T11:22:33.200000Z"})


def test_audit_times_are_microseconds_of_the_request_with_that_user_agent() -> None:
    events = parse_audit([audit_line("a"), audit_line("b", code=422), "garbage",
                          audit_line("c", stage="RequestReceived"), '{"stage": "Resp'])
    assert [e.user_agent for e in events] == ["a", "b"]
    assert received_at(events, "a") == pytest.approx(rfc3339("2026-12-01T11:22:33.123456Z"))
    assert rfc3339("2026-12-01T11:22:33.123456Z") - rfc3339("2026-12-01T11:22:33Z") == \
        pytest.approx(0.123456)
    assert received_at(events, "b") is None  # refused writes start no clock
    assert received_at(events, "zzz") is None
    with pytest.raises(MeasureError, match="2 audit events"):
        received_at(parse_audit([audit_line("a"), audit_line("a")]), "a")


REQ = 'coredns_dns_requests_total{family="1",proto="%s",server="dns://:53",type="%s",zone="."}'
PROM = "\n".join([
    "# HELP coredns_dns_requests_total Counter of DNS requests made per zone and protocol.",
    "# TYPE coredns_dns_requests_total counter",
    REQ % ("udp", "A") + " 120",
    REQ % ("udp", "AAAA") + " 118",
    REQ % ("tcp", "SRV") + " 2",
    "process_open_fds 12",
    'weird{path="a\\"b,c"} 1.5e+02',
    "",
])


def test_prometheus_samples_sum_and_group() -> None:
    s = parse_prometheus(PROM)
    assert metric_sum(s, "coredns_dns_requests_total") == 240
    assert metric_sum(s, "coredns_dns_requests_total", proto="udp") == 238
    assert by_label(s, "coredns_dns_requests_total", "type") == {"A": 120, "AAAA": 118, "SRV": 2}
    assert metric_sum(s, "process_open_fds") == 12
    assert metric_sum(s, "weird", path='a"b,c') == 150
    with pytest.raises(MeasureError, match="bad sample"):
        parse_prometheus("x{a=\"1\"} notanumber\n")


def test_rates_ratios_and_percentiles() -> None:
    assert qps(100, 160, 60) == 1.0
    with pytest.raises(MeasureError, match="went down"):
        qps(100, 10, 60)
    assert speedup(2000, 200) == 10.0
    assert speedup(None, 200) is None and speedup(2000, 0) is None
    # ours 0 queries in a 60 s window counts as 1/60 per second
    assert fewer(192.0, 0.0, 60) == pytest.approx(192 * 60)
    assert fewer(192.0, 1.2, 60) == pytest.approx(160)
    assert percentile([5, 1, 4, 2, 3], 50) == 3
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None


def test_cpu_components_and_deltas() -> None:
    from tests.bench.peers import cpu

    assert cpu.classify("/v/bin/python -m guest_agent.cli run --config c") == \
        "guest agents (+ their imex-ctl)"
    assert cpu.classify("/usr/bin/python3 /r/tests/sandbox/bin/nvidia-imex -c x") == \
        "IMEX stand-ins"
    assert cpu.classify("/r/tests/sandbox/bin/.build/nvidia-imex -c x") == "IMEX stand-ins"
    # the native ctl's name holds its daemon's: it must not count as one
    assert cpu.classify("/r/tests/sandbox/bin/.build/nvidia-imex-ctl -c x -N -j") == \
        "imex-ctl stand-ins"
    assert cpu.classify("/b/kube-apiserver --etcd-servers=x") == "kube-apiserver"
    assert cpu.classify("bash") is None
    tck = cpu.CLK_TCK
    stat = f"42 (py thon) S 1 2 3 4 5 6 7 8 9 10 {3 * tck} {tck} {2 * tck} {tck} 20 0"
    assert cpu.stat_seconds(stat, children=False) == 4.0
    assert cpu.stat_seconds(stat, children=True) == 7.0
    before = {1: ("IMEX stand-ins", 1.0), 2: ("host agent", 5.0)}
    after = {1: ("IMEX stand-ins", 1.5), 2: ("host agent", 5.25), 3: ("IMEX stand-ins", 0.25)}
    assert cpu.delta(before, after) == {"IMEX stand-ins": 0.75, "host agent": 0.25}
    total: dict[str, float] = {"host agent": 1.0}
    cpu.add(total, {"host agent": 0.5, "CoreDNS": 0.1})
    assert total == {"host agent": 1.5, "CoreDNS": 0.1}
