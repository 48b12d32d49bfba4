"""Certificate requests as arbitrary DER or PEM (issue 30): random bytes armoured or not,
bit flips of a real CSR, and well-signed CSRs with subjects and subjectAltNames of every
shape.

Properties: ``load_csr`` returns a CSR or raises CsrError ("the CSR..."; 422);
``check_csr_names`` passes or raises CsrNameError naming the subject or the
subjectAltName (403); what passes both is issued a certificate for exactly the slot.
"""

from __future__ import annotations

import base64
import datetime as dt
import ipaddress

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from hypothesis import example, given
from hypothesis import strategies as st

from host_agent.ca.authority import (
    CsrError,
    CsrNameError,
    check_csr_names,
    issue_leaf,
    load_csr,
    new_ca,
)
from imex_shared.model import EnsembleId
from tests.fuzz.budget import count, fuzz

ENS = EnsembleId("gpu", "gb200")
SLOT = ENS.slot(1)
NOW = dt.datetime(2026, 12, 3, tzinfo=dt.UTC)
CA = new_ca(ENS, NOW)
KEY = ec.generate_private_key(ec.SECP256R1())
WEAK = ec.generate_private_key(ec.SECP384R1())

_attr = st.one_of(
    st.builds(lambda v: x509.NameAttribute(NameOID.COMMON_NAME, v),
              st.one_of(st.just(SLOT), st.just(ENS.slot(2)), st.text(min_size=1, max_size=20))),
    st.builds(lambda v: x509.NameAttribute(NameOID.ORGANIZATION_NAME, v),
              st.text(min_size=1, max_size=20)),
)
_general = st.one_of(
    st.just(x509.DNSName(SLOT)), st.builds(x509.DNSName, st.from_regex(r"[a-z0-9.-]{1,20}",
                                                                       fullmatch=True)),
    st.builds(x509.IPAddress, st.ip_addresses().map(lambda a: ipaddress.ip_address(str(a)))),
    st.builds(x509.RFC822Name, st.just("a@b.c")),
    st.builds(x509.UniformResourceIdentifier, st.just("spiffe://x/y")),
)


@st.composite
def signed_csr(draw: st.DrawFn) -> str:
    builder = x509.CertificateSigningRequestBuilder().subject_name(
        x509.Name(draw(st.lists(_attr, max_size=3))))
    if draw(st.booleans()):
        builder = builder.add_extension(
            x509.SubjectAlternativeName(draw(st.lists(_general, min_size=1, max_size=7))),
            critical=draw(st.booleans()))
    if draw(st.booleans()):
        builder = builder.add_extension(x509.BasicConstraints(ca=draw(st.booleans()),
                                                              path_length=None), critical=True)
    key = draw(st.sampled_from([KEY, KEY, WEAK]))
    return builder.sign(key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM).decode()


def _armour(der: bytes) -> str:
    body = base64.encodebytes(der).decode()
    return f"-----BEGIN CERTIFICATE REQUEST-----\n{body}-----END CERTIFICATE REQUEST-----\n"


GOOD_DER = x509.load_pem_x509_csr(
    x509.CertificateSigningRequestBuilder()
    .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SLOT)]))
    .add_extension(x509.SubjectAlternativeName([x509.DNSName(SLOT)]), critical=False)
    .sign(KEY, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
).public_bytes(serialization.Encoding.DER)


@st.composite
def flipped(draw: st.DrawFn) -> str:
    der = bytearray(GOOD_DER)
    for _ in range(draw(st.integers(1, 4))):
        der[draw(st.integers(0, len(der) - 1))] ^= 1 << draw(st.integers(0, 7))
    cut = draw(st.integers(1, len(der)))
    return _armour(bytes(der[:cut]))


_csr_text = st.one_of(
    signed_csr(), flipped(),
    st.binary(max_size=300).map(_armour),
    st.binary(max_size=300).map(lambda b: b.decode("latin-1")),  # DER with no armour
    st.just(GOOD_DER.decode("latin-1")),
    st.text(max_size=100),
)


@fuzz
@given(_csr_text)
@example(_armour(GOOD_DER))
@example(_armour(b"\x30\x03\x02\x01\x00"))
def test_any_csr_is_issued_or_refused_by_name(text: str) -> None:
    count("csr")
    try:
        csr = load_csr(text)
    except CsrError as exc:
        assert str(exc).startswith("the CSR"), exc
        return
    try:
        check_csr_names(csr, SLOT)
    except CsrNameError as exc:
        assert "subject" in str(exc) or "subjectAltName" in str(exc) \
            or "extensions" in str(exc), exc
        return
    leaf = issue_leaf(CA, csr, SLOT, NOW)
    san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert [n.value for n in san] == [SLOT]
    assert leaf.subject.rfc4514_string() == f"CN={SLOT}"
