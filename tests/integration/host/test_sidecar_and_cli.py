"""Sidecar scope (one agent per VMI) and the real ``imex-host-agent`` process."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
from pathlib import Path

import httpx
import pytest

from imex_shared.model import EnsembleId
from imex_shared.version import package_version
from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS, AgentFactory, eventually
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(60)

ENS = EnsembleId(NS, "gb200")
SLICES = ("discovery.k8s.io/v1", "EndpointSlice")
ROOT = Path(__file__).resolve().parents[3]


def slice_map(api: KubeApiHandle) -> dict[str, list[tuple[str, str]]]:
    return {
        s["metadata"]["name"]: [(e["hostname"], e["addresses"][0]) for e in s["endpoints"]]
        for s in api.list(*SLICES, NS)
    }


async def test_sidecars_each_publish_their_own_vmi(
    api: KubeApiHandle, start_agent: AgentFactory
) -> None:
    api.put(service("gb200", namespace=NS))
    for i in range(3):
        api.put(vmi(f"gb200-{i}", ip=f"10.244.0.{i + 1}"))
    a = await start_agent(vmi="gb200-0", namespaces=(NS,))
    b = await start_agent(vmi="gb200-1", namespaces=(NS,))
    await a.settled()
    await b.settled()
    expected = {
        "gb200-imex-vmi-gb200-0": [(ENS.slot(0), "10.244.0.1")],
        "gb200-imex-vmi-gb200-1": [(ENS.slot(1), "10.244.0.2")],
    }
    await eventually(lambda: slice_map(api) == expected, what="one slice per sidecar")
    # Each sidecar sees only its own VMI (field selector), so it knows one member.
    snap = a.agent.state.get(ENS)
    assert snap is not None and [p.member.vmi for p in snap.members] == ["gb200-0"]
    assert len(a.agent.vmis) == 1
    # The VMI goes (being deleted): its sidecar removes its slice, the other stays.
    api.delete("kubevirt.io/v1", "VirtualMachineInstance", "gb200-1", NS)
    del expected["gb200-imex-vmi-gb200-1"]
    await eventually(lambda: slice_map(api) == expected, what="sidecar slice removed")


async def test_cli_process_serves_publishes_and_stops_on_sigterm(api: KubeApiHandle) -> None:
    # the agent's own namespace (its reports, its CAs): without it, it is not ready
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "imex-system"}})
    api.put(service("gb200", namespace=NS))
    api.put(vmi("gb200-0", ip="10.244.0.1"))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IMEX_HOST_AGENT_JSON": "1",
           "IMEX_HOST_AGENT_NAMESPACE": NS}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host_agent.cli", "--kubeconfig", str(api.kubeconfig_path),
        "--listen", "127.0.0.1:0", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stderr is not None
    lines: list[dict[str, object]] = []
    try:
        port = None
        async with asyncio.timeout(20):
            while port is None:
                raw = await proc.stderr.readline()
                assert raw, f"agent exited early: {lines}"
                doc = json.loads(raw)
                lines.append(doc)
                m = re.search(r"serving on 127\.0\.0\.1:(\d+)", str(doc["msg"]))
                if m:
                    port = int(m.group(1))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            async def ready() -> int:
                return (await http.get("/readyz")).status_code
            for _ in range(300):  # bounded: 15 s
                if await ready() == 200:
                    break
                await asyncio.sleep(0.05)
            else:
                raise AssertionError("/readyz never became 200")
            body = (await http.get(f"/v1/ensembles/{NS}/gb200")).json()
            assert [(m["index"], m["ip"]) for m in body["members"]] == [(0, "10.244.0.1")]
            metrics = (await http.get("/metrics")).text
            assert ('imex_host_agent_members_published{ensemble="gb200",namespace="rack1"} 1.0'
                    in metrics)
            # one version everywhere: the metrics and /version say the installed release
            assert f'imex_build_info{{version="{package_version()}"}} 1.0' in metrics
            assert (await http.get("/version")).json()["version"] == package_version()
        await eventually(lambda: "gb200-imex" in slice_map(api), what="slice from the process")
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            rest = await proc.stderr.read()
            code = await proc.wait()
        assert code == 0
        msgs = [json.loads(x)["msg"] for x in rest.decode().splitlines() if x.startswith("{")]
        assert "stopped" in msgs
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_cli_refuses_a_missing_kubeconfig(tmp_path: Path) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host_agent.cli", "--kubeconfig", str(tmp_path / "none"),
        "--listen", "127.0.0.1:0", env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    async with asyncio.timeout(20):
        _, err = await proc.communicate()
    assert proc.returncode == 2
    assert b"cannot load a Kubernetes configuration from" in err
