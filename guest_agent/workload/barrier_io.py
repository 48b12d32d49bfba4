"""The ``wait`` and ``members`` commands (the I/O half of :mod:`guest_agent.workload.barrier`).

``wait`` polls every ``--interval`` seconds (1 s) until the barrier holds (exit 0), the
deadline passes (exit 3, printing what is still missing: which members, which links),
or something waiting cannot fix happens (exit 1: a ctl printing garbage). Without
``nvidia-imex-ctl`` IMEX is not installed: exit 4, at once. Each change of what is
missing is one line on stderr, so a job unit's journal shows the barrier's progress.

Where the domain facts come from, each poll: the registry's ``GET .../domain`` (with the
ensemble token) when ``registry_url`` is set and it answers, else this VM's
``nvidia-imex-ctl -N -j`` with the members from the agent's status file. A ctl that
does not answer (IMEX down or starting) is "not yet", not an error.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
import time
from collections.abc import Mapping
from typing import Any, Literal
from urllib.parse import quote

from guest_agent import http
from guest_agent.config import Settings
from guest_agent.imex.channels_io import keep_channels
from guest_agent.report.collect import CommandFailed, run_bounded
from guest_agent.report.status_file import StatusError, load_status
from guest_agent.workload.barrier import (
    EXIT_ERROR,
    EXIT_NOT_APPLICABLE,
    EXIT_READY,
    EXIT_TIMEOUT,
    BarrierError,
    DomainFacts,
    Format,
    Verdict,
    from_local,
    from_registry,
    judge_domain,
    judge_local,
    member_facts,
    render_members,
)
from imex_shared.imex_domain import DomainError

CTL_TIMEOUT = 5.0
REGISTRY_TIMEOUT = 5.0


def _say(text: str) -> None:
    print(f"imex-guest-agent wait: {text}", file=sys.stderr, flush=True)


def ctl_installed(settings: Settings) -> bool:
    ctl = settings.imex_ctl[0]
    if os.path.isabs(ctl):
        return os.access(ctl, os.X_OK)
    return shutil.which(ctl) is not None


def _status(settings: Settings) -> Mapping[str, Any]:
    try:
        return load_status(settings.status_file)
    except StatusError:
        return {}


def _own(status: Mapping[str, Any]) -> tuple[int | None, str | None, list[Mapping[str, Any]]]:
    own = status.get("own_index")
    clique = status.get("clique")
    members = [m for m in status.get("members") or () if isinstance(m, Mapping)]
    return (own if isinstance(own, int) and not isinstance(own, bool) else None,
            clique if isinstance(clique, str) else None, members)


async def _ctl(settings: Settings, *args: str) -> bytes | None:
    """The ctl's output; None when it did not answer (IMEX down or starting)."""
    try:
        return await run_bounded([*settings.imex_ctl, *args], CTL_TIMEOUT)
    except (CommandFailed, DomainError):
        return None


async def _registry_domain(settings: Settings, token: str | None) -> object | None:
    if settings.registry_url is None:
        return None
    url = (f"{settings.registry_url}/v1/ensembles/{quote(settings.namespace, safe='')}/"
           f"{quote(settings.ensemble, safe='')}/domain")
    try:
        resp = await http.request("GET", url, token=token, connect_timeout=2.0,
                                  read_timeout=REGISTRY_TIMEOUT)
        if resp.status != 200:
            return None
        return resp.json()
    except http.HttpError:
        return None


async def domain_facts(settings: Settings, token: str | None) -> DomainFacts | None:
    """This poll's facts (module docstring); None when nothing answered."""
    own, clique, members = _own(_status(settings))
    doc = await _registry_domain(settings, token)
    if doc is not None:
        try:
            return from_registry(doc, own, clique)
        except BarrierError as exc:  # a registry answering nonsense: ask IMEX instead
            _say(f"ignoring the registry's answer: {exc}")
    out = await _ctl(settings, "-N", "-j")
    if out is None:
        return None
    try:
        parsed = json.loads(out)
    except ValueError as exc:
        raise BarrierError(f"nvidia-imex-ctl -N -j printed something that is not JSON: "
                           f"{exc}") from exc
    return from_local(parsed, members, own, clique)


async def _local_verdict(settings: Settings) -> Verdict:
    out = await _ctl(settings, "-q")
    if out is None:
        return Verdict(False, ("IMEX does not answer nvidia-imex-ctl -q",))
    present = keep_channels(settings.imex_channels, settings.channel_mode,
                            settings.imex_channel_group, act=False).present
    return judge_local(out.decode("utf-8", "replace"), settings.imex_channels, present)


async def wait_for(settings: Settings, target: Literal["local", "domain"], timeout: float,
                   min_members: int, interval: float = 1.0) -> int:
    """The ``wait`` command's loop; returns its exit code (module docstring)."""
    if not ctl_installed(settings):
        _say(f"not applicable: IMEX is not installed ({settings.imex_ctl[0]} not found)")
        return EXIT_NOT_APPLICABLE
    token = None
    if settings.token_file is not None:
        from guest_agent.report.report_io import ReportError, read_token

        try:
            token = read_token(settings.token_file)
        except ReportError as exc:
            _say(f"registry requests without a token: {exc}")
    deadline = time.monotonic() + timeout
    said = ""
    while True:
        try:
            if target == "local":
                verdict = await _local_verdict(settings)
                source = "local"
            else:
                facts = await domain_facts(settings, token)
                verdict = judge_domain(facts, min_members) if facts is not None else \
                    Verdict(False, ("neither the registry nor nvidia-imex-ctl -N -j answers",))
                source = facts.source if facts is not None else "nothing"
        except BarrierError as exc:
            _say(f"error: {exc}")
            return EXIT_ERROR
        if verdict.ready:
            print(f"ready: {target} ({source})", flush=True)
            return EXIT_READY
        text = f"waiting for {target} ({source}): {verdict.text()}"
        if text != said:
            _say(text)
            said = text
        left = deadline - time.monotonic()
        if left <= 0:
            print(f"timed out after {timeout:g} s: still missing: {verdict.text()}",
                  flush=True)
            return EXIT_TIMEOUT
        await asyncio.sleep(min(interval, left))


def cmd_members(settings: Settings, fmt: Format, addresses: bool, slots: int) -> int:
    """``members``: from the agent's status file (the members it applied)."""
    try:
        status = load_status(settings.status_file)
    except StatusError as exc:
        print(f"imex-guest-agent: error: {exc}", file=sys.stderr)
        return EXIT_ERROR
    own, clique, members = _own(status)
    facts = member_facts(members)
    facts.own, facts.own_clique = own, clique
    if not facts.members:
        print("imex-guest-agent: error: the agent has applied no members yet",
              file=sys.stderr)
        return EXIT_ERROR
    sys.stdout.write(render_members(facts, fmt, addresses, slots))
    return 0
