"""The hand-written hook message codec against the protobuf runtime (both directions)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from host_agent.sidecar import hook as hp
from host_agent.sidecar.hook_io import HOOK_NAME, info_result
from tests.host_support.hook_oracle import message

InfoResultPB = message("kubevirt.hooks.info.InfoResult")
HookPointPB = message("kubevirt.hooks.info.HookPoint")
OnDefinePB = message("kubevirt.hooks.v1alpha3.OnDefineDomainParams")
OnDefineResultPB = message("kubevirt.hooks.v1alpha3.OnDefineDomainResult")
CloudInitPB = message("kubevirt.hooks.v1alpha3.PreCloudInitIsoParams")
CloudInitResultPB = message("kubevirt.hooks.v1alpha3.PreCloudInitIsoResult")

text = st.text(max_size=40)
int32 = st.integers(-(2**31), 2**31 - 1)
points = st.lists(st.builds(hp.HookPoint, text, int32), max_size=4).map(tuple)
results = st.builds(hp.InfoResult, text, st.lists(text, max_size=4).map(tuple), points)


def test_the_agents_answer_decodes_with_the_reference_runtime() -> None:
    pb = InfoResultPB.FromString(info_result().encode())
    assert pb.name == HOOK_NAME
    assert list(pb.versions) == ["v1alpha3", "v1alpha2"]
    assert [(p.name, p.priority) for p in pb.hookPoints] == [("Shutdown", 0)]


@given(results)
def test_info_result_encodes_like_the_runtime(result: hp.InfoResult) -> None:
    pb = InfoResultPB.FromString(result.encode())
    assert pb.name == result.name
    assert tuple(pb.versions) == result.versions
    assert tuple((p.name, p.priority) for p in pb.hookPoints) == tuple(
        (p.name, p.priority) for p in result.hook_points)
    # Same field order and default omission as the runtime: byte-identical.
    assert pb.SerializeToString(deterministic=True) == result.encode()


@given(results)
def test_info_result_decodes_what_the_runtime_encodes(result: hp.InfoResult) -> None:
    pb = InfoResultPB(name=result.name, versions=list(result.versions),
                      hookPoints=[HookPointPB(name=p.name, priority=p.priority)
                                  for p in result.hook_points])
    assert hp.InfoResult.decode(pb.SerializeToString()) == result


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_on_define_domain_both_ways(xml: bytes, vmi: bytes) -> None:
    raw = OnDefinePB(domainXML=xml, vmi=vmi).SerializeToString()
    assert hp.OnDefineDomainParams.decode(raw) == hp.OnDefineDomainParams(xml, vmi)
    assert hp.OnDefineDomainParams(xml, vmi).encode() == raw
    assert OnDefineResultPB.FromString(hp.OnDefineDomainResult(xml).encode()).domainXML == xml


@given(st.binary(max_size=64), st.binary(max_size=64), st.binary(max_size=64))
def test_pre_cloud_init_iso_both_ways(nocloud: bytes, vmi: bytes, data: bytes) -> None:
    raw = CloudInitPB(cloudInitNoCloudSource=nocloud, vmi=vmi, cloudInitData=data)
    decoded = hp.PreCloudInitIsoParams.decode(raw.SerializeToString())
    assert decoded == hp.PreCloudInitIsoParams(nocloud, vmi, data)
    out = CloudInitResultPB.FromString(hp.PreCloudInitIsoResult(nocloud, data).encode())
    assert (out.cloudInitNoCloudSource, out.cloudInitData) == (nocloud, data)


def test_unknown_fields_are_skipped_and_the_last_scalar_wins() -> None:
    extra = (hp.encode_uint(9, 300) + hp.encode_len(10, b"zz")
             + hp.encode_varint(15 << 3 | hp.I32) + b"\x01\x02\x03\x04"
             + hp.encode_varint(16 << 3 | hp.I64) + bytes(8))
    raw = hp.encode_len(1, b"first") + extra + hp.encode_len(1, b"second") + hp.encode_len(2, b"v")
    assert hp.OnDefineDomainParams.decode(raw) == hp.OnDefineDomainParams(b"second", b"v")
    hp.check_empty_message(extra)  # InfoParams with fields from a newer launcher: accepted


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"\x0a\x05ab", "5 bytes announced, 2 left"),
        (b"\x08", "truncated varint"),
        (b"\x08" + b"\xff" * 10 + b"\x01", "longer than 10 bytes"),
        (b"\x0b", "unsupported wire type 3"),  # start group
        (b"\x00\x00", "field number 0"),
        (b"\x08\x01", r"OnDefineDomainParams.domainXML \(field 1\) has wire type 0, expected 2"),
        (b"\x0d\x00\x00", "truncated fixed32"),
    ],
)
def test_malformed_messages_name_the_problem(raw: bytes, reason: str) -> None:
    with pytest.raises(hp.ProtoError, match=reason):
        hp.OnDefineDomainParams.decode(raw)


def test_invalid_utf8_string_is_refused() -> None:
    with pytest.raises(hp.ProtoError, match=r"InfoResult.name \(field 1\) is not valid UTF-8"):
        hp.InfoResult.decode(hp.encode_len(1, b"\xff\xfe"))


def test_negative_priority_and_varint_limits() -> None:
    point = hp.HookPoint("OnDefineDomain", -5)
    assert point.encode() == HookPointPB(name="OnDefineDomain", priority=-5).SerializeToString()
    assert hp.HookPoint.decode(point.encode()) == point
    assert hp.encode_varint(2**64 - 1) == b"\xff" * 9 + b"\x01"
    with pytest.raises(hp.ProtoError, match="does not fit in 64 bits"):
        hp.encode_varint(2**64)
