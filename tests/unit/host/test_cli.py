"""Flags, their environment mirrors and refusals (no agent started)."""

from __future__ import annotations

import io
import json
import logging
import socket
from pathlib import Path

import pytest

from host_agent.cli import build_settings, main
from host_agent.logs import setup_logging
from host_agent.settings import HostSettings, SettingsError, default_agent_namespace


def test_defaults() -> None:
    s = build_settings([], {})
    assert s == HostSettings(identity=socket.gethostname())
    assert s.agent_namespace == "imex-system"
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


def test_agent_namespace_and_identity(tmp_path: Path) -> None:
    s = build_settings([], {"IMEX_AGENT_NAMESPACE": "ops", "POD_NAME": "imex-host-agent-7d9-x2"})
    assert (s.agent_namespace, s.identity) == ("ops", "imex-host-agent-7d9-x2")
    assert s.user_agent.startswith("imex-host-agent/")
    assert s.user_agent.endswith(" (imex-host-agent-7d9-x2)")
    s = build_settings(["--agent-namespace", "kube-imex", "--identity", "r1"],
                       {"IMEX_AGENT_NAMESPACE": "ops", "POD_NAME": "p"})
    assert (s.agent_namespace, s.identity) == ("kube-imex", "r1")
    s = build_settings([], {"IMEX_HOST_AGENT_IDENTITY": "r2"})
    assert s.identity == "r2"
    sa = tmp_path / "namespace"
    sa.write_text("imex-prod\n")
    assert default_agent_namespace({}, sa) == "imex-prod"
    assert default_agent_namespace({"IMEX_AGENT_NAMESPACE": "x"}, sa) == "x"
    assert default_agent_namespace({}, tmp_path / "missing") == "imex-system"


@pytest.mark.parametrize(("argv", "needle"), [
    (["--agent-namespace", "Bad_NS"], "--agent-namespace"),
    (["--identity", "has space"], "--identity"),
    (["--identity", "x" * 129], "--identity"),
])
def test_bad_agent_namespace_or_identity(argv: list[str], needle: str) -> None:
    with pytest.raises(SettingsError, match=needle):
        build_settings(argv, {})


# -- the registry's HTTPS (docs/security.md) ---------------------------------------------


def test_tls_is_off_until_a_certificate_source_is_given() -> None:
    s = build_settings([], {})
    assert (s.tls_enabled, s.http_enabled, s.tls_listen_port) == (False, True, None)
    s = build_settings(["--tls-self-issued", "--tls-san", "10.0.0.9", "--tls-san",
                        "registry.example.org"], {})
    assert (s.tls_enabled, s.tls_listen_host, s.tls_listen_port) == (True, "0.0.0.0", 8443)
    assert s.tls_sans == ("10.0.0.9", "registry.example.org")
    assert s.tls_service == "imex-host-agent"


def test_tls_flags_have_environment_twins() -> None:
    env = {"IMEX_HOST_AGENT_TLS_LISTEN": "127.0.0.1:9443",
           "IMEX_HOST_AGENT_TLS_CERT_FILE": "/tls/tls.crt",
           "IMEX_HOST_AGENT_TLS_PRIVATE_KEY_FILE": "/tls/tls.key",
           "IMEX_HOST_AGENT_TLS_CA_FILE": "/tls/ca.crt",
           "IMEX_HOST_AGENT_LISTEN": ""}
    s = build_settings([], env)
    assert (s.tls_cert_file, s.tls_private_key_file, s.tls_ca_file) == (
        "/tls/tls.crt", "/tls/tls.key", "/tls/ca.crt")
    assert (s.tls_listen_host, s.tls_listen_port, s.http_enabled) == ("127.0.0.1", 9443, False)
    s = build_settings([], {"IMEX_HOST_AGENT_TLS_SELF_ISSUED": "true",
                            "IMEX_HOST_AGENT_TLS_SAN": "a.example, 10.1.2.3",
                            "IMEX_HOST_AGENT_TLS_SERVICE": "registry"})
    assert s.tls_self_issued and s.tls_sans == ("a.example", "10.1.2.3")
    assert s.tls_service == "registry"
    s = build_settings(["--tls-self-issued", "--tls-listen", ""], {})
    assert not s.tls_enabled  # HTTPS turned off explicitly


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--tls-cert-file", "/tls/tls.crt"], "--tls-private-key-file is missing"),
        (["--tls-private-key-file", "/k"], "--tls-cert-file is missing"),
        (["--tls-self-issued", "--tls-cert-file", "/c", "--tls-private-key-file", "/k"],
         "drop the other"),
        (["--tls-ca-file", "/ca"], "--tls-ca-file goes with --tls-cert-file"),
        (["--tls-cert-file", "tls.crt", "--tls-private-key-file", "/k"], "absolute path"),
        (["--tls-self-issued", "--tls-listen", "8443"], "--tls-listen '8443'"),
        (["--tls-self-issued", "--tls-san", "not a name!"], "--tls-san 'not a name!'"),
        (["--listen", ""], 'no plain HTTP needs HTTPS instead'),
        (["--listen", "", "--tls-self-issued", "--tls-listen", ""],
         'no plain HTTP needs HTTPS instead'),
    ],
)
def test_bad_tls_flags_name_the_problem(argv: list[str], fragment: str) -> None:
    with pytest.raises(SettingsError) as err:
        build_settings(argv, {})
    assert fragment in str(err.value)
