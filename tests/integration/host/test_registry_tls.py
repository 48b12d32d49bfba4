"""The registry over HTTPS against the API double: the self-issued registry CA in its Secret,
the fingerprint in every ImexEnsemble's status, rotation without a dropped long-poll, the
token refused over plain HTTP for ``registryTLS: Required``, and cert-manager style files
re-read when they change.

Real parts: the host agent in the test's loop (real uvicorn listeners on loopback, real
lightkube against the API double), the guest's own HTTP client and pinned trust
(guest_agent/registry_trust.py) as the TLS client.
"""

from __future__ import annotations

import asyncio
import base64
import datetime as dt
import hashlib
import shutil
import ssl
from pathlib import Path
from typing import Any

import httpx
import pytest

from guest_agent import http
from guest_agent.registry_trust import RegistryTrust
from host_agent.ca import authority
from host_agent.ca.registry_tls import SECRET_NAME, Names, service_names
from imex_shared.model import EnsembleId
from tests.host_support.kubevirt import vmi
from tests.integration.host.conftest import NS, AgentFactory, RunningAgent, eventually
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(120)

CR = ("imex-ensemble.io/v1alpha1", "ImexEnsemble")
TOKEN = "guest-token-tls"
TOKEN_SHA = hashlib.sha256(TOKEN.encode()).hexdigest()
AGENT_NS = "imex-system"
ENS = EnsembleId(NS, "gb300")


def tls_settings(**more: Any) -> dict[str, Any]:
    return {"tls_self_issued": True, "tls_listen_host": "127.0.0.1", "tls_listen_port": 0,
            "tls_sans": ("127.0.0.1",), "agent_namespace": AGENT_NS, "tls_recheck": 0.2,
            "trusted_proxies": ("127.0.0.0/8",), **more}


def https_url(agent: RunningAgent) -> str:
    assert agent.agent.tls is not None
    host, port = agent.agent.tls.address
    return f"https://{host}:{port}"


def http_url(agent: RunningAgent) -> str:
    assert agent.agent.address is not None
    return f"http://{agent.agent.address[0]}:{agent.agent.address[1]}"


def secret_ca_sha256(api: KubeApiHandle) -> str | None:
    try:
        obj = api.get("v1", "Secret", SECRET_NAME, AGENT_NS)
    except Exception:
        return None
    pem = base64.b64decode(obj["data"]["ca.crt"]).decode()
    return hashlib.sha256(ssl.PEM_cert_to_DER_cert(pem)).hexdigest()


def setup(api: KubeApiHandle, required: bool = False) -> None:
    api.put({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": AGENT_NS}})
    api.put({"apiVersion": CR[0], "kind": CR[1], "metadata": {"name": "gb300", "namespace": NS},
             "spec": {"tokenSHA256": TOKEN_SHA, "maxMembers": 4,
                      **({"registryTLS": "Required"} if required else {})}})
    api.put(vmi("gb300-0", ensemble="gb300", ip="10.244.3.1"))


async def put_status(base: str, ctx: ssl.SSLContext | None) -> http.Response:
    return await http.request(
        "PUT", f"{base}/v1/ensembles/{NS}/gb300/members/0/status",
        json_body={"imex_state": "READY"}, token=TOKEN, ssl_context=ctx,
        headers={"X-Forwarded-For": "10.244.3.1"})


async def test_self_issued_ca_is_pinned_shown_and_rotated_without_a_dropped_longpoll(
        api: KubeApiHandle, start_agent: AgentFactory) -> None:
    setup(api)
    # a 3 s serving certificate: renewed at two thirds, while a long-poll is parked
    agent = await start_agent(**tls_settings(registry_cert_lifetime=3.0))
    await agent.settled()
    ca_sha = await eventually(lambda: secret_ca_sha256(api), what="the registry TLS Secret")
    await eventually(lambda: agent.agent.tls is not None and agent.agent.tls.loaded.is_set(),
                     what="HTTPS served")
    status = await eventually(
        lambda: (api.get(*CR, "gb300", NS).get("status") or {}).get("registryCASHA256"),
        what="status.registryCASHA256")
    assert status == ca_sha
    trust = RegistryTrust(https_url(agent), ca_sha)
    ctx = await trust.context()
    first_seen = await http.request("GET", f"{https_url(agent)}/version", ssl_context=ctx)
    assert first_seen.status == 200 and first_seen.server_cert is not None
    # the CA the registry publishes is the one pinned (and the one in the Secret)
    ca_pem = (await http.request("GET", f"{http_url(agent)}/v1/registry-ca.crt")).body
    assert hashlib.sha256(ssl.PEM_cert_to_DER_cert(ca_pem.decode())).hexdigest() == ca_sha
    snap = agent.agent.state.get(ENS)
    assert snap is not None
    parked = asyncio.create_task(http.request(
        "GET", f"{https_url(agent)}/v1/ensembles/{NS}/gb300?wait={snap.generation}&timeout=6",
        ssl_context=ctx, read_timeout=20))
    await asyncio.sleep(0.3)
    assert agent.agent.tls is not None
    rotations = agent.agent.tls.rotations
    await eventually(lambda: agent.agent.tls.rotations > rotations,  # type: ignore[union-attr]
                     timeout=15, what="a renewal of the serving certificate")
    again = await http.request("GET", f"{https_url(agent)}/version", ssl_context=ctx)
    assert again.server_cert is not None and first_seen.server_cert is not None
    assert again.server_cert["sha256"] != first_seen.server_cert["sha256"]  # the new one
    assert secret_ca_sha256(api) == ca_sha  # the CA, and so every guest's pin, stays
    api.put(vmi("gb300-1", ensemble="gb300", ip="10.244.3.2"))
    answer = await parked  # the long-poll parked before the rotation is answered, not cut
    assert answer.status == 200
    assert answer.json()["generation"] > snap.generation  # type: ignore[index]
    await agent.stop()
    # a restarted agent keeps the registry CA (the Secret is read, never replaced)
    agent2 = await start_agent(**tls_settings())
    await eventually(lambda: agent2.agent.tls is not None and agent2.agent.tls.loaded.is_set(),
                     what="HTTPS served again")
    assert agent2.agent.tls is not None and agent2.agent.tls.ca_sha256() == ca_sha


async def test_required_refuses_the_token_over_plain_http(
        api: KubeApiHandle, start_agent: AgentFactory) -> None:
    setup(api, required=True)
    agent = await start_agent(**tls_settings())
    await agent.settled()
    await eventually(lambda: agent.agent.tls is not None and agent.agent.tls.loaded.is_set(),
                     what="HTTPS served")
    await eventually(lambda: agent.agent.state.get(ENS) is not None
                     and agent.agent.state.get(ENS).spec.registry_tls_required,  # type: ignore[union-attr]
                     what="the spec read")
    plain = await put_status(http_url(agent), None)
    assert plain.status == 403 and b"registryTLS: Required" in plain.body
    async with httpx.AsyncClient(trust_env=False) as client:  # a 0.1 guest's long-poll
        got = await client.get(f"{http_url(agent)}/v1/ensembles/{NS}/gb300",
                               headers={"Authorization": f"Bearer {TOKEN}"})
        assert got.status_code == 403
        assert (await client.get(f"{http_url(agent)}/v1/ensembles/{NS}/gb300")).status_code \
            == 200  # reading without a token (curl in the cluster) is as before
    assert agent.agent.tls is not None
    ctx = await RegistryTrust(https_url(agent), agent.agent.tls.ca_sha256()).context()
    over_tls = await put_status(https_url(agent), ctx)
    assert over_tls.status == 200, over_tls.body
    shown = agent.agent.state.get(ENS).reports[0].fields  # type: ignore[union-attr]
    assert shown["transport"] == "https"
    refused = agent.agent.metrics_registry.get_sample_value(
        "imex_registry_auth_failures_total", {"reason": "plain_http"})
    assert refused == 1


def write_files(d: Path, ca: authority.CaKeyPair, names: Names, now: dt.datetime,
                lifetime: dt.timedelta) -> str:
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    cert = authority.issue_server(ca, key.public_key(), names.dns, names.ips, now, lifetime)
    tmp = d / "new"
    tmp.mkdir(exist_ok=True)
    (tmp / "tls.crt").write_text(authority.cert_pem(cert))
    (tmp / "tls.key").write_text(authority._key_pem(key))
    (tmp / "ca.crt").write_text(authority.cert_pem(ca.cert))
    for name in ("tls.crt", "tls.key", "ca.crt"):  # as the kubelet swaps a Secret volume
        (tmp / name).replace(d / name)
    shutil.rmtree(tmp)
    return authority.fingerprint(cert)


async def test_cert_files_are_re_read_when_they_change(
        api: KubeApiHandle, start_agent: AgentFactory, tmp_path: Path) -> None:
    setup(api)
    now = dt.datetime.now(dt.UTC)
    ca = authority.new_ca(None, now, name=authority.registry_ca_name("cert-manager"))
    names = service_names("imex-host-agent", AGENT_NS, ("127.0.0.1",))
    first_cert = write_files(tmp_path, ca, names, now, dt.timedelta(days=1))
    agent = await start_agent(
        tls_listen_host="127.0.0.1", tls_listen_port=0, agent_namespace=AGENT_NS,
        tls_cert_file=str(tmp_path / "tls.crt"),
        tls_private_key_file=str(tmp_path / "tls.key"), tls_file_interval=0.1)
    await eventually(lambda: agent.agent.tls is not None and agent.agent.tls.loaded.is_set(),
                     what="HTTPS served")
    assert agent.agent.tls is not None
    assert agent.agent.tls.ca_sha256() == ca.sha256  # the ca.crt beside the certificate
    ctx = await RegistryTrust(https_url(agent), ca.sha256).context()
    seen = await http.request("GET", f"{https_url(agent)}/version", ssl_context=ctx)
    assert seen.server_cert is not None and seen.server_cert["sha256"] == first_cert
    second = write_files(tmp_path, ca, names, now, dt.timedelta(days=2))
    await eventually(lambda: agent.agent.tls.rotations == 1,  # type: ignore[union-attr]
                     what="the new files loaded")
    seen = await http.request("GET", f"{https_url(agent)}/version", ssl_context=ctx)
    assert seen.server_cert is not None and seen.server_cert["sha256"] == second
    # an expired certificate written over it is refused (said), the good one stays
    write_files(tmp_path, ca, names, now - dt.timedelta(days=3), dt.timedelta(days=1))
    await asyncio.sleep(0.5)
    assert agent.agent.tls.rotations == 1
    seen = await http.request("GET", f"{https_url(agent)}/version", ssl_context=ctx)
    assert seen.server_cert is not None and seen.server_cert["sha256"] == second


async def test_replicas_serve_the_one_registry_ca_the_leader_keeps(
        api: KubeApiHandle, start_agent: AgentFactory) -> None:
    """Two electing replicas: one Secret, created once (by the leader); both serve a
    certificate from the same registry CA, so a guest's pin fits whichever answers."""
    setup(api)
    elect = {"leader_elect": True, "leader_elect_lease_duration": 3.0,
             "leader_elect_renew_deadline": 2.0, "leader_elect_retry_period": 0.5}
    agents = [await start_agent(identity=f"r{i}", **elect, **tls_settings()) for i in range(2)]
    for a in agents:
        await eventually(lambda a=a: a.agent.tls is not None and a.agent.tls.loaded.is_set(),
                         timeout=30, what="HTTPS served by every replica")
    ca_sha = secret_ca_sha256(api)
    assert ca_sha is not None
    assert {a.agent.tls.ca_sha256() for a in agents} == {ca_sha}  # type: ignore[union-attr]
    assert api.writes("secrets") == 1  # created once, by the leader
    for a in agents:
        ctx = await RegistryTrust(https_url(a), ca_sha).context()
        answer = await http.request("GET", f"{https_url(a)}/version", ssl_context=ctx)
        assert answer.status == 200
