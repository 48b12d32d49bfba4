"""KubeVirt's hook-sidecar messages, encoded and decoded by hand (no I/O).

virt-launcher talks to each hook sidecar in gRPC over a unix socket. The
messages are tiny protobuf (proto3) messages, so this module carries the few
wire rules they need instead of generated code or the protobuf runtime:

- ``kubevirt.hooks.info.Info/Info(InfoParams) -> InfoResult``; ``InfoParams``
  has no fields; ``InfoResult`` is ``name = 1`` (string), ``hookPoints = 3``
  (repeated ``HookPoint{name = 1 string, priority = 2 int32}``) and
  ``versions = 4`` (repeated string). Field 2 is unused.
- ``kubevirt.hooks.v1alpha2|v1alpha3.Callbacks``: ``OnDefineDomain`` (params
  ``domainXML = 1``, ``vmi = 2``; result ``domainXML = 1``), ``PreCloudInitIso``
  (params ``cloudInitNoCloudSource = 1``, ``vmi = 2``, ``cloudInitData = 3``;
  result fields 1 and 3), and in v1alpha3 ``Shutdown`` (empty both ways).
  Every payload field is ``bytes``.

Decoding follows proto3: unknown fields are skipped, the last occurrence of
a scalar field wins, a known field with the wrong wire type or a truncated
message is a ``ProtoError`` naming what is wrong. Encoding omits fields that
hold their default (empty string or bytes, zero), as proto3 encoders do.

The socket path's syntax rules and ``HookSidecarError`` live here too, not in
``hook_io``: the CLI checks ``--hook-socket`` and names the error without importing
grpc, the largest extension the agent would map (docs/benchmarks.md, "The host agent's
memory without grpc"), which an agent that is not a hook sidecar never needs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

#: The launcher's side: every hook socket is looked for under here.
HOOKS_DIR: Final = "/var/run/kubevirt-hooks"
#: Longest path a unix socket address holds (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH: Final = 107


class HookSidecarError(Exception):
    """The hook socket cannot be served (path unusable, or another server is live on it)."""


def check_socket_path(path: str) -> None:
    """Raise HookSidecarError unless ``path`` can name a unix socket (syntax only)."""
    if not os.path.isabs(path):
        raise HookSidecarError(f"hook socket {path!r}: must be an absolute path")
    if len(os.fsencode(path)) > MAX_SOCKET_PATH:
        raise HookSidecarError(
            f"hook socket {path!r}: longer than {MAX_SOCKET_PATH} bytes, "
            "too long for a unix socket")
    if path.endswith("/"):
        raise HookSidecarError(f"hook socket {path!r}: names a directory, not a socket file")


INFO_SERVICE: Final = "kubevirt.hooks.info.Info"
CALLBACKS_SERVICE: Final = "kubevirt.hooks.{version}.Callbacks"

V1ALPHA2: Final = "v1alpha2"
V1ALPHA3: Final = "v1alpha3"

ON_DEFINE_DOMAIN: Final = "OnDefineDomain"
PRE_CLOUD_INIT_ISO: Final = "PreCloudInitIso"
SHUTDOWN: Final = "Shutdown"

VARINT: Final = 0
I64: Final = 1
LEN: Final = 2
I32: Final = 5

_MAX_VARINT_BYTES: Final = 10
_U64: Final = 1 << 64


class ProtoError(ValueError):
    """A message that is not valid protobuf for the field it claims to be."""


# --- wire primitives ---------------------------------------------------------


def encode_varint(value: int) -> bytes:
    """Unsigned LEB128; negative int32/int64 values go as 64-bit two's complement."""
    if value < 0:
        value += _U64
    if not 0 <= value < _U64:
        raise ProtoError(f"varint {value} does not fit in 64 bits")
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    result = 0
    for i in range(_MAX_VARINT_BYTES):
        if pos + i >= len(data):
            raise ProtoError(f"truncated varint at byte {pos}")
        byte = data[pos + i]
        result |= (byte & 0x7F) << (7 * i)
        if not byte & 0x80:
            if result >= _U64:
                raise ProtoError(f"varint at byte {pos} exceeds 64 bits")
            return result, pos + i + 1
    raise ProtoError(f"varint at byte {pos} is longer than {_MAX_VARINT_BYTES} bytes")


def _key(field: int, wire_type: int) -> bytes:
    return encode_varint(field << 3 | wire_type)


def encode_len(field: int, payload: bytes) -> bytes:
    return _key(field, LEN) + encode_varint(len(payload)) + payload


def encode_uint(field: int, value: int) -> bytes:
    return _key(field, VARINT) + encode_varint(value)


def iter_fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) for each field: ints for VARINT/I64/I32, bytes for LEN."""
    pos = 0
    while pos < len(data):
        key, pos = _read_varint(data, pos)
        field, wire_type = key >> 3, key & 7
        if field == 0:
            raise ProtoError(f"field number 0 at byte {pos}")
        value: int | bytes
        if wire_type == VARINT:
            value, pos = _read_varint(data, pos)
        elif wire_type == LEN:
            size, pos = _read_varint(data, pos)
            if pos + size > len(data):
                raise ProtoError(f"field {field}: {size} bytes announced, {len(data) - pos} left")
            value, pos = data[pos:pos + size], pos + size
        elif wire_type in (I64, I32):
            width = 8 if wire_type == I64 else 4
            if pos + width > len(data):
                raise ProtoError(f"field {field}: truncated fixed{width * 8}")
            value, pos = int.from_bytes(data[pos:pos + width], "little"), pos + width
        else:
            raise ProtoError(f"field {field}: unsupported wire type {wire_type}")
        yield field, wire_type, value


def _want_bytes(name: str, field: int, wire_type: int, value: int | bytes) -> bytes:
    if wire_type != LEN or not isinstance(value, bytes):
        raise ProtoError(f"{name} (field {field}) has wire type {wire_type}, expected {LEN}")
    return value


def _want_str(name: str, field: int, wire_type: int, value: int | bytes) -> str:
    raw = _want_bytes(name, field, wire_type, value)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ProtoError(f"{name} (field {field}) is not valid UTF-8") from exc


def _want_int32(name: str, field: int, wire_type: int, value: int | bytes) -> int:
    if wire_type != VARINT or not isinstance(value, int):
        raise ProtoError(f"{name} (field {field}) has wire type {wire_type}, expected {VARINT}")
    value &= 0xFFFFFFFF  # int32 keeps the low 32 bits of the 64-bit varint
    return value - (1 << 32) if value >= 1 << 31 else value


def _bytes_fields(data: bytes, names: dict[int, str]) -> dict[int, bytes]:
    """Every known field of a message whose fields are all ``bytes``; missing ones are b""."""
    out = dict.fromkeys(names, b"")
    for field, wire_type, value in iter_fields(data):
        if field in names:
            out[field] = _want_bytes(names[field], field, wire_type, value)
    return out


# --- Info ----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class HookPoint:
    name: str
    priority: int = 0

    def encode(self) -> bytes:
        out = b""
        if self.name:
            out += encode_len(1, self.name.encode())
        if self.priority:
            out += encode_uint(2, self.priority)
        return out

    @classmethod
    def decode(cls, data: bytes) -> HookPoint:
        name, priority = "", 0
        for field, wire_type, value in iter_fields(data):
            if field == 1:
                name = _want_str("HookPoint.name", field, wire_type, value)
            elif field == 2:
                priority = _want_int32("HookPoint.priority", field, wire_type, value)
        return cls(name, priority)


@dataclass(frozen=True, slots=True)
class InfoResult:
    name: str
    versions: tuple[str, ...]
    hook_points: tuple[HookPoint, ...] = ()

    def encode(self) -> bytes:
        out = encode_len(1, self.name.encode()) if self.name else b""
        for point in self.hook_points:
            out += encode_len(3, point.encode())
        for version in self.versions:
            out += encode_len(4, version.encode())
        return out

    @classmethod
    def decode(cls, data: bytes) -> InfoResult:
        name = ""
        versions: list[str] = []
        points: list[HookPoint] = []
        for field, wire_type, value in iter_fields(data):
            if field == 1:
                name = _want_str("InfoResult.name", field, wire_type, value)
            elif field == 3:
                points.append(HookPoint.decode(
                    _want_bytes("InfoResult.hookPoints", field, wire_type, value)))
            elif field == 4:
                versions.append(_want_str("InfoResult.versions", field, wire_type, value))
        return cls(name, tuple(versions), tuple(points))


def check_empty_message(data: bytes) -> None:
    """``InfoParams`` / ``ShutdownParams``: no fields of their own; unknown ones are skipped."""
    for _ in iter_fields(data):
        pass


# --- Callbacks (v1alpha2, v1alpha3) ----------------------------------------------


@dataclass(frozen=True, slots=True)
class OnDefineDomainParams:
    domain_xml: bytes
    vmi: bytes

    @classmethod
    def decode(cls, data: bytes) -> OnDefineDomainParams:
        f = _bytes_fields(data, {1: "OnDefineDomainParams.domainXML",
                                 2: "OnDefineDomainParams.vmi"})
        return cls(f[1], f[2])

    def encode(self) -> bytes:
        return _encode_bytes_fields({1: self.domain_xml, 2: self.vmi})


@dataclass(frozen=True, slots=True)
class OnDefineDomainResult:
    domain_xml: bytes

    def encode(self) -> bytes:
        return _encode_bytes_fields({1: self.domain_xml})

    @classmethod
    def decode(cls, data: bytes) -> OnDefineDomainResult:
        return cls(_bytes_fields(data, {1: "OnDefineDomainResult.domainXML"})[1])


@dataclass(frozen=True, slots=True)
class PreCloudInitIsoParams:
    cloud_init_no_cloud_source: bytes
    vmi: bytes
    cloud_init_data: bytes

    @classmethod
    def decode(cls, data: bytes) -> PreCloudInitIsoParams:
        f = _bytes_fields(data, {
            1: "PreCloudInitIsoParams.cloudInitNoCloudSource",
            2: "PreCloudInitIsoParams.vmi",
            3: "PreCloudInitIsoParams.cloudInitData",
        })
        return cls(f[1], f[2], f[3])

    def encode(self) -> bytes:
        return _encode_bytes_fields(
            {1: self.cloud_init_no_cloud_source, 2: self.vmi, 3: self.cloud_init_data})


@dataclass(frozen=True, slots=True)
class PreCloudInitIsoResult:
    cloud_init_no_cloud_source: bytes
    cloud_init_data: bytes

    def encode(self) -> bytes:
        return _encode_bytes_fields({1: self.cloud_init_no_cloud_source, 3: self.cloud_init_data})

    @classmethod
    def decode(cls, data: bytes) -> PreCloudInitIsoResult:
        f = _bytes_fields(data, {1: "PreCloudInitIsoResult.cloudInitNoCloudSource",
                                 3: "PreCloudInitIsoResult.cloudInitData"})
        return cls(f[1], f[3])


def _encode_bytes_fields(fields: dict[int, bytes]) -> bytes:
    return b"".join(encode_len(n, v) for n, v in sorted(fields.items()) if v)
