"""KubeVirt's hook messages built with the protobuf runtime: an independent decoder.

The host agent encodes its few hook messages by hand (host_agent/sidecar/hook.py).
These classes are made from descriptors written here field by field after
KubeVirt's ``pkg/hooks/info/api_info.proto`` and
``pkg/hooks/v1alpha2|v1alpha3/api_*.proto`` (names, numbers, types, labels),
so the tests decode the agent's bytes with the reference protobuf
implementation instead of with the code under test.
"""

from __future__ import annotations

import functools
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

_F = descriptor_pb2.FieldDescriptorProto
STRING, BYTES, INT32, MESSAGE = _F.TYPE_STRING, _F.TYPE_BYTES, _F.TYPE_INT32, _F.TYPE_MESSAGE
OPTIONAL, REPEATED = _F.LABEL_OPTIONAL, _F.LABEL_REPEATED

# message name -> [(field name, number, type, label, message type name or "")]
INFO: dict[str, list[tuple[str, int, int, int, str]]] = {
    "InfoParams": [],
    "InfoResult": [
        ("name", 1, STRING, OPTIONAL, ""),
        ("hookPoints", 3, MESSAGE, REPEATED, ".kubevirt.hooks.info.HookPoint"),
        ("versions", 4, STRING, REPEATED, ""),
    ],
    "HookPoint": [("name", 1, STRING, OPTIONAL, ""), ("priority", 2, INT32, OPTIONAL, "")],
}
CALLBACKS: dict[str, list[tuple[str, int, int, int, str]]] = {
    "OnDefineDomainParams": [
        ("domainXML", 1, BYTES, OPTIONAL, ""),
        ("vmi", 2, BYTES, OPTIONAL, ""),
    ],
    "OnDefineDomainResult": [("domainXML", 1, BYTES, OPTIONAL, "")],
    "PreCloudInitIsoParams": [
        ("cloudInitNoCloudSource", 1, BYTES, OPTIONAL, ""),
        ("vmi", 2, BYTES, OPTIONAL, ""),
        ("cloudInitData", 3, BYTES, OPTIONAL, ""),
    ],
    "PreCloudInitIsoResult": [
        ("cloudInitNoCloudSource", 1, BYTES, OPTIONAL, ""),
        ("cloudInitData", 3, BYTES, OPTIONAL, ""),
    ],
    "ShutdownParams": [],
    "ShutdownResult": [],
}


def _file(package: str, messages: dict[str, list[tuple[str, int, int, int, str]]]) -> Any:
    fdp = descriptor_pb2.FileDescriptorProto(
        name=package.replace(".", "_") + ".proto", package=package, syntax="proto3")
    for msg_name, fields in messages.items():
        msg = fdp.message_type.add(name=msg_name)
        for name, number, ftype, label, type_name in fields:
            field = msg.field.add(name=name, number=number, type=ftype, label=label)
            if type_name:
                field.type_name = type_name
    return fdp


@functools.cache
def _pool() -> descriptor_pool.DescriptorPool:
    pool = descriptor_pool.DescriptorPool()
    pool.Add(_file("kubevirt.hooks.info", INFO))
    for version in ("v1alpha2", "v1alpha3"):
        pool.Add(_file(f"kubevirt.hooks.{version}", CALLBACKS))
    return pool


def message(full_name: str) -> Any:
    """The generated class of e.g. ``kubevirt.hooks.info.InfoResult``."""
    return message_factory.GetMessageClass(_pool().FindMessageTypeByName(full_name))
