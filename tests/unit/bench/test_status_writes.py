"""The boot storm's sender (tests/bench/status_writes.py ``send_reports``), against a real
loopback server: every report arrives as the registry expects it (the guest's path, its
address in X-Forwarded-For, the bench token, the JSON body), one connection per guest is
kept across its reports, and only 200s count as accepted."""

from __future__ import annotations

import asyncio
import json

from tests.bench.kube_proc import BENCH_TOKEN, NAMESPACE, member_ip
from tests.bench.status_writes import send_reports


async def serve_and_send(reports: list[tuple[float, int, int, str, int]],
                         answers_per_connection: int = 1_000,
                         ) -> tuple[int, list[dict[str, object]], int, list[float]]:
    seen: list[dict[str, object]] = []
    connections = 0

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        try:
            for _ in range(answers_per_connection):
                head = (await r.readuntil(b"\r\n\r\n")).decode()
                line, *fields = head.split("\r\n")
                headers = {k.lower(): v.strip() for k, _, v in
                           (f.partition(":") for f in fields if f)}
                body = json.loads(await r.readexactly(int(headers["content-length"])))
                seen.append({"line": line, "xff": headers["x-forwarded-for"],
                             "auth": headers["authorization"], "body": body})
                status = b"200 OK" if "/members/1/" not in line else b"503 Busy"
                w.write(b"HTTP/1.1 " + status + b"\r\nContent-Length: 2\r\n\r\n{}")
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    answers: list[float] = []
    async with server:
        ok = await send_reports(port, reports, answers)
    return ok, seen, connections, answers


def test_each_report_arrives_as_the_registry_expects_and_only_200s_count() -> None:
    reports = [(0.0, 0, 0, "READY", 3), (0.0, 0, 1, "READY", 3),
               (0.05, 2, 0, "WAITING_FOR_PEERS", 7), (0.1, 0, 0, "UNAVAILABLE", 3)]
    ok, seen, connections, answers = asyncio.run(serve_and_send(reports))
    assert ok == 3  # member 1's 503 is not accepted
    assert len(answers) == 4 and all(a >= 0 for a in answers)
    assert connections == 3  # e0/0 sent twice on the connection it kept
    by_line = sorted((s["line"], s["xff"], json.dumps(s["body"], sort_keys=True))
                     for s in seen)
    path = f"/v1/ensembles/{NAMESPACE}"
    assert by_line == sorted([
        (f"PUT {path}/e0/members/0/status HTTP/1.1", member_ip(0, 0),
         '{"generation_applied": 3, "imex_state": "READY"}'),
        (f"PUT {path}/e0/members/0/status HTTP/1.1", member_ip(0, 0),
         '{"generation_applied": 3, "imex_state": "UNAVAILABLE"}'),
        (f"PUT {path}/e0/members/1/status HTTP/1.1", member_ip(0, 1),
         '{"generation_applied": 3, "imex_state": "READY"}'),
        (f"PUT {path}/e2/members/0/status HTTP/1.1", member_ip(2, 0),
         '{"generation_applied": 7, "imex_state": "WAITING_FOR_PEERS"}'),
    ])
    assert {s["auth"] for s in seen} == {f"Bearer {BENCH_TOKEN}"}


def test_a_kept_connection_the_server_closed_is_opened_again() -> None:
    """uvicorn closes a connection idle past its keep-alive timeout; the churn's guests
    pause longer than that between reports."""
    reports = [(0.0, 0, 0, "READY", 3), (0.1, 0, 0, "UNAVAILABLE", 3),
               (0.2, 0, 0, "READY", 4)]
    ok, seen, connections, _ = asyncio.run(serve_and_send(reports, answers_per_connection=1))
    assert ok == 3  # every report answered, none lost on a closed connection
    assert connections == 3
    assert [s["body"] for s in seen] == [
        {"imex_state": "READY", "generation_applied": 3},
        {"imex_state": "UNAVAILABLE", "generation_applied": 3},
        {"imex_state": "READY", "generation_applied": 4}]
