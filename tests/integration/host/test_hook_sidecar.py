"""The KubeVirt hook Info server over a real unix socket, with a real grpc client.

Answers are decoded with the protobuf runtime from descriptors written after
KubeVirt's .proto files (tests/host_support/hook_oracle.py), not with the
agent's own codec. What virt-launcher does with the answer (pick the newest
of v1alpha3/v1alpha2/v1alpha1 it finds in ``versions``, fail the VMI on an
Info error) is mirrored by ``launcher_accepts``.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from host_agent.sidecar.hook import HookSidecarError
from host_agent.sidecar.hook_io import HookServer
from tests.host_support.hook_oracle import message
from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS, AgentFactory, eventually
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parents[3]
INFO = "/kubevirt.hooks.info.Info/Info"
InfoParams = message("kubevirt.hooks.info.InfoParams")
InfoResult = message("kubevirt.hooks.info.InfoResult")
KNOWN_HOOK_POINTS = {"OnDefineDomain", "PreCloudInitIso", "Shutdown"}


@pytest.fixture
def hook_dir() -> Iterator[Path]:
    """A short directory (unix socket paths are limited to 107 bytes; tmp_path can be longer)."""
    path = Path(tempfile.mkdtemp(prefix="hook-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


async def call(path: Path | str, method: str, request: Any, response_cls: Any = None,
               timeout: float = 5.0) -> Any:
    """One unary call; ``request`` is a runtime message or raw bytes."""
    raw = request if isinstance(request, bytes) else request.SerializeToString()
    async with grpc.aio.insecure_channel(f"unix:{path}") as channel:
        answer: bytes = await channel.unary_unary(method)(raw, timeout=timeout)
    return response_cls.FromString(answer) if response_cls is not None else answer


async def info(path: Path | str) -> Any:
    return await call(path, INFO, InfoParams(), InfoResult)


def launcher_accepts(result: Any) -> str:
    """The version virt-launcher would use for this answer (its order: newest first)."""
    chosen = next((v for v in ("v1alpha3", "v1alpha2", "v1alpha1") if v in result.versions), None)
    assert chosen is not None, f"virt-launcher would refuse versions {list(result.versions)}"
    return chosen


async def test_info_answer_field_by_field(hook_dir: Path) -> None:
    path = hook_dir / "imex-host-agent.sock"
    server = HookServer(str(path))
    await server.start()
    try:
        mode = os.lstat(path).st_mode
        assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o666  # launcher may be another uid
        result = await info(path)
        assert result.name == "imex-host-agent"
        assert list(result.versions) == ["v1alpha3", "v1alpha2"]
        assert [(p.name, p.priority) for p in result.hookPoints] == [("Shutdown", 0)]
        assert {p.name for p in result.hookPoints} <= KNOWN_HOOK_POINTS
        assert launcher_accepts(result) == "v1alpha3"
        assert server.info_calls == 1
        # Nothing else was created next to the socket: virt-launcher dials every entry.
        assert sorted(os.listdir(hook_dir)) == ["imex-host-agent.sock"]
    finally:
        await server.stop()
    assert not path.exists()


@pytest.mark.parametrize("version", ["v1alpha2", "v1alpha3"])
async def test_domain_and_cloud_init_hooks_return_their_input(hook_dir: Path, version: str) -> None:
    path = hook_dir / "h.sock"
    server = HookServer(str(path))
    await server.start()
    svc = f"/kubevirt.hooks.{version}.Callbacks"
    try:
        xml = b"<domain type='kvm'><name>gpu-jobs_gb200-0</name>\n\t<uuid>\xc3\xa9</uuid></domain>"
        vmi_json = json.dumps({"metadata": {"name": "gb200-0"}}).encode()
        define = message(f"kubevirt.hooks.{version}.OnDefineDomainParams")(
            domainXML=xml, vmi=vmi_json)
        out = await call(path, svc + "/OnDefineDomain", define,
                         message(f"kubevirt.hooks.{version}.OnDefineDomainResult"))
        assert out.domainXML == xml
        data = json.dumps({"DataSource": "NoCloud", "UserData": "#cloud-config\n"}).encode()
        legacy = json.dumps({"userData": "#cloud-config\n"}).encode()
        iso = message(f"kubevirt.hooks.{version}.PreCloudInitIsoParams")(
            cloudInitNoCloudSource=legacy, vmi=vmi_json, cloudInitData=data)
        out = await call(path, svc + "/PreCloudInitIso", iso,
                         message(f"kubevirt.hooks.{version}.PreCloudInitIsoResult"))
        assert (out.cloudInitData, out.cloudInitNoCloudSource) == (data, legacy)
        if version == "v1alpha2":  # Shutdown exists only from v1alpha3 on
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(path, svc + "/Shutdown", b"")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await server.stop()


async def test_bad_calls_get_grpc_errors_and_the_server_keeps_answering(hook_dir: Path) -> None:
    path = hook_dir / "h.sock"
    server = HookServer(str(path))
    await server.start()
    try:
        for method in ("/kubevirt.hooks.info.Info/Nope", "/kubevirt.hooks.v1alpha1.Callbacks/x",
                       "/no.such.Service/Info"):
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(path, method, b"")
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED, method
        bad = {  # truncated length, group wire type, wrong wire type for domainXML
            INFO: b"\x0a\x09abc",
            "/kubevirt.hooks.v1alpha3.Callbacks/Shutdown": b"\x0b",
            "/kubevirt.hooks.v1alpha3.Callbacks/OnDefineDomain": b"\x08\x01",
        }
        for method, raw in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as err:
                await call(path, method, raw)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method
            assert "malformed" in (err.value.details() or "")
        assert "domainXML (field 1)" in (err.value.details() or "")
        assert launcher_accepts(await info(path)) == "v1alpha3"
    finally:
        await server.stop()


async def test_shutdown_hook_calls_back_once_per_call(hook_dir: Path) -> None:
    path = hook_dir / "h.sock"
    calls: list[int] = []
    server = HookServer(str(path), on_shutdown=lambda: calls.append(1))
    await server.start()
    try:
        params = message("kubevirt.hooks.v1alpha3.ShutdownParams")()
        out = await call(path, "/kubevirt.hooks.v1alpha3.Callbacks/Shutdown", params,
                         message("kubevirt.hooks.v1alpha3.ShutdownResult"))
        assert out.ByteSize() == 0 and calls == [1]
    finally:
        await server.stop()


async def test_socket_rules(hook_dir: Path) -> None:
    path = hook_dir / "h.sock"
    # A socket left by a dead previous run (the emptyDir outlives a container restart).
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(path))
    stale.close()
    server = HookServer(str(path))
    await server.start()
    try:
        assert (await info(path)).name == "imex-host-agent"
        # A second server on the same path must not steal a live socket.
        with pytest.raises(HookSidecarError, match="another server is listening"):
            await HookServer(str(path)).start()
        assert (await info(path)).name == "imex-host-agent"
    finally:
        await server.stop()
    assert not path.exists()

    path.write_text("not a socket")
    with pytest.raises(HookSidecarError, match="exists and is not a socket"):
        await HookServer(str(path)).start()
    assert path.read_text() == "not a socket"
    with pytest.raises(HookSidecarError, match="does not exist"):
        await HookServer(str(hook_dir / "missing" / "h.sock")).start()
    with pytest.raises(HookSidecarError, match="absolute"):
        HookServer("h.sock")
    with pytest.raises(HookSidecarError, match="too long"):
        HookServer("/" + "x" * 120)


# --- in the agent ------------------------------------------------------------------


async def test_agent_answers_info_and_stops_after_the_shutdown_hook(
    api: KubeApiHandle, start_agent: AgentFactory, hook_dir: Path
) -> None:
    api.put(service("gb200", namespace=NS))
    api.put(vmi("gb200-0", ip="10.244.0.1"))
    path = hook_dir / "imex-host-agent.sock"
    agent = await start_agent(vmi="gb200-0", namespaces=(NS,), hook_socket=str(path),
                              hook_shutdown_linger=0.3)
    assert launcher_accepts(await info(path)) == "v1alpha3"
    await agent.settled()
    slices = api.list("discovery.k8s.io/v1", "EndpointSlice", NS)
    assert [s["metadata"]["name"] for s in slices] == ["gb200-imex-vmi-gb200-0"]
    loop = asyncio.get_running_loop()
    called = loop.time()
    await call(path, "/kubevirt.hooks.v1alpha3.Callbacks/Shutdown", b"")
    async with asyncio.timeout(10):
        await asyncio.shield(agent.task)
    assert loop.time() - called >= 0.3  # lingered before stopping
    assert agent.task.exception() is None
    assert not path.exists()


async def test_agent_with_an_unusable_hook_socket_fails_to_start(
    api: KubeApiHandle, start_agent: AgentFactory, hook_dir: Path
) -> None:
    (hook_dir / "h.sock").mkdir()
    agent = await start_agent(vmi="gb200-0", namespaces=(NS,), hook_socket=str(hook_dir / "h.sock"))
    async with asyncio.timeout(10):
        with pytest.raises(HookSidecarError, match="is not a socket"):
            await asyncio.shield(agent.task)


async def test_cli_process_serves_the_hook_from_the_environment(
    api: KubeApiHandle, hook_dir: Path
) -> None:
    api.put(service("gb200", namespace=NS))
    api.put(vmi("gb200-0", ip="10.244.0.1"))
    path = hook_dir / "imex-host-agent.sock"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "IMEX_HOST_AGENT_HOOK_SOCKET": str(path),
           "POD_NAMESPACE": NS}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host_agent.cli", "--kubeconfig", str(api.kubeconfig_path),
        "--listen", "127.0.0.1:0", "--vmi", "gb200-0", env=env, cwd=ROOT,
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )
    try:
        await eventually(lambda: path.exists() or proc.returncode is not None, 20, "hook socket")
        assert proc.returncode is None
        assert launcher_accepts(await info(path)) == "v1alpha3"
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(15):
            assert await proc.wait() == 0
        assert not path.exists()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


# --- the manifest ---------------------------------------------------------------------


@pytest.mark.usefixtures("machine_kubectl")
def test_sidecar_overlay_command_gives_the_agent_a_hook_socket(tmp_path: Path) -> None:
    """Run the annotation's shell command with stand-ins, and parse its argv with the real CLI."""
    from host_agent.cli import build_settings
    from tests.integration.test_manifests import pool_vmi_spec

    meta, _ = pool_vmi_spec("overlays/sidecar")
    (sidecar,) = json.loads(meta["annotations"]["hooks.kubevirt.io/hookSidecars"])
    script = sidecar["command"][-1]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    stubs = {"hostname": "echo gb200-3", "cat": "echo gpu-jobs",
             "imex-host-agent": f'exec {sys.executable} -c "import json,sys; '
                                f'print(json.dumps(sys.argv[1:]))" "$@"'}
    for name, body in stubs.items():
        (bindir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bindir / name).chmod(0o755)
    out = subprocess.run([*sidecar["command"][:2], script], check=True, capture_output=True,
                         text=True, env={"PATH": f"{bindir}:/usr/bin:/bin"}).stdout
    settings = build_settings(json.loads(out), {})
    assert settings.hook_socket is not None
    assert os.path.dirname(settings.hook_socket) == "/var/run/kubevirt-hooks"
    assert settings.hook_socket.endswith(".sock")
    assert (settings.vmi, settings.namespaces) == ("gb200-3", ("gpu-jobs",))
