"""The IMEX stand-in's mutual TLS: peers with certificates from the ensemble CA connect;
an intruder on a member's address does not, whatever it holds; SIGUSR1 reloads the files.

Real processes in network namespaces (tests.sandbox.netns); certificates from
host_agent.ca.authority, the same code the registry signs with.
"""

from __future__ import annotations

import datetime as dt
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from guest_agent.tls.imex_config import imex_tls_settings, merge_imex_config
from host_agent.ca import authority as ca_mod
from imex_shared.model import EnsembleId
from tests.sandbox.imex_standin import (
    AuthError,
    ConfigFileError,
    StandinProcess,
    check_peer_name,
    parse_config,
    write_standin_files,
)
from tests.sandbox.netns import Fabric, Node

pytestmark = pytest.mark.root
T = TypeVar("T")
ENS = EnsembleId("gpu", "tls")
NOW = dt.datetime.now(dt.UTC)


def wait_for(what: str, probe: Callable[[], T | None], timeout: float = 20.0) -> T:
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}; last probe: {last!r}")


def creds(d: Path, ca: ca_mod.CaState | None, slot: str, trust: list[ca_mod.CaState]) -> None:
    """Key, certificate for ``slot`` signed by ``ca``, and the CA file trusting ``trust``."""
    d.mkdir(parents=True, exist_ok=True)
    key = ec.generate_private_key(ec.SECP256R1())
    (d / "imex.key").write_bytes(key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption()))
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, slot)])).add_extension(
        x509.SubjectAlternativeName([x509.DNSName(slot)]), critical=False).sign(
        key, hashes.SHA256())
    assert ca is not None
    leaf = ca_mod.issue_leaf(ca.current, csr, slot, NOW)
    (d / "imex.crt").write_text(ca_mod.cert_pem(leaf))
    (d / "ca.crt").write_text("".join(ca_mod.cert_pem(c.current.cert) for c in trust))


def setup(d: Path, entries: list[str], tls: bool = True) -> Path:
    cfg = write_standin_files(d, entries)
    if tls:
        cfg.write_text(merge_imex_config(cfg.read_text(), imex_tls_settings(str(d / "tls"))))
    return cfg


@pytest.fixture
def fabric() -> Iterator[Fabric]:
    with Fabric("tlsn") as fab:
        yield fab


@pytest.fixture
def daemons() -> Iterator[list[StandinProcess]]:
    started: list[StandinProcess] = []
    yield started
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait(5)


def peers(imex: StandinProcess) -> dict[str, Any]:
    return imex.state().get("peers", {})


def connected(imex: StandinProcess, want: list[int]) -> bool:
    p = peers(imex)
    return all(p.get(str(i), {}).get("status") == "CONNECTED" for i in want)


def test_name_check_wants_cn_and_san_both() -> None:
    good = {"subject": ((("commonName", "imex-a-1"),),), "subjectAltName": (("DNS", "imex-a-1"),)}
    check_peer_name(good, "imex-a-1")
    for bad in (
        {"subject": ((("commonName", "imex-a-1"),),)},  # CN only: ssl would have accepted it
        {"subject": ((("commonName", "other"),),), "subjectAltName": (("DNS", "imex-a-1"),)},
        {"subject": ((("commonName", "imex-a-1"),),), "subjectAltName": (("DNS", "other"),)},
        None,
    ):
        with pytest.raises(AuthError):
            check_peer_name(bad, "imex-a-1")


def test_auth_config_is_parsed_and_other_modes_refused(tmp_path: Path) -> None:
    text = merge_imex_config("SERVER_PORT=50000\n", imex_tls_settings("/t"))
    cfg = parse_config(text)
    assert cfg.tls is not None and cfg.tls.server_ca == Path("/t/ca.crt")
    assert cfg.tls.client_cert == Path("/t/imex.crt") and cfg.tls.target_override == ""
    with pytest.raises(ConfigFileError, match="SSL_TLS only"):
        parse_config(text.replace("SSL_TLS", "GSS_AUTH_ONLY"))
    assert parse_config("IMEX_ENABLE_AUTH_ENCRYPTION=0\n").tls is None


def test_members_connect_and_intruders_on_a_member_address_never_do(
        fabric: Fabric, tmp_path: Path, daemons: list[StandinProcess]) -> None:
    ca = ca_mod.first_state(ENS, NOW)
    other_ca = ca_mod.first_state(EnsembleId("other", "ens"), NOW)
    nodes: list[Node] = [fabric.add_node() for _ in range(3)]
    entries = [ENS.slot(i) for i in range(3)]
    names = {ENS.slot(i): n.ip for i, n in enumerate(nodes)}
    imexes = []
    for i, nd in enumerate(nodes):
        nd.write_hosts(fabric.hosts_lines(names))
        creds(tmp_path / f"n{i}" / "tls", ca, ENS.slot(i), [ca])
        imexes.append(StandinProcess.start(setup(tmp_path / f"n{i}", entries), node=nd))
    daemons.extend(imexes)
    for i, imex in enumerate(imexes):
        wait_for(f"node {i} all CONNECTED", lambda imex=imex, i=i: connected(
            imex, [j for j in range(3) if j != i]))  # type: ignore[misc]
    assert imexes[0].domain()["status"] == "UP"

    # slot 2's VM is deleted; the intruder gets its address (peers still pin it)
    assert imexes[2].stop() == 0
    intruders = {
        "same CA, another slot": (ca, ENS.slot(1), [ca]),
        "another ensemble's CA": (other_ca, ENS.slot(2), [other_ca]),
        "no certificate": None,
    }
    for n, (what, spec) in enumerate(intruders.items()):
        d = tmp_path / f"intruder{n}"
        if spec is not None:
            creds(d / "tls", *spec)
        intruder = StandinProcess.start(setup(d, entries, tls=spec is not None), node=nodes[2])
        daemons.append(intruder)
        wait_for(f"{what}: intruder up", lambda i=intruder: i.state().get("state") == "READY")
        for m in (0, 1):
            refused = wait_for(
                f"{what}: member {m} refuses the intruder",
                lambda m=m: (p := peers(imexes[m])["2"])["status"] == "AUTHENTICATING"
                and "authentication failed" in p["last_error"] and p)
            assert refused["ip"] == nodes[2].ip  # it did reach the pinned address
            dom = imexes[m].domain()
            own = dom["nodes"][str(m)]
            assert own["connections"]["2"]["status"] == "AUTHENTICATING"  # A in the legend
            table = imexes[m].ctl("-N").stdout
            assert "2:A" in table, table  # the text view's legend letter
            assert dom["nodes"]["2"]["status"] == "UNAVAILABLE" and dom["status"] == "DEGRADED"
            wait_for(f"{what}: member {m} logged the refused incoming link", lambda m=m: any(
                r["dir"] == "in" for r in imexes[m].state().get("auth_refusals", [])))
        time.sleep(2.0)  # several retries in each direction
        st = intruder.state()
        assert all(p["status"] != "CONNECTED" for p in st["peers"].values()), (what, st)
        for m in (0, 1):
            assert peers(imexes[m])["2"]["status"] != "CONNECTED"
            assert connected(imexes[m], [1 - m])  # the members still hold each other
        assert intruder.stop() == 0


def test_sigusr1_reloads_the_credentials(fabric: Fabric, tmp_path: Path,
                                         daemons: list[StandinProcess]) -> None:
    old = ca_mod.first_state(ENS, NOW)
    new = ca_mod.rotate(old, ENS, "r1", NOW, dt.timedelta(hours=1))
    new_ca = ca_mod.CaState(new.current)
    nodes = [fabric.add_node() for _ in range(2)]
    entries = [ENS.slot(i) for i in range(2)]
    names = {ENS.slot(i): n.ip for i, n in enumerate(nodes)}
    imexes = []
    for i, nd in enumerate(nodes):
        nd.write_hosts(fabric.hosts_lines(names))
        creds(tmp_path / f"n{i}" / "tls", old, ENS.slot(i), [old])
        imexes.append(StandinProcess.start(setup(tmp_path / f"n{i}", entries), node=nd))
    daemons.extend(imexes)
    wait_for("connected", lambda: connected(imexes[0], [1]) and connected(imexes[1], [0]))
    # node 0 moves to the new CA alone: node 1 (old CA only) refuses it once it redials
    creds(tmp_path / "n0" / "tls", new_ca, ENS.slot(0), [new_ca])
    imexes[0].signal(signal.SIGUSR1)
    wait_for("node 0 reloaded", lambda: imexes[0].state().get("tls_reloads") == 1)
    wait_for("node 0's new certificate is refused by node 1",
             lambda: peers(imexes[0])["1"]["status"] == "AUTHENTICATING")
    # node 1 gets both CAs and a new-CA certificate: one SIGUSR1 each and all is well
    creds(tmp_path / "n1" / "tls", new_ca, ENS.slot(1), [new_ca, old])
    imexes[1].signal(signal.SIGUSR1)
    wait_for("both connected on the new CA",
             lambda: connected(imexes[0], [1]) and connected(imexes[1], [0]), timeout=30)
    assert imexes[1].state()["tls_reloads"] == 1
    assert imexes[0].state()["starts"] == 1 and imexes[1].state()["starts"] == 1
