"""The bugs issue 30's fuzzing found, each kept as a plain test.

All one family: ``str.isdigit()`` is true for ``²`` (which ``int()`` refuses with
ValueError) and for Arabic-Indic and full-width digits (which ``int()`` reads as another
number). The fuzzers found it in nvidia-smi's CliqueId and in /etc/hosts slot names
(test_fuzz_imex_outputs.py, test_fuzz_hosts.py); every other ``isdigit()`` before an
``int()`` was then checked by hand and is covered here. ``imex_shared.model.is_decimal``
(ASCII digits only) replaces them.
"""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from guest_agent.config import ConfigError, settings_from_mapping
from guest_agent.http import HttpProtocolError, request
from guest_agent.workload.barrier import from_local
from host_agent.persist.reports import encode_report, reports_of
from host_agent.state.snapshot import GuestReport
from imex_shared.hostsfile import merge_hosts, read_block
from imex_shared.model import EnsembleId, index_from_name, is_decimal

ENS = EnsembleId("gpu", "gb200")
ODD = ["\u00b2", "\u0661", "\uff11", "1\u00b2"]


@pytest.mark.parametrize("digits", ODD)
def test_is_decimal_is_ascii_only(digits: str) -> None:
    assert digits.isdigit() and not is_decimal(digits)
    assert is_decimal("0123") and not is_decimal("") and not is_decimal(5)


@pytest.mark.parametrize("digits", ODD)
def test_a_hosts_line_naming_a_slot_with_odd_digits_is_foreign(digits: str) -> None:
    """Was ValueError in EnsembleId.slot_index: the guest could not write /etc/hosts."""
    line = f"10.0.0.9\t{ENS.slot(0)[:-1]}{digits}\n".encode()
    merged = merge_hosts(line, ENS, 2, {0: "10.0.0.2"})
    assert merged.startswith(line)
    assert read_block(merged, ENS) == {0: "10.0.0.2", 1: "127.0.0.2"}
    assert ENS.slot_index(ENS.slot(0)[:-1] + digits) is None
    assert index_from_name(f"gb200-{digits}") is None


@pytest.mark.parametrize("digits", ODD)
def test_a_nameserver_port_with_odd_digits_is_a_config_error(digits: str) -> None:
    """Was a ValueError past ConfigError (a traceback instead of the key's name), or, for
    Arabic-Indic digits, port 1."""
    with pytest.raises(ConfigError, match=r"nameservers.*bad port"):
        settings_from_mapping({"ensemble": "a", "namespace": "b",
                               "nameservers": [f"10.0.0.53:{digits}"]})


async def test_a_content_length_with_odd_digits_is_a_protocol_error() -> None:
    """A guard, not a bug: the client already turned this ValueError into a protocol
    error; it now refuses the header by name before int() sees it."""
    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write("HTTP/1.1 200 OK\r\nContent-Length: \u00b2\r\n\r\nxx".encode())
        await writer.drain()
        writer.close()

    server = await asyncio.start_server(answer, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(HttpProtocolError, match="Content-Length"):
            await request("GET", f"http://127.0.0.1:{port}/")
    finally:
        server.close()
        await server.wait_closed()


def test_a_local_domain_view_with_odd_peer_ids_skips_them() -> None:
    """Was a ValueError in the barrier reading the ctl's raw -N -j."""
    doc = {"nodes": {"0": {"status": "READY", "connections": {
        "\u00b2": {"status": "CONNECTED"}, "1": {"status": "CONNECTED"}}}}}
    facts = from_local(doc, [{"index": 0, "slot": "s0"}, {"index": 1, "slot": "s1"}], 0, None)
    assert facts.links == {(0, 1): "CONNECTED"}


def test_a_reports_configmap_key_with_odd_digits_is_skipped() -> None:
    """Was a ValueError reading the persisted reports (a hand-edited ConfigMap)."""
    report = encode_report(GuestReport(time.time(), "10.0.0.1", {"imex_state": "READY"}))
    obj = {"metadata": {"annotations": {}}, "data": {"\u00b2": report, "1": report}}
    _, reports = reports_of(obj)
    assert list(reports) == [1]
    json.dumps(obj)  # the object is plain JSON, as the API returns it
