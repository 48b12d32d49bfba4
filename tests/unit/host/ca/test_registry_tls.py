"""The registry's own TLS material (pure): names, renewal, the Secret and files."""

from __future__ import annotations

import datetime as dt
import hashlib
import ssl

import pytest
from cryptography import x509

from host_agent.ca import authority
from host_agent.ca import registry_tls as rt

T0 = dt.datetime(2027, 3, 1, 12, 0, tzinfo=dt.UTC)
NAMES = rt.service_names("imex-host-agent", "imex-system", ("10.96.0.40", "Registry.Example."))


def test_the_service_dns_names_then_the_extra_names_and_addresses() -> None:
    assert NAMES.dns == ("imex-host-agent", "imex-host-agent.imex-system",
                         "imex-host-agent.imex-system.svc",
                         "imex-host-agent.imex-system.svc.cluster.local", "registry.example")
    assert NAMES.ips == ("10.96.0.40",)


def test_the_serving_certificate_names_the_registry_and_chains_to_its_ca() -> None:
    tls = rt.first("imex-system", NAMES, T0, dt.timedelta(days=30))
    assert rt.cert_names(tls.cert) == NAMES
    assert authority.verify_signed_by(tls.cert, tls.ca.cert)
    eku = tls.cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    assert list(eku) == [x509.oid.ExtendedKeyUsageOID.SERVER_AUTH]
    assert tls.ca.cert.subject.rfc4514_string() == \
        "CN=imex-registry-ca imex-system,O=imex-ensemble"
    m = tls.material()
    # the pinned form: sha256 of the CA's DER, 64 lowercase hex, as caSHA256
    assert m.ca_sha256 == hashlib.sha256(ssl.PEM_cert_to_DER_cert(m.ca_pem or "")).hexdigest()
    assert m.chain_pem.count("BEGIN CERTIFICATE") == 2


def test_renewal_at_two_thirds_from_issue_or_when_the_names_change() -> None:
    tls = rt.first("imex-system", NAMES, T0, dt.timedelta(days=30))
    assert rt.renewal_due(tls, NAMES, T0 + dt.timedelta(days=19)) is None
    assert "two thirds" in str(rt.renewal_due(tls, NAMES, T0 + dt.timedelta(days=20, hours=1)))
    other = rt.service_names("imex-host-agent", "imex-system", ())
    assert "registry.example" in str(rt.renewal_due(tls, other, T0))
    renewed = rt.renew(tls, NAMES, T0 + dt.timedelta(days=21), dt.timedelta(days=30))
    assert renewed.ca == tls.ca and renewed.cert != tls.cert
    assert rt.renewal_due(renewed, NAMES, T0 + dt.timedelta(days=22)) is None


def test_a_short_lifetime_is_not_renewed_at_once_despite_the_backdated_start() -> None:
    tls = rt.first("imex-system", NAMES, T0, dt.timedelta(seconds=30))
    assert rt.renewal_due(tls, NAMES, T0 + dt.timedelta(seconds=5)) is None
    assert rt.renewal_due(tls, NAMES, T0 + dt.timedelta(seconds=21)) is not None


def test_the_secret_round_trips_and_a_broken_one_says_why() -> None:
    tls = rt.first("imex-system", NAMES, T0)
    body = rt.secret_body(tls, "imex-system", "41")
    assert body["type"] == "kubernetes.io/tls"
    assert set(body["data"]) == {"ca.crt", "ca.key", "tls.crt", "tls.key"}  # type: ignore[arg-type]
    back = rt.parse(body, T0)
    assert back.ca.sha256 == tls.ca.sha256 and back.cert == tls.cert
    broken = {**body, "data": {**body["data"], "tls.key": body["data"]["ca.key"]}}  # type: ignore[dict-item]
    with pytest.raises(rt.RegistryTlsError, match=r"tls\.key is not the key of tls\.crt"):
        rt.parse(broken, T0)
    with pytest.raises(rt.RegistryTlsError, match="missing"):
        rt.parse({**body, "data": {"ca.crt": body["data"]["ca.crt"]}}, T0)  # type: ignore[index]


def test_files_expired_or_mismatched_are_refused_by_name() -> None:
    tls = rt.first("x", NAMES, T0, dt.timedelta(days=1))
    chain = authority.cert_pem(tls.cert).encode()
    key = authority._key_pem(tls.key).encode()
    ok = rt.material_from_files(chain, key, None, T0 + dt.timedelta(hours=1), "what")
    assert ok.ca_sha256 is None  # no CA given, none in the chain
    with_ca = rt.material_from_files(chain + authority.cert_pem(tls.ca.cert).encode(), key,
                                     None, T0, "what")
    assert with_ca.ca_sha256 == tls.ca.sha256  # the chain's self-signed root
    with pytest.raises(rt.RegistryTlsError, match="not now"):
        rt.material_from_files(chain, key, None, T0 + dt.timedelta(days=2), "what")
    other = authority._key_pem(rt.first("y", NAMES, T0).key).encode()
    with pytest.raises(rt.RegistryTlsError, match="the key is not the certificate's"):
        rt.material_from_files(chain, other, None, T0, "what")
