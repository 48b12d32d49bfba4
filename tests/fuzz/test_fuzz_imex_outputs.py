"""``nvidia-imex-ctl -N -j`` and ``-q`` and ``nvidia-smi -q``'s Fabric sections as arbitrary
output (issue 30).

Properties: the parsers never raise anything but DomainError, whose message names the
part (the command, or the field path); what they accept is what the registry accepts
(the registry's own models), so nothing a guest forwards costs it a 422.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from guest_agent.imex.control import query_state
from host_agent.registry.domain_models import FabricIn, ImexDomainIn
from host_agent.registry.models import StatusReport
from imex_shared.imex_domain import (
    DomainError,
    DomainParser,
    own_row,
    parse_fabric,
    parse_imex_domain,
)
from tests.fuzz.budget import count, fuzz

N = 4
_json_leaf = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70),
                       st.floats(allow_nan=False), st.text(max_size=12),
                       st.sampled_from(["CONNECTED", "READY", "UP", "INVALID", "x"]))
_json = st.recursive(_json_leaf, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.text(max_size=8), kids, max_size=3)),
    max_leaves=12)
_id = st.one_of(st.integers(0, N + 1).map(str), st.sampled_from(["01", "-1", "x", " 1", "1.0"]))
_word = st.one_of(st.sampled_from(["CONNECTED", "DISCONNECTED", "NEVER_CONNECTED", "INVALID",
                                   "READY", "UP", "ready", "", "A" * 40]), _json_leaf)
_conn = st.fixed_dictionaries({}, optional={"status": _word, "host": _json, "changed": _json,
                                            "extra": _json})
_node = st.fixed_dictionaries({}, optional={
    "status": _word, "host": _json, "hostName": _json, "version": _json,
    "connections": st.one_of(st.dictionaries(_id, st.one_of(_conn, _json), max_size=4), _json)})
_doc = st.fixed_dictionaries({"nodes": st.one_of(
    st.dictionaries(_id, st.one_of(_node, _json), max_size=5), _json)},
    optional={"timestamp": _json, "status": _word})


def _named(exc: DomainError) -> None:
    text = str(exc)
    assert text.startswith(("imex_domain", "nvidia-imex-ctl -N -j", "nvidia-smi -q",
                            "fabric.")), text


@fuzz
@given(st.one_of(_doc.map(lambda d: json.dumps(d).encode()),
                 _json.map(lambda d: json.dumps(d).encode()),
                 st.binary(max_size=200),
                 _doc.map(lambda d: json.dumps(d).encode()[:-3])))  # truncated
@example(b'{"nodes": {"0": {"connections": {"1": {"status": "CONNECTED", "changed": false}}}}}')
@example(b'{"nodes": {"0": {"status": "READY", "connections": {"1": {"status": "CONNECTED",'
         b' "changed": "2026-12-02T10:00:00Z"}}}}}')
def test_imex_ctl_domain_output(output: bytes) -> None:
    count("imex_ctl_N_j")
    try:
        doc = parse_imex_domain(output, N)
    except DomainError as exc:
        _named(exc)
        return
    # what the guest forwards, the registry accepts: no field costs the member its report
    ImexDomainIn.model_validate_json(json.dumps(doc), strict=True)
    # and so does a registry from before issue 30, which requires each node's state word
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]{0,31}", n["status"]) for n in doc["nodes"].values())
    for key in doc["nodes"]:
        row = own_row(doc, int(key))
        assert row is not None and all(0 <= i < N for i in row)


def _outcome(parse: Callable[[bytes], Any], output: bytes) -> object:
    try:
        return parse(output)
    except DomainError as exc:
        return str(exc)


@fuzz
@given(st.lists(st.tuples(_doc, st.one_of(st.none(), _json)), min_size=1, max_size=4))
def test_the_collectors_parser_agrees_with_a_fresh_parse(prints: list[Any]) -> None:
    """Every print through one DomainParser (the guest's collector) gives what
    parse_imex_domain gives it, whatever came before; each print is sent twice, the
    second time with another ``timestamp``, which the parser answers from its kept
    clean of the nodes."""
    count("imex_ctl_N_j_parser")
    parser = DomainParser(N)
    for doc, stamp in prints:
        for version in (doc, {**doc, "timestamp": stamp}):
            output = json.dumps(version).encode()
            assert _outcome(parser.parse, output) == _outcome(
                lambda o: parse_imex_domain(o, N), output)


_fabric_line = st.one_of(
    st.sampled_from(["Fabric", "    Fabric", "        State                 : Completed",
                     "        State : In Progress", "        Status : Success",
                     "        ClusterUUID : 7c4b5e6a-1f2d-4e3c-9b8a-0d1e2f3a4b5c",
                     "        ClusterUUID : N/A", "        CliqueId : 32766",
                     "        CliqueId : N/A", "        CliqueId : \u00b2",
                     "        CliqueId : \u0661\u0662", "        CliqueId : 99999999999",
                     "        CliqueId : -1", "GPU 00000000:00:01.0", "    Fabric   ", ""]),
    st.builds(lambda k, v, d: " " * d + f"{k} : {v}", st.sampled_from(["ClusterUUID", "CliqueId",
              "State", "X"]), st.text(max_size=40), st.integers(0, 12)),
    st.text(max_size=30))


@fuzz
@given(st.one_of(st.lists(_fabric_line, max_size=12).map(lambda ls: "\n".join(ls).encode(
    "utf-8", "surrogatepass")), st.binary(max_size=200)))
@example("    Fabric\n        State : Completed\n        ClusterUUID : "
         "7c4b5e6a-1f2d-4e3c-9b8a-0d1e2f3a4b5c\n        CliqueId : \u00b2\n".encode())
def test_nvidia_smi_fabric_sections(output: bytes) -> None:
    count("nvidia_smi_q_fabric")
    try:
        fabric = parse_fabric(output)
    except DomainError as exc:
        _named(exc)
        return
    if fabric is not None:
        FabricIn.model_validate_json(json.dumps(fabric.to_json()), strict=True)


@pytest.fixture(scope="module")
def ctl(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Path]:
    """A real program printing the bytes of a file, as nvidia-imex-ctl -q prints its state."""
    root = tmp_path_factory.mktemp("ctl")
    out = root / "out"
    script = root / "nvidia-imex-ctl"
    script.write_text(f'#!/bin/sh\ncat "{out}"\n')
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return [str(script)], out


@fuzz
@given(st.one_of(st.binary(max_size=120), st.text(max_size=120).map(
    lambda t: t.encode("utf-8", "surrogatepass"))))
@example(b"READY\n")
@example(b"\xff\xfe" * 100)
@example(b" \n\n")
def test_imex_ctl_q_output(ctl: tuple[list[str], Path], output: bytes) -> None:
    count("imex_ctl_q")
    argv, out = ctl
    out.write_bytes(output)
    state = asyncio.run(query_state(argv, timeout=10.0))
    if state is None:
        return
    assert "\n" not in state and state == state.strip() and 0 < len(state) <= 64
    # the report that carries it is accepted (imex_state: 1..64 characters)
    StatusReport.model_validate({"imex_state": state})
    assert os.path.exists(out)


@pytest.mark.parametrize("clique", ["\u00b2", "\u0661\u0662", "\uff11"])
def test_regression_a_non_ascii_digit_clique_id_is_refused_by_name(clique: str) -> None:
    """Found by the fuzzer: ``"²".isdigit()`` is true but ``int("²")`` raises ValueError,
    which escaped the collector's DomainError handler; Arabic-Indic digits parsed as 12."""
    out = ("    Fabric\n        State : Completed\n        ClusterUUID : "
           f"7c4b5e6a-1f2d-4e3c-9b8a-0d1e2f3a4b5c\n        CliqueId : {clique}\n").encode()
    with pytest.raises(DomainError, match=r"CliqueId .* is not a number"):
        parse_fabric(out)
