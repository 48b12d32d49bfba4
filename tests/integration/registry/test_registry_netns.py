"""Guest status auth with real addresses: the guest calls from inside a network namespace.

The registry (uvicorn) listens in the root namespace on one end of a veth
pair; the other end lives in a namespace ``regy<n>`` holding the member's
published address and a second, foreign address. A small stdlib client run
with ``ip netns exec`` binds its source address to one of them, so the
registry sees exactly the peer address a guest VM would present.
"""

from __future__ import annotations

import asyncio
import hashlib
import ipaddress
import json
import os
import random
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import serve

pytestmark = pytest.mark.root

TOKEN = "netns token"
ENS = EnsembleId("gpu", "netns")


@dataclass(frozen=True)
class Link:
    netns: str
    host_ip: str  # root namespace end: where the registry listens
    member_ip: str  # the member's published address, inside the namespace
    other_ip: str  # another address inside the namespace (not the member's)


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def _free_subnet() -> ipaddress.IPv4Network:
    routes = subprocess.run(
        ["ip", "-j", "-4", "route", "show", "table", "all"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    taken = [
        ipaddress.ip_network(r["dst"], strict=False)
        for r in json.loads(routes)
        if r.get("dst", "default") not in ("default",) and r["dst"][0].isdigit()
    ]
    for _ in range(50):
        net = ipaddress.ip_network(f"10.{random.randint(64, 127)}.{random.randint(0, 255)}.0/24")
        if not any(net.overlaps(t) for t in taken):
            return net
    raise RuntimeError("no free /24 for the test link")


@pytest.fixture
def link() -> Iterator[Link]:
    tag = f"regy{os.getpid() % 100000}"
    netns, host_end, guest_end = tag, f"{tag}h", f"{tag}g"
    net = _free_subnet()
    host_ip, member_ip, other_ip = (str(net[i]) for i in (1, 2, 3))
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", host_end, "type", "veth", "peer", "name", guest_end)
        _ip("link", "set", guest_end, "netns", netns)
        _ip("addr", "add", f"{host_ip}/24", "dev", host_end)
        _ip("link", "set", host_end, "up")
        for addr in (member_ip, other_ip):
            _ip("-n", netns, "addr", "add", f"{addr}/24", "dev", guest_end)
        _ip("-n", netns, "link", "set", guest_end, "up")
        _ip("-n", netns, "link", "set", "lo", "up")
        yield Link(netns, host_ip, member_ip, other_ip)
    finally:
        subprocess.run(["ip", "link", "del", host_end], capture_output=True)
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)


# Runs inside the namespace: one PUT per line of argv[1] (JSON), prints status and body.
_CLIENT = """
import http.client, json, sys
host, port, calls = sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3])
out = []
for source, path, headers, body in calls:
    conn = http.client.HTTPConnection(host, port, timeout=10, source_address=(source, 0))
    conn.request("PUT", path, body=body.encode(), headers=headers)
    response = conn.getresponse()
    out.append([response.status, json.loads(response.read() or b"null")])
    conn.close()
print(json.dumps(out))
"""


async def _put_from_netns(
    link: Link, port: int, calls: list[tuple[str, str, dict[str, str], str]]
) -> list[tuple[int, dict[str, object]]]:
    proc = await asyncio.create_subprocess_exec(
        "ip", "netns", "exec", link.netns, sys.executable, "-c", _CLIENT,
        link.host_ip, str(port), json.dumps(calls),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(proc.communicate(), 30)
    assert proc.returncode == 0, err.decode()
    return [(status, body) for status, body in json.loads(out)]


async def test_token_and_address_checks_with_real_addresses(link: Link) -> None:
    state = State()
    spec = EnsembleSpec(ENS, 4, 50000, token_sha256=hashlib.sha256(TOKEN.encode()).hexdigest())
    state.set(spec, [Member(1, link.member_ip, "gb200-1", "node-a", "Running", True)], [])
    state.mark_synced()
    path = "/v1/ensembles/gpu/netns/members/1/status"
    good = json.dumps({"imex_state": "READY", "generation_applied": 3, "agent_version": "0.1"})
    right = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    wrong = {**right, "Authorization": "Bearer not-the-token"}
    member, other = link.member_ip, link.other_ip
    async with serve(state, host=link.host_ip) as reg:
        results = await _put_from_netns(
            link,
            reg.port,
            [
                (member, path, {"Content-Type": "application/json"}, good),  # no token
                (member, path, wrong, good),  # wrong token
                (other, path, right, good),  # right token, wrong address
                (member, path, right, '{"imex_state": "READY", "colour": "blue"}'),  # ignored
                (member, path, right, '{"imex_state": 7}'),  # wrong type
                (member, path, right, "{not json"),  # not JSON
                (member, path, right, good),  # all right
            ],
        )
        async with httpx.AsyncClient(base_url=reg.url) as client:
            shown = (await client.get("/v1/ensembles/gpu/netns")).json()
        failures = {
            reason: reg.sample("imex_registry_auth_failures_total", reason=reason)
            for reason in ("missing_token", "wrong_token", "wrong_address")
        }
        accepted = reg.sample("imex_registry_reports_total", namespace="gpu", ensemble="netns")
    statuses = [status for status, _ in results]
    # a field the registry does not know (a newer guest's) is ignored, not refused
    assert statuses == [401, 401, 403, 200, 422, 422, 200], results
    assert other in results[2][1]["error"] and member in results[2][1]["error"]
    assert "imex_state" in results[4][1]["error"]
    assert results[6][1]["generation"] == shown["generation"]
    guest = shown["members"][0]["guest"]
    assert guest["from_ip"] == member
    assert (guest["imex_state"], guest["generation_applied"], guest["agent_version"]) == (
        "READY",
        3,
        "0.1",
    )
    assert guest["stale"] is False
    assert failures == {"missing_token": 1, "wrong_token": 1, "wrong_address": 1}
    assert accepted == 2
