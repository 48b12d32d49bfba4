"""Every preflight check's PASS, WARN and FAIL, from stand-in outputs.

``nvidia-smi -q`` text comes from tests/sandbox/nvidia_smi.py (the layout FACTS.md
describes: a Driver Version line, one Fabric section per GPU with State, Status,
CliqueId, ClusterUUID); ``nvidia-imex --version`` prints "IMEX version is: X" as the real
binary does; processes are (pid, unit) as preflight_io reads them from /proc.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guest_agent.config import Settings, settings_from_mapping
from guest_agent.imex.channels import ChannelsState
from guest_agent.workload.preflight import (
    MAX_MESSAGE,
    Check,
    Facts,
    ImexProcess,
    format_checks,
    run_checks,
    worst,
)
from guest_agent.workload.preflight_io import reported_version, unit_of
from tests.sandbox.nvidia_smi import render

UUID = "0f3c8a52-61d4-4e2b-9a57-3f1d2b6c9e10"
CONFIG = ("SERVER_PORT=50000\nIMEX_NODE_CONFIG_FILE=/etc/nvidia-imex/nodes_config.cfg\n"
          "IMEX_CMD_ENABLED=1\nIMEX_CMD_PORT=50005\n")


def settings(**extra: object) -> Settings:
    return settings_from_mapping({"ensemble": "e", "namespace": "ns", **extra})


def good(**change: object) -> Facts:
    f = Facts(smi=render(4, UUID, "7", "Completed"), imex_version="IMEX version is: 580.82.07\n",
              ctl_present=True, reported_version="580.82.07", imex_config=CONFIG,
              processes=[ImexProcess(10, "nvidia-imex.service")],
              channels=ChannelsState(configured=(0,), present=[0], major=234),
              reserved_ports="50000", registry=(True, "registry answers"),
              dns=(True, "DNS answers"))
    for k, v in change.items():
        setattr(f, k, v)
    return f


def check(name: str, s: Settings, f: Facts) -> Check:
    [c] = [c for c in run_checks(s, f) if c.name == name]
    assert len(c.message) <= MAX_MESSAGE and "\n" not in c.message
    return c


def test_a_healthy_vm_passes_everything() -> None:
    checks = run_checks(settings(), good())
    assert [c.name for c in checks] == [
        "driver_version", "imex_installed", "imex_ctl_installed", "imex_config", "second_imex",
        "imex_channels", "fabric", "reserved_port", "registry", "dns"]
    assert {c.result for c in checks} == {"PASS"}, format_checks(checks)
    assert worst(checks) == "PASS"
    assert format_checks(checks).endswith("10 checks: 0 FAIL, 0 WARN\n")


@pytest.mark.parametrize(("driver", "mode", "on_change", "result", "says"), [
    ("580.82.07", "names", "signal", "PASS", "driver 580.82.07 (mode names)"),
    ("570.158.01", "names", "signal", "WARN", "no SIGUSR1 re-resolution"),
    ("570.158.01", "names", "restart", "PASS", "the agent restarts IMEX on every change"),
    ("570.148.08", "names", "signal", "FAIL", "cannot read host names"),
    ("570.148.08", "ips", "signal", "PASS", "mode ips"),
    ("550.127.05", "names", "restart", "FAIL", "needs 570.158.01 or later"),
    ("580.82.07\x1b[31m FAKE PASS", "names", "signal", "WARN", "unrecognised driver version"),
    ("9" * 500, "names", "signal", "WARN", "unrecognised driver version"),
])
def test_driver_version_against_the_mode(driver: str, mode: str, on_change: str, result: str,
                                         says: str) -> None:
    s = settings(mode=mode, on_change=on_change)
    c = check("driver_version", s, good(smi=render(4, UUID, "7", "Completed", driver=driver)))
    assert c.result == result and says in c.message, c


def test_no_nvidia_smi_fails_with_the_fix() -> None:
    c = check("driver_version", settings(), good(smi=None))
    assert c.result == "FAIL" and "install the driver" in c.message
    c = check("driver_version", settings(), good(smi=None, smi_error="exited 9"))
    assert c.result == "FAIL" and "nvidia-smi -q failed (exited 9)" in c.message


@pytest.mark.parametrize(("out", "result", "says"), [
    ("IMEX version is: 580.82.07\n", "PASS", "/usr/bin/nvidia-imex 580.82.07"),
    ("IMEX version is: 570.172.08\n", "WARN", "install nvidia-imex-580"),
    ("IMEX version is: <script>alert(1)</script>\n", "WARN", "not \"IMEX version is: X\""),
    (None, "FAIL", "not found"),
])
def test_imex_installed(out: str | None, result: str, says: str) -> None:
    c = check("imex_installed", settings(), good(imex_version=out))
    assert c.result == result and says in c.message, c


def test_imex_ctl_installed() -> None:
    assert check("imex_ctl_installed", settings(), good(ctl_present=False)).result == "FAIL"
    c = check("imex_ctl_installed", settings(), good(reported_version="x" * 300))
    assert c.result == "WARN" and len(c.message) < 200


@pytest.mark.parametrize(("text", "result", "says"), [
    (CONFIG, "PASS", "SERVER_PORT 50000"),
    (CONFIG.replace("50000", "50001"), "FAIL", "SERVER_PORT is '50001', the agent's port is"),
    (CONFIG + "SERVER_PORT=50000\n", "FAIL", "SERVER_PORT given twice"),
    (CONFIG.replace("nodes_config.cfg", "other.cfg"), "FAIL", "IMEX_NODE_CONFIG_FILE is"),
    (CONFIG.replace("IMEX_CMD_ENABLED=1", "IMEX_CMD_ENABLED=0"), "FAIL", "IMEX_CMD_ENABLED"),
    (None, "FAIL", "cannot read /etc/nvidia-imex/config.cfg"),
])
def test_imex_config(text: str | None, result: str, says: str) -> None:
    c = check("imex_config", settings(), good(imex_config=text))
    assert c.result == result and says in c.message, c


def test_imex_config_and_the_ctl_argv_agree_on_the_command_port() -> None:
    s = settings(imex_ctl=["/usr/bin/nvidia-imex-ctl", "-i", "127.0.0.1", "50006"])
    c = check("imex_config", s, good())
    assert c.result == "FAIL" and "imex_ctl asks port '50006'" in c.message
    s = settings(imex_ctl=["/usr/bin/nvidia-imex-ctl", "-i", "127.0.0.1", "50005"])
    assert check("imex_config", s, good()).result == "PASS"
    s = settings(imex_config="/etc/imex/other.cfg")
    c = check("imex_config", s, good())
    assert c.result == "FAIL" and "add -c /etc/imex/other.cfg" in c.message


def test_a_second_imex_depends_on_who_controls_imex() -> None:
    two = [ImexProcess(10, "nvidia-imex.service"), ImexProcess(20, "imex-host.service")]
    c = check("second_imex", settings(), good(processes=two))
    assert c.result == "FAIL" and "pid 20 in imex-host.service" in c.message
    assert "systemctl disable --now imex-host.service" in c.message
    # process mode: the agent's own child is inside, a host unit's IMEX is outside
    s = settings(imex_control="process", imex_command=["/usr/bin/nvidia-imex"])
    c = check("second_imex", s, good(processes=two, managed_pid=20))
    assert c.result == "FAIL" and "nvidia-imex.service" in c.message
    assert check("second_imex", s, good(processes=two[1:], managed_pid=20)).result == "PASS"
    # none: one IMEX is expected
    s = settings(imex_control="none")
    assert check("second_imex", s, good(processes=two[:1])).result == "PASS"
    assert check("second_imex", s, good(processes=two)).result == "FAIL"
    assert check("second_imex", s, good(processes=None, processes_error="EACCES")).result \
        == "WARN"
    # many: four are named, the rest counted
    many = [ImexProcess(100 + i, "") for i in range(7)]
    c = check("second_imex", settings(), good(processes=many))
    assert "pid 103" in c.message and "pid 104" not in c.message
    assert "pid 103 and 3 more (only nvidia-imex.service" in c.message, c.message


def test_channels() -> None:
    s = settings()
    assert check("imex_channels", s, good()).result == "PASS"
    waiting = ChannelsState(configured=(0,), waiting="not registered")
    assert check("imex_channels", s, good(channels=waiting)).result == "WARN"
    broken = ChannelsState(configured=(0,), errors=["/dev/x is a regular file"])
    c = check("imex_channels", s, good(channels=broken))
    assert c.result == "FAIL" and "missing channel(s) 0" in c.message
    assert check("imex_channels", settings(imex_channels=[]), good()).result == "PASS"


@pytest.mark.parametrize(("state", "status", "clique", "result"), [
    ("Completed", "Success", "7", "PASS"),
    ("In Progress", "Success", "7", "WARN"),
    ("Completed", "Failure: NVLink timeout", "7", "FAIL"),
    ("Completed", "Success", "N/A", "FAIL"),
])
def test_fabric(state: str, status: str, clique: str, result: str) -> None:
    smi = render(4, UUID, clique, state, status)
    assert check("fabric", settings(), good(smi=smi)).result == result


def test_no_fabric_section_fails() -> None:
    assert check("fabric", settings(), good(smi="Driver Version : 580.82.07\n")).result == "FAIL"


def test_reserved_port_registry_and_dns() -> None:
    s = settings()
    assert check("reserved_port", s, good(reserved_ports="8080,49000-50010")).result == "PASS"
    assert check("reserved_port", s, good(reserved_ports="")).result == "WARN"
    assert check("registry", s, good(registry=None)).result == "PASS"
    assert check("registry", s, good(registry=(False, "HTTP 401"))).result == "FAIL"
    c = check("dns", s, good(dns=(False, "no answer")))
    assert c.result == "FAIL" and "cluster_domain 'cluster.local'" in c.message


def test_checks_are_json_and_at_most_32() -> None:
    f = good(extra=[Check(f"x{i}", "PASS", "m") for i in range(40)])
    checks = run_checks(settings(), f)
    assert len(checks) == 32
    assert json.loads(json.dumps([c.to_json() for c in checks]))[0]["name"] == "driver_version"


def test_unit_of_a_cgroup_and_the_reported_version(tmp_path: Path) -> None:
    assert unit_of("0::/system.slice/nvidia-imex.service\n") == "nvidia-imex.service"
    assert unit_of("12:pids:/x\n1:name=systemd:/system.slice/foo.service\n") == "foo.service"
    assert unit_of("0::/user.slice/user-0.slice/session-3.scope\n") == "session-3.scope"
    assert unit_of("0::/\n") == ""
    doc = {"nodes": {"0": {"version": "580.1"}, "1": {"version": "580.2"}}}
    assert reported_version(doc, 1) == "580.2" and reported_version(doc, None) == "580.1"
    assert reported_version(None, 0) is None
