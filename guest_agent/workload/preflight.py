"""Preflight checks: PASS, WARN or FAIL, each with the fix named (pure).

``run_checks(settings, facts)`` judges what :mod:`guest_agent.workload.preflight_io`
gathered; nothing here runs a command or reads a file, so every verdict is tested from
stand-in outputs. The checks (docs/guest-agent.md "Preflight"), in this order:

- ``driver_version``: ``nvidia-smi -q``'s "Driver Version" against the mode. Host names
  in the nodes file need 570.158.01 or later (FACTS.md "Driver-version floors"); SIGUSR1
  re-resolution needs r580, so below it the agent must restart IMEX on every change
  (``on_change = "restart"``), and this check says so.
- ``imex_installed``, ``imex_ctl_installed``: the two binaries the agent uses, with
  ``nvidia-imex --version`` ("IMEX version is: X") and the version IMEX reports in
  ``-N -j``; a branch other than the driver's is a WARN.
- ``imex_config``: IMEX's ``config.cfg`` points at the nodes file the agent writes, its
  ``SERVER_PORT`` is the agent's ``port``, the command service is on and the ctl the
  agent runs reaches it (``-i IP PORT`` or ``-c FILE`` in ``imex_ctl`` must agree); a key
  given twice is a FAIL (which one IMEX takes is not documented).
- ``second_imex``: no IMEX process outside the agent's control. With ``imex_control =
  "systemd"`` the agent drives ``imex_unit`` itself, so an ``nvidia-imex`` in any other
  unit is outside (a host-level ``nvidia-imex.service`` beside a renamed managed one: the
  DRA driver's issue 524); with ``"process"`` only the agent's own child is inside; with
  ``"none"`` one IMEX is expected and a second is outside.
- ``imex_channels``: the configured channel nodes exist (the channel keeper's state).
- ``fabric``: every GPU's Fabric section says State Completed, Status Success, with a
  CliqueId (In Progress: WARN, the fabric manager is not done yet).
- ``reserved_port``: IMEX's port is in ``net.ipv4.ip_local_reserved_ports``.
- ``registry``: the registry answers (when one is configured).
- ``dns``: the cluster DNS answers for the ensemble's zone.

Every message is at most 255 characters, and whatever came from outside (version
strings, file contents) is clipped and shown with ``repr``: a hostile string cannot
forge a line or a verdict.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, Literal

from guest_agent.config import Settings
from guest_agent.imex.channels import ChannelsState
from imex_shared.imex_domain import fabric_sections
from imex_shared.model import is_decimal

Result = Literal["PASS", "WARN", "FAIL"]
MAX_MESSAGE: Final = 255
MAX_CHECKS: Final = 32
#: FACTS.md "Driver-version floors"
NAMES_FLOOR: Final = (570, 158, 1)
SIGUSR1_BRANCH: Final = 580
DEFAULT_CTL_CONFIG: Final = "/etc/nvidia-imex/config.cfg"

_VERSION = re.compile(r"^(\d{1,4})\.(\d{1,4})(?:\.(\d{1,4}))?$", re.ASCII)


@dataclass(frozen=True, slots=True)
class Check:
    name: str
    result: Result
    message: str

    def to_json(self) -> dict[str, str]:
        return {"name": self.name, "result": self.result, "message": self.message}


def clip(text: str, limit: int = MAX_MESSAGE) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def shown(value: str, limit: int = 40) -> str:
    """An outside string, safe to put into a message: repr, clipped."""
    return repr(value[:limit] + ("…" if len(value) > limit else ""))


def _check(name: str, result: Result, message: str) -> Check:
    return Check(name, result, clip(" ".join(message.split())))


@dataclass(frozen=True, slots=True)
class ImexProcess:
    pid: int
    #: the systemd unit its cgroup names ("" when none)
    unit: str


@dataclass
class Facts:
    """What preflight_io gathered. ``None`` for a command: not installed."""

    smi: str | None = None
    smi_error: str | None = None
    imex_path: str = "/usr/bin/nvidia-imex"
    imex_version: str | None = None
    imex_error: str | None = None
    ctl_path: str = "/usr/bin/nvidia-imex-ctl"
    ctl_present: bool = False
    #: the version IMEX prints for this node in ``-N -j`` (the collector's last view)
    reported_version: str | None = None
    imex_config: str | None = None
    imex_config_error: str | None = None
    processes: list[ImexProcess] | None = None
    processes_error: str | None = None
    #: the agent's own IMEX child (imex_control = "process")
    managed_pid: int | None = None
    channels: ChannelsState | None = None
    reserved_ports: str | None = None
    reserved_error: str | None = None
    #: (answered, what was seen); None: no registry configured
    registry: tuple[bool, str] | None = None
    dns: tuple[bool, str] | None = None
    extra: list[Check] = field(default_factory=list)


def parse_version(text: str) -> tuple[int, ...] | None:
    m = _VERSION.match(text.strip())
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def smi_value(smi: str, key: str) -> str | None:
    """The first ``key : value`` of nvidia-smi -q (outside any GPU section)."""
    for line in smi.splitlines()[:200]:
        name, sep, value = line.partition(":")
        if sep and name.strip() == key:
            return value.strip()
    return None


def _driver(s: Settings, f: Facts) -> Check:
    name = "driver_version"
    if f.smi is None:
        if f.smi_error:
            return _check(name, "FAIL", f"nvidia-smi -q failed ({f.smi_error}): is the "
                          "nvidia module loaded? (nvidia-smi says why when run by hand)")
        return _check(name, "FAIL", "nvidia-smi not found: no NVIDIA driver tools in this "
                      "VM; install the driver (570.158.01 or later, r580 for SIGUSR1)")
    text = smi_value(f.smi, "Driver Version")
    if text is None:
        return _check(name, "WARN", "nvidia-smi -q printed no Driver Version line; cannot "
                      "check the driver against the mode")
    version = parse_version(text)
    if version is None:
        return _check(name, "WARN", f"unrecognised driver version {shown(text)}; cannot "
                      "check it against the mode")
    v = text.strip()  # checked by parse_version: digits and dots only
    if s.mode == "names" and version < NAMES_FLOOR:
        return _check(name, "FAIL", f"driver {v} cannot read host names in nodes_config "
                      "(needs 570.158.01 or later): upgrade the driver, or use mode = \"ips\"")
    if s.mode == "names" and version[0] < SIGUSR1_BRANCH:
        if s.on_change == "restart":
            return _check(name, "PASS", f"driver {v}: below r580 IMEX has no SIGUSR1 "
                          "re-resolution, so the agent restarts IMEX on every change "
                          "(on_change = \"restart\")")
        return _check(name, "WARN", f"driver {v} has no SIGUSR1 re-resolution (r580+): the "
                      "agent must restart IMEX on changes; set on_change = \"restart\" or "
                      "upgrade to r580")
    return _check(name, "PASS", f"driver {v} (mode {s.mode})")


def imex_version_of(text: str) -> str | None:
    """``nvidia-imex --version``: "IMEX version is: 570.148.08" -> "570.148.08"."""
    for line in text.splitlines()[:20]:
        _, sep, rest = line.partition("version is:")
        if sep:
            value = rest.strip()
            return value if parse_version(value) is not None else None
    return None


def _imex(f: Facts) -> Check:
    name = "imex_installed"
    if f.imex_version is None:
        why = f" ({f.imex_error})" if f.imex_error else ""
        return _check(name, "FAIL", f"{f.imex_path} not found{why}: install the nvidia-imex "
                      "package of the driver's branch")
    version = imex_version_of(f.imex_version)
    if version is None:
        return _check(name, "WARN", f"{f.imex_path} --version printed "
                      f"{shown(f.imex_version.strip())}, not \"IMEX version is: X\"")
    driver = smi_value(f.smi, "Driver Version") if f.smi else None
    dv = parse_version(driver) if driver else None
    iv = parse_version(version)
    if dv is not None and iv is not None and dv[0] != iv[0]:
        return _check(name, "WARN", f"nvidia-imex {version} is not of the driver's branch "
                      f"({'.'.join(map(str, dv))}): install nvidia-imex-{dv[0]}")
    return _check(name, "PASS", f"{f.imex_path} {version}")


def _ctl(f: Facts) -> Check:
    name = "imex_ctl_installed"
    if not f.ctl_present:
        return _check(name, "FAIL", f"{f.ctl_path} not found: the agent cannot ask IMEX its "
                      "state; install the nvidia-imex package")
    rv = f.reported_version
    if rv is not None and parse_version(rv) is None:
        return _check(name, "WARN", f"{f.ctl_path} present; IMEX reports version {shown(rv)}")
    return _check(name, "PASS", f"{f.ctl_path} present" + (
        f"; IMEX reports version {rv}" if rv else "; IMEX has not reported a version yet"))


def parse_config(text: str) -> tuple[dict[str, str], list[str]]:
    """IMEX's ``KEY=VALUE`` lines: (values, keys given more than once)."""
    values: dict[str, str] = {}
    twice: list[str] = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            continue
        key = key.strip()
        if key in values and key not in twice:
            twice.append(key)
        values[key] = value.strip()
    return values, twice


def _ctl_target(argv: Sequence[str]) -> tuple[str, str] | None:
    """What the ctl argv names: ("-i", port) or ("-c", path); None: the default file."""
    args = list(argv[1:])
    for i, a in enumerate(args):
        if a == "-i" and i + 2 < len(args):
            return "-i", args[i + 2]
        if a == "-c" and i + 1 < len(args):
            return "-c", args[i + 1]
    return None


def _config(s: Settings, f: Facts) -> Check:
    name = "imex_config"
    path = s.imex_config
    if f.imex_config is None:
        return _check(name, "FAIL", f"cannot read {path}"
                      f"{f' ({f.imex_config_error})' if f.imex_config_error else ''}: IMEX "
                      "has no config; reinstall nvidia-imex or rerun the cloud-init setup")
    values, twice = parse_config(f.imex_config)
    problems: list[str] = []
    if twice:
        problems.append(f"{', '.join(twice[:4])} given twice (keep one)")
    nodes = values.get("IMEX_NODE_CONFIG_FILE")
    if nodes != s.nodes_config:
        problems.append(f"IMEX_NODE_CONFIG_FILE is {shown(nodes or '')}, the agent writes "
                        f"{s.nodes_config}")
    port = values.get("SERVER_PORT")
    if port != str(s.port):
        problems.append(f"SERVER_PORT is {shown(port or '')}, the agent's port is {s.port}")
    if values.get("IMEX_CMD_ENABLED") != "1":
        problems.append("IMEX_CMD_ENABLED is not 1 (the agent asks IMEX through it)")
    cmd_port = values.get("IMEX_CMD_PORT", "")
    target = _ctl_target(s.imex_ctl)
    if target is not None and target[0] == "-i" and target[1] != cmd_port:
        problems.append(f"imex_ctl asks port {shown(target[1])}, IMEX_CMD_PORT is "
                        f"{shown(cmd_port)}")
    elif target is not None and target[0] == "-c" and target[1] != path:
        problems.append(f"imex_ctl reads {shown(target[1])}, not {path}")
    elif target is None and path != DEFAULT_CTL_CONFIG:
        problems.append(f"imex_ctl reads {DEFAULT_CTL_CONFIG} by default, not {path}: "
                        f"add -c {path}")
    if problems:
        return _check(name, "FAIL", f"{path}: " + "; ".join(problems))
    return _check(name, "PASS", f"{path}: nodes file {s.nodes_config}, SERVER_PORT {s.port}, "
                  f"IMEX_CMD_PORT {cmd_port or 'default'}")


def _second(s: Settings, f: Facts) -> Check:
    name = "second_imex"
    if f.processes is None:
        return _check(name, "WARN", f"cannot list processes ({f.processes_error or 'unknown'})")
    if s.imex_control == "systemd":
        outside = [p for p in f.processes if p.unit != s.imex_unit]
        inside = f"{s.imex_unit}, which the agent drives"
    elif s.imex_control == "process":
        outside = [p for p in f.processes if p.pid != f.managed_pid]
        inside = "the agent's own child"
    else:
        outside = sorted(f.processes, key=lambda p: p.pid)[1:]
        inside = "one IMEX (imex_control = \"none\")"
    if outside:
        named = ", ".join(f"pid {p.pid}" + (f" in {p.unit}" if p.unit else "")
                          for p in outside[:4])
        if len(outside) > 4:
            named += f" and {len(outside) - 4} more"
        units = sorted({p.unit for p in outside if p.unit})
        fix = (f"systemctl disable --now {' '.join(units)}" if units
               else "stop it and find what starts it")
        return _check(name, "FAIL", f"nvidia-imex outside the agent's control: {named} "
                      f"(only {inside} should run): {fix}")
    return _check(name, "PASS", f"{len(f.processes)} nvidia-imex process(es), all {inside}")


def _channels(s: Settings, f: Facts) -> Check:
    name = "imex_channels"
    c = f.channels
    if not s.imex_channels:
        return _check(name, "PASS", "off (imex_channels = [])")
    if c is None:
        return _check(name, "WARN", "the channel keeper has not run yet")
    if c.waiting:
        return _check(name, "WARN", f"{c.waiting}; the agent makes the nodes once it has")
    missing = [n for n in s.imex_channels if n not in c.present]
    if c.errors or missing:
        return _check(name, "FAIL", (f"missing channel(s) {', '.join(map(str, missing))}: "
                                     if missing else "") + "; ".join(c.errors))
    return _check(name, "PASS", f"channel(s) {', '.join(map(str, c.present))} present "
                  f"(major {c.major})")


def _fabric(f: Facts) -> Check:
    name = "fabric"
    if f.smi is None:
        return _check(name, "FAIL", "no nvidia-smi -q output (see driver_version): no "
                      "fabric state")
    sections = fabric_sections(f.smi)
    if not sections:
        return _check(name, "FAIL", "nvidia-smi -q shows no GPU Fabric section: no NVLink "
                      "fabric in this VM (GPUs passed through? driver loaded?)")
    for i, sec in enumerate(sections):
        state, status = sec.get("State", "N/A"), sec.get("Status", "N/A")
        clique = sec.get("CliqueId", "N/A")
        if state == "In Progress" or state == "Not Started":
            return _check(name, "WARN", f"GPU {i}: fabric State {state}: the fabric manager "
                          "has not finished registering the GPU; IMEX cannot work until then")
        if state != "Completed":
            return _check(name, "FAIL", f"GPU {i}: fabric State {shown(state)}, want Completed "
                          "(no NVLink fabric, or not supported)")
        if status != "Success":
            return _check(name, "FAIL", f"GPU {i}: fabric Status {shown(status)}, want Success: "
                          "check the fabric manager and the NVLink switch trays")
        if not is_decimal(clique):
            return _check(name, "FAIL", f"GPU {i}: CliqueId {shown(clique)} is not a clique id")
    return _check(name, "PASS", f"{len(sections)} GPU(s): Completed, Success, clique "
                  f"{sections[0].get('CliqueId')}")


def _reserved(s: Settings, f: Facts) -> Check:
    name = "reserved_port"
    if f.reserved_ports is None:
        return _check(name, "WARN", f"cannot read ip_local_reserved_ports ({f.reserved_error})")
    spans: list[tuple[int, int]] = []
    for part in f.reserved_ports.strip().split(","):
        lo, sep, hi = part.strip().partition("-")
        if is_decimal(lo) and (not sep or is_decimal(hi)):
            spans.append((int(lo), int(hi) if sep else int(lo)))
    if any(lo <= s.port <= hi for lo, hi in spans):
        return _check(name, "PASS", f"IMEX's port {s.port} is reserved")
    return _check(name, "WARN", f"IMEX's port {s.port} is not in net.ipv4."
                  "ip_local_reserved_ports: an outgoing connection can take it before IMEX "
                  "binds; set reserve_port = true (the default) or sysctl it")


def _registry(f: Facts) -> Check:
    if f.registry is None:
        return _check("registry", "PASS", "no registry_url: peers come from DNS only")
    ok, what = f.registry
    return _check("registry", "PASS" if ok else "FAIL",
                  what if ok else f"{what}: check registry_url, the token and the network")


def _dns(s: Settings, f: Facts) -> Check:
    if f.dns is None:
        return _check("dns", "WARN", "DNS not asked")
    ok, what = f.dns
    return _check("dns", "PASS" if ok else "FAIL",
                  what if ok else f"{what}: check nameservers (or resolv.conf) and that "
                  f"cluster_domain {s.cluster_domain!r} is the cluster's zone")


def run_checks(settings: Settings, facts: Facts) -> list[Check]:
    """Every check, in the module docstring's order (at most 32)."""
    s, f = settings, facts
    out = [_driver(s, f), _imex(f), _ctl(f), _config(s, f), _second(s, f), _channels(s, f),
           _fabric(f), _reserved(s, f), _registry(f), _dns(s, f), *f.extra]
    return out[:MAX_CHECKS]


def worst(checks: Sequence[Check]) -> Result:
    results = {c.result for c in checks}
    return "FAIL" if "FAIL" in results else "WARN" if "WARN" in results else "PASS"


def format_checks(checks: Sequence[Check]) -> str:
    width = max((len(c.name) for c in checks), default=0)
    lines = [f"{c.result:<4}  {c.name:<{width}}  {c.message}" for c in checks]
    fails = sum(c.result == "FAIL" for c in checks)
    warns = sum(c.result == "WARN" for c in checks)
    lines.append(f"{len(checks)} checks: {fails} FAIL, {warns} WARN")
    return "\n".join(lines) + "\n"
