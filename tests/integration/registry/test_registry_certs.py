"""The certificate endpoint over real HTTP: every refusal with its exact code, hostile CSRs,
and what it issues checked by independent verifiers (``openssl verify``, ``openssl x509``).

The CA comes from ``host_agent.ca.authority`` through a fixed ``CaSource``; the Secret side is
tested in tests/integration/host/test_ca_store.py and tests/realk8s.
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import re
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from host_agent.ca import authority as ca_mod
from host_agent.ca.secret_io import CaUnavailable
from host_agent.registry.config import CertConfig
from host_agent.state.snapshot import EnsembleSpec
from host_agent.state.store import State
from imex_shared.model import EnsembleId, Member
from tests.integration.registry.registry_harness import SPEC, TOKEN, Running, serve

ENS = EnsembleId("gpu", "tls")
SLOT0 = ENS.slot(0)
URL = "/v1/ensembles/gpu/tls/members/{}/certificate"
AUTH = {"Authorization": f"Bearer {TOKEN}"}

openssl = shutil.which("openssl")
needs_openssl = pytest.mark.skipif(openssl is None, reason="the openssl CLI is not installed")


class FixedCa:
    def __init__(self, state: ca_mod.CaState | None) -> None:
        self.state = state

    async def load(self, ens: EnsembleId) -> ca_mod.CaState:
        if self.state is None:
            raise CaUnavailable("the CA Secret does not exist yet")
        return self.state


def make_state(auth: bool = True) -> State:
    state = State()
    spec = EnsembleSpec(ENS, 4, 50000, token_sha256=SPEC.token_sha256, auth_encryption=auth)
    # Member 0 may call from loopback (one of its VMI's addresses); member 1 may not.
    state.set(spec, [Member(0, "10.213.0.10"), Member(1, "10.213.0.11")], [],
              {0: frozenset({"10.213.0.10", "127.0.0.1"}), 1: frozenset({"10.213.0.11"})})
    state.mark_synced()
    return state


def csr_for(key: ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey, cn: str | None = SLOT0,
            sans: list[x509.GeneralName] | None = None) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)] if cn else []))
    names = [x509.DNSName(SLOT0)] if sans is None else sans
    if names:
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def run_openssl(*args: str, check: bool = False) -> subprocess.CompletedProcess[str]:
    """The independent verifier (sync: the server has stopped when it runs)."""
    assert openssl is not None
    return subprocess.run([openssl, *args], capture_output=True, text=True, check=check)


def _der_len(n: int) -> bytes:
    if n < 0x80:
        return bytes([n])
    body = n.to_bytes((n.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(body)]) + body


def spliced_csr() -> str:
    """A CSR whose request info carries key A but whose signature was made by key B."""
    a, b = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    csr_a = x509.load_pem_x509_csr(csr_for(a).encode())
    csr_b = x509.load_pem_x509_csr(csr_for(b).encode())
    alg = bytes.fromhex("300a06082a8648ce3d040302")  # ecdsa-with-SHA256
    sig = b"\x00" + csr_b.signature
    body = csr_a.tbs_certrequest_bytes + alg + b"\x03" + _der_len(len(sig)) + sig
    der = b"\x30" + _der_len(len(body)) + body
    parsed = x509.load_der_x509_csr(der)
    assert parsed.public_key().public_numbers() == a.public_key().public_numbers()
    return parsed.public_bytes(serialization.Encoding.PEM).decode()


@pytest.fixture
def ca_state() -> ca_mod.CaState:
    return ca_mod.first_state(ENS, dt.datetime.now(dt.UTC))


def p256() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


async def test_issues_a_leaf_that_openssl_verifies(ca_state: ca_mod.CaState,
                                                  tmp_path: Path) -> None:
    before = dt.datetime.now(dt.UTC)
    async with serve(make_state(), ca_source=FixedCa(ca_state)) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        r = await client.post(URL.format(0), json={"csr": csr_for(p256())}, headers=AUTH)
        after = dt.datetime.now(dt.UTC)
        assert r.status_code == 200, r.text
        assert set(r.json()) == {"certificate", "ca", "not_after"}
        assert reg.sample("imex_registry_certificates_issued_total",
                          namespace="gpu", ensemble="tls") == 1
        leaf = x509.load_pem_x509_certificate(r.json()["certificate"].encode())
        assert reg.sample("imex_registry_certificate_not_after_seconds", namespace="gpu",
                          ensemble="tls", index="0") == leaf.not_valid_after_utc.timestamp()
        metrics_text = (await client.get("/metrics")).text
    assert f"{leaf.serial_number:x}" not in metrics_text and str(leaf.serial_number) not in \
        metrics_text
    body = r.json()
    assert body["ca"] == ca_state.bundle_pem()
    assert body["not_after"] == leaf.not_valid_after_utc.strftime("%Y-%m-%dT%H:%M:%SZ")
    # backdated 5 min from the moment of issue (between before and after; a certificate
    # keeps whole seconds): no wall-clock slack for how long the machine took
    backdated = dt.timedelta(minutes=5)
    assert before - backdated - dt.timedelta(seconds=1) <= leaf.not_valid_before_utc \
        <= after - backdated
    life = leaf.not_valid_after_utc - leaf.not_valid_before_utc
    assert life == dt.timedelta(days=7, minutes=5)
    if openssl is None:
        pytest.skip("the openssl CLI is not installed: independent checks not run")
    (tmp_path / "ca.pem").write_text(body["ca"])
    (tmp_path / "leaf.pem").write_text(body["certificate"])
    verify = run_openssl("verify", "-CAfile", str(tmp_path / "ca.pem"), "-purpose", "sslserver",
                         str(tmp_path / "leaf.pem"))
    assert verify.returncode == 0 and verify.stdout.strip().endswith(": OK"), verify
    client_purpose = run_openssl("verify", "-CAfile", str(tmp_path / "ca.pem"), "-purpose",
                                 "sslclient", str(tmp_path / "leaf.pem"))
    assert client_purpose.returncode == 0, client_purpose
    text = run_openssl("x509", "-noout", "-text", "-in", str(tmp_path / "leaf.pem"),
                       check=True).stdout
    assert f"Subject: CN = {SLOT0}" in text
    assert re.search(r"X509v3 Subject Alternative Name: *\n *DNS:" + SLOT0 + r"\n", text), text
    assert "TLS Web Server Authentication, TLS Web Client Authentication" in text
    assert re.search(r"X509v3 Basic Constraints: critical\n *CA:FALSE", text)
    assert re.search(r"X509v3 Key Usage: critical\n *Digital Signature\n", text)
    assert "X509v3 Subject Key Identifier" in text and "X509v3 Authority Key Identifier" in text
    nb = re.search(r"Not Before: (.+ GMT)", text)
    na = re.search(r"Not After : (.+ GMT)", text)
    assert nb and na
    fmt = "%b %d %H:%M:%S %Y %Z"
    not_before = dt.datetime.strptime(" ".join(nb.group(1).split()), fmt).replace(tzinfo=dt.UTC)
    not_after = dt.datetime.strptime(" ".join(na.group(1).split()), fmt).replace(tzinfo=dt.UTC)
    assert not_before == leaf.not_valid_before_utc  # openssl reads what we read
    assert not_after - not_before == dt.timedelta(days=7, minutes=5)
    ca_text = run_openssl("x509", "-noout", "-text", "-in", str(tmp_path / "ca.pem"),
                          check=True).stdout
    assert re.search(r"X509v3 Basic Constraints: critical\n *CA:TRUE, pathlen:0", ca_text)
    assert re.search(r"X509v3 Key Usage: critical\n *Certificate Sign, CRL Sign", ca_text)
    assert "ASN1 OID: prime256v1" in ca_text


async def test_refusals_in_order_with_exact_codes(ca_state: ca_mod.CaState) -> None:
    good = {"csr": csr_for(p256())}
    async with serve(make_state(), ca_source=FixedCa(ca_state)) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        # 413 before anything else: even with no token and for an unknown ensemble
        huge = b'{"csr": "' + b"A" * (1 << 20) + b'"}'
        r = await client.post("/v1/ensembles/nope/nope/members/0/certificate", content=huge)
        assert r.status_code == 413 and "16384" in r.json()["error"]
        just_over = b" " * (16 * 1024 + 1)
        assert (await client.post(URL.format(0), content=just_over, headers=AUTH)
                ).status_code == 413
        # 404 unknown ensemble, before the token is looked at
        r = await client.post("/v1/ensembles/gpu/nope/members/0/certificate", json=good)
        assert r.status_code == 404 and "gpu/nope" in r.json()["error"]
        # 401 token (missing, wrong) before membership
        r = await client.post(URL.format(3), json=good)
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = await client.post(URL.format(3), json=good, headers={"Authorization": "Bearer x"})
        assert r.status_code == 401
        # 404 member not published
        r = await client.post(URL.format(3), json=good, headers=AUTH)
        assert r.status_code == 404 and "no published member 3" in r.json()["error"]
        # 403 address: member 1's VMI has no loopback address
        r = await client.post(URL.format(1), json=good, headers=AUTH)
        assert r.status_code == 403 and "10.213.0.11" in r.json()["error"]
        # 422 body schema
        r = await client.post(URL.format(0), json={"csr": 5}, headers=AUTH)
        assert r.status_code == 422
        r = await client.post(URL.format(0), json={"csr": "x", "extra": 1}, headers=AUTH)
        assert r.status_code == 422
        r = await client.post(URL.format(0), content=b"{not json", headers=AUTH)
        assert r.status_code == 422
        assert reg.sample("imex_registry_certificates_issued_total",
                          namespace="gpu", ensemble="tls") == 0


HOSTILE: list[tuple[str, int, str]] = [
    ("garbage PEM", 422, "does not parse"),
    ("signed by another key", 422, "signature"),
    ("ECDSA P-384", 422, "P-256"),
    ("RSA 1024", 422, "RSA 1024"),
    ("100 SANs", 403, "and 95 more"),
    ("an IP SAN", 403, "IP:10.213.0.10"),
    ("CN only", 403, "no subjectAltName"),
    ("another slot", 403, "CN="),
    ("another slot in the SAN", 403, "DNS:" + ENS.slot(1)),
    ("an extra subject attribute", 403, "subject must be exactly"),
]


def hostile_csr(kind: str) -> str:
    if kind == "garbage PEM":
        return ("-----BEGIN CERTIFICATE REQUEST-----\nbm90IGEgY3Ny\n"
                "-----END CERTIFICATE REQUEST-----\n")
    if kind == "signed by another key":
        return spliced_csr()
    if kind == "ECDSA P-384":
        return csr_for(ec.generate_private_key(ec.SECP384R1()))
    if kind == "RSA 1024":
        return csr_for(rsa.generate_private_key(65537, 1024))
    if kind == "100 SANs":
        return csr_for(p256(), sans=[x509.DNSName(SLOT0)] + [
            x509.DNSName(f"x{i}.example") for i in range(99)])
    if kind == "an IP SAN":
        return csr_for(p256(), sans=[x509.DNSName(SLOT0),
                                     x509.IPAddress(ipaddress.ip_address("10.213.0.10"))])
    if kind == "CN only":
        return csr_for(p256(), sans=[])
    if kind == "another slot":
        return csr_for(p256(), cn=ENS.slot(1), sans=[x509.DNSName(ENS.slot(1))])
    if kind == "another slot in the SAN":
        return csr_for(p256(), sans=[x509.DNSName(ENS.slot(1))])
    if kind == "an extra subject attribute":
        key = p256()
        return x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, "evil"),
            x509.NameAttribute(NameOID.COMMON_NAME, SLOT0)])).add_extension(
            x509.SubjectAlternativeName([x509.DNSName(SLOT0)]), critical=False).sign(
            key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()
    raise AssertionError(kind)


async def test_hostile_csrs_get_their_exact_status_and_the_agent_survives(
        ca_state: ca_mod.CaState) -> None:
    config = CertConfig(rate=1000)
    async with serve(make_state(), ca_source=FixedCa(ca_state), cert_config=config) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        for kind, status, words in HOSTILE:
            r = await client.post(URL.format(0), json={"csr": hostile_csr(kind)}, headers=AUTH)
            assert r.status_code == status, (kind, r.text)
            assert words in r.json()["error"], (kind, r.json())
        r = await client.post(URL.format(0), content=b'{"csr":"' + b"Q" * (1 << 20) + b'"}',
                              headers=AUTH)
        assert r.status_code == 413
        rsa_ok = await client.post(URL.format(0), json={
            "csr": csr_for(rsa.generate_private_key(65537, 2048))}, headers=AUTH)
        assert rsa_ok.status_code == 200, rsa_ok.text
        assert (await client.get("/healthz")).status_code == 200
        assert reg.sample("imex_registry_certificates_issued_total",
                          namespace="gpu", ensemble="tls") == 1
        assert reg.sample("imex_registry_certificate_refusals_total", reason="wrong_name") == 6


async def test_rate_limit_per_member_counts_only_authenticated_requests(
        ca_state: ca_mod.CaState) -> None:
    async with serve(make_state(), ca_source=FixedCa(ca_state)) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        csr = {"csr": csr_for(p256())}
        for _ in range(30):  # a stranger without the token cannot use up the budget
            assert (await client.post(URL.format(0), json=csr)).status_code == 401
        codes = [(await client.post(URL.format(0), json=csr, headers=AUTH)).status_code
                 for _ in range(10)]
        assert codes == [200] * 10
        r = await client.post(URL.format(0), json=csr, headers=AUTH)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "more than 10 certificate requests in 60 s" in r.json()["error"]
        # a malformed CSR inside the budget is 422 and counts; over it, 429 comes first
        assert (await client.post(URL.format(0), json={"csr": "x"}, headers=AUTH)
                ).status_code == 429
        assert reg.sample("imex_registry_certificates_issued_total",
                          namespace="gpu", ensemble="tls") == 10


async def test_no_ca_yet_is_503_and_auth_off_is_409(ca_state: ca_mod.CaState) -> None:
    csr = {"csr": csr_for(p256())}
    async with serve(make_state(), ca_source=FixedCa(None)) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        r = await client.post(URL.format(0), json=csr, headers=AUTH)
        assert r.status_code == 503 and "does not exist yet" in r.json()["error"]
        assert r.headers["retry-after"] == "5"
    async with serve(make_state(auth=False), ca_source=FixedCa(ca_state)) as reg, \
            httpx.AsyncClient(base_url=reg.url) as client:
        r = await client.post(URL.format(0), json=csr, headers=AUTH)
        assert r.status_code == 409 and "does not use authEncryption" in r.json()["error"]
        assert (await client.post(URL.format(0), json=csr)).status_code == 401


def _ca_name(cert: x509.Certificate) -> str:
    return cert.subject.rfc4514_string()


async def test_a_rotation_signs_with_the_old_ca_then_the_new_with_both_trusted(
        ca_state: ca_mod.CaState, tmp_path: Path) -> None:
    now = dt.datetime.now(dt.UTC)
    trust = ca_mod.rotate(ca_state, ENS, "r1", now, dt.timedelta(hours=1))
    switch = ca_mod.advance(trust, now + dt.timedelta(minutes=30))
    leaves = {}
    for step, state in (("trust", trust), ("switch", switch)):
        async with serve(make_state(), ca_source=FixedCa(state)) as reg, \
                httpx.AsyncClient(base_url=reg.url) as client:
            r = await client.post(URL.format(0), json={"csr": csr_for(p256())}, headers=AUTH)
        assert r.status_code == 200, r.text
        leaves[step] = r.json()
        bundle = x509.load_pem_x509_certificates(r.json()["ca"].encode())
        assert [ca_mod.fingerprint(c) for c in bundle[:2]] == (
            [ca_state.sha256, trust.current.sha256] if step == "trust"
            else [trust.current.sha256, ca_state.sha256])
        assert ca_mod.verify_signed_by(bundle[2], ca_state.current.cert)
    old_leaf = x509.load_pem_x509_certificate(leaves["trust"]["certificate"].encode())
    new_leaf = x509.load_pem_x509_certificate(leaves["switch"]["certificate"].encode())
    assert old_leaf.issuer == ca_state.current.cert.subject
    assert new_leaf.issuer == trust.current.cert.subject
    if openssl is None:
        pytest.skip("the openssl CLI is not installed")
    # an old-CA leaf and a new-CA leaf both verify against either step's bundle
    for step in ("trust", "switch"):
        (tmp_path / f"{step}-bundle.pem").write_text(leaves[step]["ca"])
        for name, leaf in (("old", old_leaf), ("new", new_leaf)):
            (tmp_path / f"{name}.pem").write_text(ca_mod.cert_pem(leaf))
            out = run_openssl("verify", "-CAfile", str(tmp_path / f"{step}-bundle.pem"),
                              str(tmp_path / f"{name}.pem"))
            assert out.returncode == 0, (step, name, out)
    # and the old CA alone does not accept the new leaf
    (tmp_path / "old-ca.pem").write_text(ca_mod.cert_pem(ca_state.current.cert))
    out = run_openssl("verify", "-CAfile", str(tmp_path / "old-ca.pem"),
                      str(tmp_path / "new.pem"))
    assert out.returncode != 0


_ = Running  # the harness type, for readers of the fixtures above
