"""Flags, their environment mirrors and refusals (no agent started)."""

from __future__ import annotations

import io
import json
import logging

import pytest

from host_agent.cli import build_settings, main
from host_agent.logs import setup_logging
from host_agent.settings import HostSettings, SettingsError


def test_defaults() -> None:
    s = build_settings([], {})
    assert s == HostSettings()
    assert (s.listen_host, s.listen_port, s.namespaces, s.kubeconfig, s.vmi) == (
        "0.0.0.0", 8080, (), None, None)
    assert s.listen == "0.0.0.0:8080"


def test_flags() -> None:
    s = build_settings(
        ["--namespace", "a", "--namespace", "b", "--listen", "[::1]:9000", "--kubeconfig", "/k",
         "--json", "--log-level", "debug", "--trusted-proxy", "10.0.0.0/8",
         "--trusted-proxy", "fd00::/8", "--report-stale-after", "30"],
        {},
    )
    assert s.namespaces == ("a", "b")
    assert (s.listen_host, s.listen_port, s.listen) == ("::1", 9000, "[::1]:9000")
    assert (s.kubeconfig, s.json_logs, s.log_level) == ("/k", True, "DEBUG")
    assert s.trusted_proxies == ("10.0.0.0/8", "fd00::/8")
    assert s.report_stale_after == 30.0


def test_environment_mirrors_every_flag_and_flags_win() -> None:
    env = {
        "IMEX_HOST_AGENT_NAMESPACE": "a, b",
        "IMEX_HOST_AGENT_LISTEN": "127.0.0.1:81",
        "IMEX_HOST_AGENT_KUBECONFIG": "/env/k",
        "IMEX_HOST_AGENT_JSON": "true",
        "IMEX_HOST_AGENT_LOG_LEVEL": "warning",
        "IMEX_HOST_AGENT_TRUSTED_PROXY": "10.1.0.0/16,10.2.0.0/16",
        "IMEX_HOST_AGENT_REPORT_STALE_AFTER": "45",
    }
    s = build_settings([], env)
    assert s.namespaces == ("a", "b")
    assert (s.listen_host, s.listen_port, s.kubeconfig) == ("127.0.0.1", 81, "/env/k")
    assert (s.json_logs, s.log_level, s.report_stale_after) == (True, "WARNING", 45.0)
    assert s.trusted_proxies == ("10.1.0.0/16", "10.2.0.0/16")
    s = build_settings(["--namespace", "c", "--listen", "127.0.0.1:82"], env)
    assert (s.namespaces, s.listen_port) == (("c",), 82)


def test_sidecar_scope_takes_pod_namespace() -> None:
    s = build_settings(["--vmi", "gb200-3"], {"POD_NAMESPACE": "rack1"})
    assert (s.vmi, s.namespaces) == ("gb200-3", ("rack1",))
    s = build_settings([], {"IMEX_HOST_AGENT_VMI": "gb200-4", "POD_NAMESPACE": "rack1"})
    assert s.vmi == "gb200-4"


@pytest.mark.parametrize(
    ("argv", "env", "fragment"),
    [
        (["--vmi", "gb200-3"], {}, "set POD_NAMESPACE"),
        (["--vmi", "GB200_3"], {"POD_NAMESPACE": "x"}, "--vmi 'GB200_3' is not"),
        (["--vmi", "a", "--namespace", "x", "--namespace", "y"], {}, "exactly one namespace"),
        (["--namespace", "Bad_NS"], {}, "--namespace 'Bad_NS'"),
        (["--listen", "8080"], {}, "expected HOST:PORT"),
        (["--listen", "0.0.0.0:http"], {}, "port 'http'"),
        (["--listen", "[::1:80"], {}, "[IPv6]:PORT"),
        (["--log-level", "loud"], {}, "--log-level 'LOUD'"),
        (["--trusted-proxy", "10.0.0.0/33"], {}, "--trusted-proxy '10.0.0.0/33'"),
        (["--report-stale-after", "soon"], {}, "--report-stale-after 'soon'"),
        (["--report-stale-after", "-1"], {}, "must be positive"),
        ([], {"IMEX_HOST_AGENT_JSON": "maybe"}, "IMEX_HOST_AGENT_JSON='maybe'"),
    ],
)
def test_bad_values_name_the_flag(argv: list[str], env: dict[str, str], fragment: str) -> None:
    with pytest.raises(SettingsError) as err:
        build_settings(argv, env)
    assert fragment in str(err.value)


def test_main_exits_2_with_a_message(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--listen", "nope"]) == 2
    assert "imex-host-agent: --listen 'nope'" in capsys.readouterr().err


def test_json_and_text_logs_carry_extras() -> None:
    out = io.StringIO()
    handler = setup_logging("INFO", True, out)
    try:
        logging.getLogger("imex.host.test").warning(
            "VMI %s odd", "gb200-3", extra={"ensemble": "rack1/gb200"})
        doc = json.loads(out.getvalue().splitlines()[-1])
        assert doc["msg"] == "VMI gb200-3 odd"
        assert doc["ensemble"] == "rack1/gb200" and doc["level"] == "warning"
        out2 = io.StringIO()
        handler2 = setup_logging("INFO", False, out2)
        assert handler not in logging.getLogger().handlers  # replaced, not stacked
        logging.getLogger("imex.host.test").info("hello", extra={"ensemble": "a/b"})
        line = out2.getvalue().splitlines()[-1]
        assert line.endswith("INFO    imex.host.test: hello ensemble=a/b")
        handler = handler2
    finally:
        logging.getLogger().removeHandler(handler)
