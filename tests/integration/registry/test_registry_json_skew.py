"""The registry's JSON across releases: a guest ignores fields it does not know.

The 0.1.0 guest's own parser (from commit 8503169's wheel, tests/sandbox/releases.py)
reads this release's ensemble document, which has fields 0.1.0 never saw
(``guest.registry_ca_sha256``, ``guest.transport``), and takes the same members from it;
this release's parser reads a document with fields no release has yet, at every level.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import os
import subprocess

import httpx

from guest_agent.peers.registry import parse_ensemble
from host_agent.registry.config import RegistryConfig
from tests.integration.registry.registry_harness import ENS, TOKEN, seeded_state, serve
from tests.sandbox.releases import previous_release

_OLD_PARSE = """
import json, sys
from guest_agent.registry_client import parse_ensemble
from guest_agent.model import EnsembleId
doc = json.loads(sys.stdin.read())
snap = parse_ensemble(doc, EnsembleId("gpu", "gb200"), 4, lambda m: print("WARN", m))
print(json.dumps({"generation": snap.generation,
                  "members": [[m.index, m.ip] for m in snap.members]}))
"""


async def test_the_0_1_guest_reads_this_registrys_document() -> None:
    config = RegistryConfig(trusted_proxies=(ipaddress.ip_network("127.0.0.0/8"),))
    async with serve(seeded_state(), config) as reg, httpx.AsyncClient(base_url=reg.url) as c:
        put = await c.put("/v1/ensembles/gpu/gb200/members/0/status",
                          json={"imex_state": "READY", "registry_ca_sha256": "a" * 64},
                          headers={"Authorization": f"Bearer {TOKEN}",
                                   "X-Forwarded-For": "10.213.0.10"})
        assert put.status_code == 200
        text = (await c.get("/v1/ensembles/gpu/gb200")).text
    doc = json.loads(text)
    guest = doc["members"][0]["guest"]
    assert guest["transport"] == "http" and guest["registry_ca_sha256"] == "a" * 64  # new
    release = await asyncio.to_thread(previous_release)  # built once, then cached
    old = await asyncio.to_thread(
        subprocess.run, [release.python, "-c", _OLD_PARSE], input=text, capture_output=True,
        text=True, timeout=60, env=release.env(os.environ), cwd="/", check=False)
    assert old.returncode == 0, old.stderr
    lines = old.stdout.strip().splitlines()
    assert not [ln for ln in lines if ln.startswith("WARN")], lines  # nothing refused
    seen = json.loads(lines[-1])
    mine = parse_ensemble(doc, ENS, 4)
    assert seen == {"generation": mine.generation,
                    "members": [[m.index, m.ip] for m in mine.members]}
    assert len(seen["members"]) == 2


def test_this_guest_ignores_fields_no_release_has_yet() -> None:
    doc = {"namespace": "gpu", "name": "gb200", "domain_id": ENS.domain_id, "generation": 7,
           "max_members": 4, "port": 50000, "problems": [], "tls": None,
           "future_top": {"x": [1, 2]},
           "members": [{"index": 1, "slot": ENS.slot(1), "ip": "10.0.0.1", "vmi": "v",
                        "node": "n", "phase": "Running", "ready": True, "since": "x",
                        "guest": {"future_guest": 1}, "clique": None, "future_member": "y"}]}
    warned: list[str] = []
    snap = parse_ensemble(doc, ENS, 4, warned.append)
    assert snap.generation == 7 and snap.pins == {1: "10.0.0.1"} and warned == []
