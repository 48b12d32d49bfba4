"""The guest agent's TOML config as arbitrary text and as documents of known keys with
values of every type (issue 30).

Properties: ``load_settings`` returns Settings or raises ConfigError, never anything else;
the error starts with the file's path and, when the TOML parsed, names a key the file
holds (or the missing required one).
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from guest_agent.config import _CHECKS, ConfigError, Settings, load_settings
from tests.fuzz.budget import count, fuzz

_KEYS = sorted(_CHECKS)


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string (a lone surrogate: invalid TOML)
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    assert isinstance(value, dict)
    return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(v)}" for k, v in value.items()) + "}"


_scalar = st.one_of(st.booleans(), st.integers(-(2**64), 2**64), st.floats(),
                    st.text(max_size=30),
                    st.sampled_from(["gpu", "gb200", "names", "ips", "systemd", "10.0.0.53",
                                     "[fd00::53]:5353", "http://10.0.0.1:9000", "/etc/hosts",
                                     "a" * 64, "0" * 64, "auto", "local", "",
                                     "10.0.0.53:\u00b2", "[fd00::53]:\u0661\u0662"]))
_value = st.recursive(_scalar, lambda kids: st.one_of(
    st.lists(kids, max_size=3), st.dictionaries(st.sampled_from(["a", "b"]), kids, max_size=2)),
    max_leaves=5)
_doc = st.dictionaries(st.one_of(st.sampled_from(_KEYS), st.sampled_from(["x", "Ensemble"])),
                       _value, max_size=8)
_base = {"ensemble": "gb200", "namespace": "gpu"}


def _text(doc: dict[str, object]) -> str:
    return "".join(f"{json.dumps(k)} = {_toml_value(v)}\n" for k, v in doc.items())


@fuzz
@given(st.one_of(
    st.builds(lambda extra: _text({**_base, **extra}), _doc),
    st.builds(_text, _doc),
    st.text(max_size=200),
    st.builds(lambda t, cut: t[:cut], st.builds(lambda extra: _text({**_base, **extra}), _doc),
              st.integers(0, 200)),
))
@example('ensemble = "gb200"\nnamespace = "gpu"\nmax_members = 1e400\n')
@example('ensemble = "gb200"\nnamespace = "gpu"\npoll_interval = nan\n')
@example('ensemble = "gb200"\nnamespace = "gpu"\nnameservers = [{a = 1}]\n')
@example('ensemble = "gb200"\nnamespace = "gpu"\nnameservers = ["10.0.0.53:\u00b2"]\n')  # found
def test_any_config_loads_or_is_refused_naming_the_key(tmp_path_factory: pytest.TempPathFactory,
                                                       text: str) -> None:
    count("toml_config")
    path = Path(tmp_path_factory.mktemp("cfg")) / "config.toml"
    path.write_bytes(text.encode("utf-8", "surrogatepass"))
    try:
        settings = load_settings(path)
    except ConfigError as exc:
        message = str(exc)
        assert message.startswith(f"{path}: "), message
        try:
            raw = tomllib.loads(text)
        except (tomllib.TOMLDecodeError, UnicodeError):
            return
        named = [k for k in [*raw, "ensemble", "namespace"] if f"{k}:" in message
                 or f" {k} " in message or f"{k} (" in message or f"key(s) {k}" in message]
        assert named, message
        return
    assert isinstance(settings, Settings)
    assert settings.max_members > 0 and settings.ensemble and settings.namespace
    for name in ("poll_interval", "dns_timeout", "report_interval"):
        assert math.isfinite(getattr(settings, name)), name
