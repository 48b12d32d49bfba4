"""host_agent.ca.authority: the CA profile, rotation's cross-signature, and the Secret round trip.

A Secret edited into anything else must give an error naming what is wrong, never a
new CA (that would split the domain).
"""

from __future__ import annotations

import base64
import datetime as dt

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID

from host_agent.ca import authority as ca
from host_agent.ca import secret as ca_secret
from imex_shared.model import EnsembleId
from tests.host_support.ca import end_overlap

ENS = EnsembleId("gpu", "gb200")
NOW = dt.datetime(2026, 12, 1, 12, 0, tzinfo=dt.UTC)


def secret(state: ca.CaState, **data: str) -> dict[str, object]:
    body = ca_secret.secret_data(state)
    body.update(data)
    return {"metadata": {"namespace": "imex-system", "name": ca_secret.secret_name(ENS),
                         "annotations": ca_secret.secret_annotations(state, ENS)}, "data": body}


def b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def test_secret_name_is_namespace_dot_name() -> None:
    assert ca_secret.secret_name(ENS) == "imex-ca-gpu.gb200"


def test_ca_profile() -> None:
    state = ca.first_state(ENS, NOW)
    cert = state.current.cert
    bc = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert bc.critical and bc.value.ca and bc.value.path_length == 0
    ku = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert ku.key_cert_sign and ku.crl_sign and not ku.digital_signature
    assert isinstance(state.current.key, ec.EllipticCurvePrivateKey)
    assert isinstance(state.current.key.curve, ec.SECP256R1)
    assert cert.not_valid_before_utc == NOW - dt.timedelta(minutes=5)
    assert state.sha256 == cert.fingerprint(hashes.SHA256()).hex()
    assert state.bundle() == (cert,)


def test_secret_round_trip_keeps_the_same_ca() -> None:
    state = ca.first_state(ENS, NOW)
    back = ca_secret.parse_secret(secret(state), NOW)
    assert back.sha256 == state.sha256 and back.rotation == ""
    rotated = ca.rotate(state, ENS, "r1", NOW, dt.timedelta(hours=1))
    back = ca_secret.parse_secret(secret(rotated), NOW)
    assert back.sha256 == rotated.sha256 and back.previous == state.current.cert
    assert back.cross == rotated.cross and back.rotation == "r1"
    assert back.overlap_until == NOW + dt.timedelta(hours=1)
    assert back.bundle_sha256() == rotated.bundle_sha256()


def test_rotation_cross_signs_with_the_old_key_and_the_overlap_ends() -> None:
    old = ca.first_state(ENS, NOW)
    new = ca.rotate(old, ENS, "evict gb200-3", NOW, dt.timedelta(minutes=10))
    assert new.current.sha256 != old.sha256 and new.current.cert.subject != old.current.cert.subject
    assert new.cross is not None
    assert ca.verify_signed_by(new.cross, old.current.cert)
    assert not ca.verify_signed_by(new.cross, new.current.cert)
    assert new.cross.public_key().public_numbers() == \
        new.current.cert.public_key().public_numbers()  # type: ignore[union-attr]
    assert new.cross.subject == new.current.cert.subject
    old_s, new_s = old.current.cert.subject, new.current.cert.subject
    # trust: the old CA still signs and comes first; everyone learns the new one
    assert new.step == "trust" and new.signer.cert == old.current.cert
    assert new.sha256 == old.sha256  # what new guests pin while the old CA signs
    assert [c.subject for c in new.bundle()] == [old_s, new_s, new_s]
    assert new.bundle_sha256() != old.bundle_sha256()
    assert ca.advance(new, NOW + dt.timedelta(minutes=4)) is new
    switch = ca.advance(new, NOW + dt.timedelta(minutes=5))
    # switch: the old key is gone, the new CA signs, the old one is still trusted
    assert switch.step == "switch" and switch.previous_key is None
    assert switch.signer.cert == new.current.cert and switch.sha256 == new.current.sha256
    assert [c.subject for c in switch.bundle()] == [new_s, old_s, new_s]
    assert ca.advance(switch, NOW + dt.timedelta(minutes=9)) is switch
    done = ca.advance(switch, NOW + dt.timedelta(minutes=10))
    assert done.bundle() == (new.current.cert,) and done.previous is None
    assert done.step == "steady"
    assert len({s.bundle_sha256() for s in (old, new, switch, done)}) == 4
    assert end_overlap(new, NOW + dt.timedelta(minutes=10)) == done


def test_the_trust_step_survives_the_secret_round_trip() -> None:
    new = ca.rotate(ca.first_state(ENS, NOW), ENS, "r1", NOW, dt.timedelta(hours=1))
    back = ca_secret.parse_secret(secret(new), NOW)
    assert back.step == "trust" and back.switch_at == NOW + dt.timedelta(minutes=30)
    assert back.signer.sha256 == new.signer.sha256
    switch = ca_secret.parse_secret(secret(ca.advance(new, NOW + dt.timedelta(minutes=30))), NOW)
    assert switch.step == "switch" and "previous.key" not in ca_secret.secret_data(switch)


def _other_key_pem() -> str:
    key = ec.generate_private_key(ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


@pytest.mark.parametrize(("edit", "words"), [
    ({"ca.crt": b64("garbage")}, "ca.crt is not a PEM certificate"),
    ({"ca.key": b64("garbage")}, "ca.key is not an unencrypted PEM private key"),
    ({"ca.crt": "!!not base64!!"}, "data['ca.crt'] is not base64"),
    ({"ca.key": "__other__"}, "ca.key is not the key of ca.crt"),
])
def test_garbage_secrets_are_errors_that_say_what_is_wrong(edit: dict[str, str],
                                                           words: str) -> None:
    state = ca.first_state(ENS, NOW)
    if edit.get("ca.key") == "__other__":
        edit = {"ca.key": b64(_other_key_pem())}
    with pytest.raises(ca_secret.CaSecretError) as err:
        ca_secret.parse_secret(secret(state, **edit), NOW)
    assert words in str(err.value)
    assert "Secret imex-system/imex-ca-gpu.gb200" in str(err.value)


def test_missing_keys_and_a_non_ca_certificate_are_refused() -> None:
    state = ca.first_state(ENS, NOW)
    obj = secret(state)
    del obj["data"]["ca.key"]  # type: ignore[attr-defined]
    with pytest.raises(ca_secret.CaSecretError, match=r"missing ca\.key"):
        ca_secret.parse_secret(obj, NOW)
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, ENS.slot(0))])).add_extension(
        x509.SubjectAlternativeName([x509.DNSName(ENS.slot(0))]), critical=False).sign(
        state.current.key, hashes.SHA256())
    leaf = ca.issue_leaf(state.current, csr, ENS.slot(0), NOW)  # a leaf with the CA's own key
    with pytest.raises(ca_secret.CaSecretError, match="not a CA certificate"):
        ca_secret.parse_secret(secret(state, **{"ca.crt": b64(ca.cert_pem(leaf))}), NOW)
    with pytest.raises(ca_secret.CaSecretError, match=r"not now; rotate"):
        ca_secret.parse_secret(secret(state), NOW + dt.timedelta(days=3651))


def test_a_cross_certificate_not_signed_by_previous_is_refused() -> None:
    old = ca.first_state(ENS, NOW)
    new = ca.rotate(old, ENS, "r1", NOW, dt.timedelta(hours=1))
    stranger = ca.first_state(EnsembleId("x", "y"), NOW)
    with pytest.raises(ca_secret.CaSecretError, match=r"cross\.crt is not"):
        ca_secret.parse_secret(secret(new, **{"previous.crt": b64(ca.cert_pem(
            stranger.current.cert))}), NOW)


def test_a_sites_own_rsa_ca_is_accepted_and_signs() -> None:
    key = rsa.generate_private_key(65537, 3072)
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "site root")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(7)
            .not_valid_before(NOW - dt.timedelta(days=1))
            .not_valid_after(NOW + dt.timedelta(days=30))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    obj = {"metadata": {"name": "imex-ca-gpu.gb200"}, "data": {
        "ca.crt": b64(cert.public_bytes(serialization.Encoding.PEM)),
        "ca.key": b64(key.private_bytes(serialization.Encoding.PEM,
                                        serialization.PrivateFormat.TraditionalOpenSSL,
                                        serialization.NoEncryption()))}}
    state = ca_secret.parse_secret(obj, NOW)
    leaf_key = ec.generate_private_key(ec.SECP256R1())
    csr = x509.CertificateSigningRequestBuilder().subject_name(x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, ENS.slot(1))])).sign(leaf_key, hashes.SHA256())
    leaf = ca.issue_leaf(state.current, csr, ENS.slot(1), NOW)
    assert ca.verify_signed_by(leaf, cert)
    # the leaf never outlives its CA
    assert leaf.not_valid_after_utc == NOW + dt.timedelta(days=7)
    short = ca.issue_leaf(state.current, csr, ENS.slot(1), NOW + dt.timedelta(days=27))
    assert short.not_valid_after_utc == cert.not_valid_after_utc
