"""The agent's commands: ``run``, ``once``, ``status``, ``preflight``, ``wait`` and
``members`` (``render`` and ``cloudinit`` are cli.py's; the workload's three live in
guest_agent/workload).

``run`` is the daemon (:class:`guest_agent.agent.Agent`) until SIGTERM or SIGINT;
``once`` is one discover-and-apply pass that never touches IMEX (exit 3 when nothing
could be learned); ``status`` prints the status file the daemon writes. The daemon's
modules are imported only by ``run`` and ``once``, so ``status`` needs nothing but the
standard library.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

from guest_agent import eventloop
from guest_agent.config import Settings
from guest_agent.daemon import EXIT_FAILED, EXIT_NOTHING_LEARNED, EXIT_OK, setup_logging
from guest_agent.files.apply import ApplyError
from guest_agent.pins.merge import learn, plan_pins
from guest_agent.report.status_file import (
    StatusError,
    format_table,
    load_status,
    prometheus_text,
)

log = logging.getLogger("guest_agent")  # logger name pinned


async def run_once(settings: Settings) -> int:
    """One discover-and-apply pass (``once``); never touches IMEX."""
    from guest_agent.agent import Agent, make_discovery

    agent = Agent(settings)
    channels = agent.keep_channels() if settings.imex_channels else None
    if channels is not None:  # files the agent keeps, like the hosts block; never IMEX
        print(f"imex channels: {channels.summary()}")
    await agent.update_addresses()
    discovery = make_discovery(settings)
    view = await discovery.once()
    if view is None:
        print(
            "imex-guest-agent: error: nothing could be learned from the registry or DNS; "
            "files left as they are",
            file=sys.stderr,
        )
        return EXIT_NOTHING_LEARNED
    known = learn(None, view)
    plan = plan_pins(settings, known, agent.local_addrs, agent.hostname, agent.default_route)
    own = plan.own
    log.info("view from %s: %d pinned, generation %s", view.source, len(view.pins),
             view.generation)
    log.info("own slot: %s", own.note)
    try:
        result = agent.applier.apply(plan.pins, plan.hosts_pins)
    except ApplyError as exc:
        print(f"imex-guest-agent: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    print(
        f"applied {len(known.published)} member(s) from {view.source} "
        f"(generation {view.generation}); own slot: {own.note}; "
        f"nodes_config {'written' if result.nodes_written else 'unchanged'}, "
        f"hosts {'written' if result.hosts_written else 'unchanged'}"
    )
    return EXIT_OK


def cmd_status(settings: Settings, as_json: bool, prometheus: bool = False) -> int:
    """Print the status file the daemon writes, and whether its pid still runs
    (``prometheus``: as metrics, for node_exporter's textfile collector)."""
    try:
        data = load_status(settings.status_file)
    except StatusError as exc:
        print(f"imex-guest-agent: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    pid = data.get("pid")
    running = False
    if isinstance(pid, int):
        try:
            os.kill(pid, 0)
            running = True
        except ProcessLookupError:
            running = False
        except PermissionError:
            running = True
    data["agent_running"] = running
    if prometheus:
        sys.stdout.write(prometheus_text(data))
    elif as_json:
        print(json.dumps(data, indent=2, sort_keys=True))
    else:
        sys.stdout.write(format_table(data))
        if not running:
            print(f"(agent pid {pid} is not running: this status may be stale)")
    return EXIT_OK


def cmd_wait(args: argparse.Namespace, settings: Settings) -> int:
    """``wait --for local|domain``: exit 0 ready, 1 error, 2 bad arguments, 3 timed out,
    4 not applicable (guest_agent/workload/barrier.py)."""
    from guest_agent.workload.barrier_io import wait_for

    for warning in settings.warnings:
        print(f"imex-guest-agent: warning: {warning}", file=sys.stderr)
    n = args.min_members if args.min_members is not None else settings.members_expected
    if not 1 <= n <= settings.max_members:
        print(f"imex-guest-agent: error: --min-members {n}: must be between 1 and "
              f"max_members = {settings.max_members}", file=sys.stderr)
        return 2
    return eventloop.leave(eventloop.run(
        wait_for(settings, args.target, args.timeout, n, args.interval)))


def run_daemon(settings: Settings) -> int:
    """``run``: the daemon, until a stop signal or a failed task."""
    from guest_agent.agent import AGENT_VERSION, Agent

    log.info(
        "imex-guest-agent %s starting for %s (config %s)",
        AGENT_VERSION,
        f"{settings.namespace}/{settings.ensemble}",
        settings.source,
    )
    agent = Agent(settings)
    code = eventloop.run(agent.run())
    agent.disarm()
    log.info("stopped (exit %d)", code)
    return eventloop.leave(code)  # a resolver thread still blocked must not hold us


def main(args: argparse.Namespace, settings: Settings) -> int:
    """Entry point for ``run``, ``once`` and ``status`` (called by ``cli.main``)."""
    as_json = bool(getattr(args, "json", False))
    if args.command == "status":
        return cmd_status(settings, as_json, bool(getattr(args, "prometheus", False)))
    if args.command == "members":
        from guest_agent.workload.barrier_io import cmd_members

        if args.slots < 1:
            print("imex-guest-agent: error: --slots must be at least 1", file=sys.stderr)
            return 2
        return cmd_members(settings, args.format, args.addresses, args.slots)
    if args.command == "wait":
        return cmd_wait(args, settings)
    setup_logging(as_json)
    for warning in settings.warnings:
        log.warning("%s", warning)
    if args.command == "once":
        return eventloop.leave(eventloop.run(run_once(settings)))
    if args.command == "preflight":
        from guest_agent.workload.preflight_io import cmd_preflight

        return eventloop.leave(cmd_preflight(settings, as_json))
    if args.command == "run":
        return run_daemon(settings)
    print(f"imex-guest-agent: error: unknown command {args.command!r}", file=sys.stderr)
    return 2
