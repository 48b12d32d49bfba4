"""Gathers what the preflight checks judge (the I/O half of
:mod:`guest_agent.workload.preflight`), and the ``preflight`` command.

:func:`gather` runs the commands (``nvidia-smi -q``, ``nvidia-imex --version``,
``nvidia-imex-ctl -N -j``) with deadlines and output limits (``report.collect.run_bounded``),
reads IMEX's config, the reserved-ports sysctl and each ``nvidia-imex`` process's
cgroup (its systemd unit), asks the registry for the ensemble and DNS for the
ensemble's Service name. The commands and the network questions run concurrently, so a
pass takes about as long as its slowest part (bounded by the deadlines). Nothing here
raises for what it finds: a failure is a fact the checks judge.

The daemon runs :func:`run_preflight` at start (after its first apply, or 30 s without
one, spread over ``START_SPREAD`` seconds) and every ``PREFLIGHT_EVERY`` seconds (the
agent's preflight task) and reports the result; the command runs it once and prints it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import shutil
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any, Final

from guest_agent.config import Settings
from guest_agent.imex.channels import ChannelsState
from guest_agent.imex.channels_io import keep_channels
from guest_agent.report.collect import CommandFailed, run_bounded
from guest_agent.workload.preflight import (
    Check,
    Facts,
    ImexProcess,
    format_checks,
    run_checks,
    worst,
)
from imex_shared.imex_domain import DomainError
from imex_shared.model import EnsembleId

log = logging.getLogger("guest_agent.preflight")  # logger name pinned

#: the daemon re-runs the checks this often (seconds)
PREFLIGHT_EVERY: Final = 600.0
#: the daemon's first run starts up to this long after it could (seconds)
START_SPREAD: Final = 5.0
COMMAND_TIMEOUT: Final = 10.0
FILE_MAX: Final = 64 * 1024
RESERVED_PORTS: Final = "/proc/sys/net/ipv4/ip_local_reserved_ports"
IMEX_NAME: Final = "nvidia-imex"


async def _output(argv: list[str], timeout: float = COMMAND_TIMEOUT
                  ) -> tuple[str | None, str | None]:
    """(stdout as text, None) or (None, why); (None, None) when not installed."""
    try:
        out = await run_bounded(argv, timeout)
    except FileNotFoundError:
        return None, None
    except (CommandFailed, DomainError) as exc:
        return None, str(exc)
    return out.decode("utf-8", "replace"), None


def _read(path: str) -> tuple[str | None, str | None]:
    try:
        with open(path, "rb") as f:
            data = f.read(FILE_MAX + 1)
    except OSError as exc:
        return None, exc.strerror or str(exc)
    if len(data) > FILE_MAX:
        return None, f"over {FILE_MAX} bytes"
    return data.decode("utf-8", "replace"), None


def unit_of(cgroup_text: str) -> str:
    """The systemd unit a process's ``/proc/PID/cgroup`` names ("" when none): the last
    ``*.service`` (or ``*.scope``) component, from the unified or name=systemd line."""
    for line in cgroup_text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or parts[1] not in ("", "name=systemd"):
            continue
        for component in reversed(parts[2].split("/")):
            if component.endswith((".service", ".scope")):
                return component
    return ""


def imex_processes(proc: str = "/proc") -> list[ImexProcess]:
    """Every process whose argv[0] is ``nvidia-imex`` (any directory), with its unit."""
    out: list[ImexProcess] = []
    for name in os.listdir(proc):
        if not name.isdigit():
            continue
        try:
            with open(f"{proc}/{name}/cmdline", "rb") as f:
                argv0 = f.read(4096).split(b"\0", 1)[0]
            if os.path.basename(argv0.decode("utf-8", "replace")) != IMEX_NAME:
                continue
            with open(f"{proc}/{name}/cgroup", encoding="utf-8", errors="replace") as f:
                unit = unit_of(f.read(FILE_MAX))
        except OSError:
            continue  # gone meanwhile, or not ours to read
        out.append(ImexProcess(int(name), unit))
    return sorted(out, key=lambda p: p.pid)


def reported_version(doc: Mapping[str, Any] | None, own: int | None) -> str | None:
    """The version IMEX prints for node ``own`` (else the first node) in ``-N -j``."""
    nodes = doc.get("nodes") if isinstance(doc, Mapping) else None
    if not isinstance(nodes, Mapping) or not nodes:
        return None
    node = nodes.get(str(own)) if own is not None else None
    if not isinstance(node, Mapping):
        node = next(iter(nodes.values()))
    version = node.get("version") if isinstance(node, Mapping) else None
    return version if isinstance(version, str) else None


async def _registry(settings: Settings) -> tuple[bool, str] | None:
    if settings.registry_url is None:
        return None
    from guest_agent.peers.registry import RegistryError
    from guest_agent.peers.registry_io import RegistryClient
    from guest_agent.report.report_io import ReportError, read_token

    try:
        token = read_token(settings.token_file)
    except ReportError as exc:
        return False, f"token: {exc}"
    client = RegistryClient(settings, EnsembleId(settings.namespace, settings.ensemble),
                            token=token)
    try:
        snap = await asyncio.wait_for(client.fetch(), COMMAND_TIMEOUT)
    except (RegistryError, TimeoutError) as exc:
        return False, f"registry {settings.registry_url}: {exc or 'no answer'}"
    return True, (f"registry {settings.registry_url} answers (generation {snap.generation}, "
                  f"{len(snap.members)} member(s))")


async def _dns(settings: Settings) -> tuple[bool, str]:
    import dns.name
    import dns.rcode
    import dns.rdatatype

    from guest_agent.peers.dns_io import DnsClient

    ens = EnsembleId(settings.namespace, settings.ensemble)
    client = DnsClient(settings, ens)
    name = f"{settings.ensemble}.{settings.namespace}.svc.{settings.cluster_domain}."
    if not client.nameservers:
        return False, "no nameserver (none configured, none in /etc/resolv.conf)"
    answer = await client.query(dns.name.from_text(name), dns.rdatatype.A)
    if answer is None:
        servers = ", ".join(map(str, client.nameservers[:3]))
        return False, f"no answer for {name} from {servers}"
    return True, f"DNS answers for {settings.cluster_domain} ({name}: " \
        f"{dns.rcode.to_text(answer.rcode())})"


async def gather(settings: Settings, *, channels: ChannelsState | None = None,
                 managed_pid: int | None = None, domain: Mapping[str, Any] | None = None,
                 own_index: int | None = None, ask_ctl: bool = False) -> Facts:
    """Every fact the checks need (module docstring). ``channels``: the keeper's last
    state (None: look, without changing anything); ``domain``: the collector's last
    ``-N -j`` (``ask_ctl``: run the ctl for it)."""
    s = settings
    f = Facts(imex_path=s.imex_command[0], ctl_path=s.imex_ctl[0], managed_pid=managed_pid)

    async def ctl_view() -> Mapping[str, Any] | None:
        if not ask_ctl:
            return domain
        text, _ = await _output([*s.imex_ctl, "-N", "-j"], 5.0)
        try:
            doc = json.loads(text) if text else None
        except ValueError:
            return None
        return doc if isinstance(doc, Mapping) else None

    (smi, smi_err), (imex, imex_err), view, registry, dns_answer = await asyncio.gather(
        _output([*s.nvidia_smi, "-q"]), _output([s.imex_command[0], "--version"]),
        ctl_view(), _registry(s), _dns(s))
    f.smi, f.smi_error = smi, smi_err
    f.imex_version, f.imex_error = imex, imex_err
    ctl = s.imex_ctl[0]
    f.ctl_present = os.access(ctl, os.X_OK) if os.path.isabs(ctl) else shutil.which(ctl) \
        is not None
    f.reported_version = reported_version(view, own_index)
    f.imex_config, f.imex_config_error = _read(s.imex_config)
    try:
        f.processes = imex_processes()
    except OSError as exc:
        f.processes_error = exc.strerror or str(exc)
    f.channels = channels if channels is not None else keep_channels(
        s.imex_channels, s.channel_mode, s.imex_channel_group, act=False)
    text, why = _read(RESERVED_PORTS)
    f.reserved_ports, f.reserved_error = text, why
    f.registry, f.dns = registry, dns_answer
    return f


async def run_preflight(settings: Settings, **kwargs: Any) -> list[Check]:
    return run_checks(settings, await gather(settings, **kwargs))


async def preflight_loop(settings: Settings, facts: Callable[[], dict[str, Any]],
                         on_checks: Callable[[list[dict[str, str]]], None]) -> None:
    """The daemon's task: the checks now and every ``PREFLIGHT_EVERY`` seconds; each
    result that is not PASS is logged when it is news."""
    # a boot storm's guests do not all start their commands in the same second
    await asyncio.sleep(random.uniform(0.0, START_SPREAD))
    last: list[dict[str, str]] = []
    while True:
        checks = await run_preflight(settings, **facts())
        doc = [c.to_json() for c in checks]
        for c, entry in zip(checks, doc, strict=True):
            if c.result != "PASS" and entry not in last:
                log.warning("preflight %s %s: %s", c.name, c.result, c.message)
        last = doc
        on_checks(doc)
        await asyncio.sleep(PREFLIGHT_EVERY)


def cmd_preflight(settings: Settings, as_json: bool) -> int:
    """``imex-guest-agent preflight [--json]``: 0 when nothing FAILs, else 1."""
    from guest_agent import eventloop
    from guest_agent.report.status_file import StatusError, load_status

    managed, own = None, None
    try:
        status = load_status(settings.status_file)
        managed = status.get("imex_pid") if isinstance(status.get("imex_pid"), int) else None
        own = status.get("own_index") if isinstance(status.get("own_index"), int) else None
    except StatusError:
        pass
    started = time.monotonic()
    checks = eventloop.run(run_preflight(settings, managed_pid=managed, own_index=own,
                                         ask_ctl=True))
    took = time.monotonic() - started
    result = worst(checks)
    if as_json:
        json.dump({"result": result, "seconds": round(took, 3),
                   "checks": [c.to_json() for c in checks]}, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(format_checks(checks))
    return 1 if result == "FAIL" else 0
