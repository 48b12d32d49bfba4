"""The guest agent daemon: one asyncio program, one TaskGroup, data flowing one way.

    discovery ──View──► merge (pins) ──► own slot ──► render + write ──► IMEX supervisor
    netwatch ──addresses changed──► kick discovery, re-evaluate own slot ─┘      │
    filewatch ──foreign write──► re-assert (same pins, no IMEX action)          ▼
                                                        status.json + registry report

This module is the wiring and the loop; every decision is made in a stage (``peers``,
``pins``, ``files``, ``imex``, ``report``, ``tls``; the ``once`` and ``status`` commands
are ``commands.py``). Tasks (all in one ``asyncio.TaskGroup``, all visible in
``Agent.run``): discovery (registry long-poll and DNS polling, owned by
``peers/discovery_io.py``), netwatch (netlink address events), filewatch (inotify), the
IMEX supervisor, the domain collector, the IMEX channel keeper (device nodes, every
``poll_interval``), preflight (every 10 minutes), the reporter and (authEncryption) the
certificate keeper. Callbacks from discovery, netwatch and filewatch are plain
functions that run to completion on the loop, so a View is merged, rendered
and written without interleaving with another writer; the slow parts (IMEX
control, HTTP reports) are their own tasks fed "latest value" style, so they
never hold up discovery.

Signals: SIGTERM and SIGINT set the stop event; the run loop then stops the
file watcher, cancels the other tasks and (process mode) stops the child
IMEX. The managed files are left exactly as they are: the last-known-good
state stays in place for IMEX and for the next agent.

Failure rules: nothing learned keeps the files as they are; a write error is
recorded as ``last_error`` and retried on the next View or re-check; a task
that raises is logged and ends the agent with exit 1 so systemd
(Restart=always) starts a fresh one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from guest_agent.config import Settings
from guest_agent.daemon import (
    EXIT_FAILED,
    EXIT_OK,
    STOP_DEADLINE,
    cancel_all,
    sd_notify,
    stop_watchdog,
)
from guest_agent.files.apply import Applier, ApplyError, ApplyResult
from guest_agent.files.retry import Retry
from guest_agent.imex.channels import ChannelsState
from guest_agent.imex.channels_io import keep_channels, log_news
from guest_agent.imex.control import make_controller
from guest_agent.imex.supervisor import Policy
from guest_agent.imex.supervisor_io import ImexStats, Supervisor
from guest_agent.net.portreserve import reserve_port
from guest_agent.peers.discovery import View
from guest_agent.pins.merge import Known, learn, plan_pins
from guest_agent.pins.ownslot import OwnSlot
from guest_agent.report.collect import DomainCollector
from guest_agent.report.report import (
    Collected,
    status_body,
    take_applied,
    take_collected,
    take_imex,
)
from guest_agent.report.status_file import Status, StatusError, write_status
from imex_shared.model import EnsembleId
from imex_shared.version import package_version

if TYPE_CHECKING:  # the daemon's modules need the [guest] extra; imported lazily
    from guest_agent.peers.discovery_io import Discovery
    from guest_agent.report.report_io import Reporter
    from guest_agent.tls.keeper import TlsStatus
    from guest_agent.tls.keeper_io import CertKeeper

log = logging.getLogger("guest_agent")


AGENT_VERSION = package_version()


# --- the stages the daemon imports lazily: netwatch, discovery, TLS ------------------


async def local_view() -> tuple[set[str], str | None]:
    """(local addresses, default-route source address) via ``netwatch``."""
    from guest_agent.net import netwatch

    return await netwatch.local_addresses(), await netwatch.default_route_address()


def make_discovery(settings: Settings) -> Discovery:
    from guest_agent.peers.discovery_io import Discovery
    from guest_agent.report.report_io import ReportError, read_token

    try:
        token = read_token(settings.token_file)
    except ReportError as exc:
        log.warning("registry requests without a token: %s", exc)
        token = None
    return Discovery(settings, EnsembleId(settings.namespace, settings.ensemble), token=token)


def make_keeper(settings: Settings, on_renewed: Any, on_status: Any) -> CertKeeper:
    """The TLS keeper; ``cryptography`` runs only in its short-lived child."""
    from guest_agent.tls.imex_config import ensure_imex_config
    from guest_agent.tls.keeper_io import CertKeeper

    assert settings.registry_url is not None
    base = f"{settings.registry_url}/v1/ensembles/{settings.namespace}/{settings.ensemble}"
    try:
        if ensure_imex_config(settings.imex_config, settings.tls_dir):
            log.info("wrote the TLS keys into %s", settings.imex_config)
    except OSError as exc:
        log.error("cannot put the TLS keys into %s: %s", settings.imex_config, exc)
    return CertKeeper(
        tls_dir=settings.tls_dir,
        ca_sha256=settings.ca_sha256,
        url_for=lambda index: f"{base}/members/{index}/certificate",
        token_file=settings.token_file,
        registry_ca_sha256=settings.registry_ca_sha256,
        on_renewed=on_renewed,
        on_status=on_status,
    )


# --- the agent -------------------------------------------------------------------------


class Agent:
    """State and callbacks of the daemon; ``run`` owns every task."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.ens = EnsembleId(settings.namespace, settings.ensemble)
        self.applier = Applier(settings)
        #: what the Views said so far (None: nothing learned yet)
        self.known: Known | None = None
        self.own: OwnSlot | None = None
        self.local_addrs: set[str] = set()
        self.default_route: str | None = None
        self.hostname = socket.gethostname()
        self.stop = asyncio.Event()
        self.first_apply = asyncio.Event()
        self.notified = False
        self.status = Status(
            ensemble=settings.ensemble,
            namespace=settings.namespace,
            domain_id=self.ens.domain_id,
            mode=settings.mode,
            agent_version=AGENT_VERSION,
            own_slot_mode=settings.own_slot,
            imex_control=settings.imex_control,
        )
        self.supervisor = Supervisor(
            make_controller(settings.imex_control, settings.imex_unit, settings.imex_command),
            Policy(
                mode=settings.mode,
                on_change=settings.on_change,
                signal_interval=settings.signal_interval,
                settle_time=settings.settle_time,
                ready_grace=settings.ready_grace,
            ),
            settings.imex_ctl,
            on_stats=self._on_imex,
        )
        self.reporter: Reporter | None = None
        if settings.registry_url is not None:
            from guest_agent.report.report_io import Reporter

            self.reporter = Reporter(settings, on_error=self._report_error,
                                     on_registry=self._on_registry, agent_version=AGENT_VERSION)
        self.channels = ChannelsState(configured=settings.imex_channels)
        self.collector = DomainCollector(settings, self._on_collected,
                                         lambda: list(self.channels.present))
        self.collected: Collected | None = None
        self.discovery: Discovery | None = None
        self._watchdog: threading.Timer | None = None
        self.keeper: CertKeeper | None = None
        #: a pass whose write failed runs again by itself (files/retry.py)
        self.retry = Retry(lambda: None if self.stop.is_set() else self.refresh())
        if settings.auth_encryption:
            self.keeper = make_keeper(settings, self._on_creds, self._on_tls)

    # -- TLS (authEncryption)

    def _on_creds(self) -> None:
        """The keeper wrote new credentials: IMEX reloads them on its next SIGUSR1."""
        if self.keeper is not None:
            self.supervisor.update_creds(self.keeper.creds_digest())
        if not self.notified and self.first_apply.is_set():
            self.notified = sd_notify("READY=1")

    def _on_tls(self, tls: TlsStatus) -> None:
        doc = dict(vars(tls))
        if doc != self.status.tls:
            self.status.tls = doc
            self.write_status()
            self.report()

    # -- errors and status

    def record_error(self, message: str | None) -> None:
        if message is not None:
            self.status.last_error = message
            self.status.last_error_at = time.time()
        self.write_status()

    def _report_error(self, message: str | None) -> None:
        self.record_error(message)

    def _on_registry(self, doc: dict[str, Any]) -> None:
        """The reporter's view of the registry: transport, pin, certificate, host version."""
        self.status.registry = doc
        self.write_status()

    def write_status(self) -> None:
        self.status.updated_at = time.time()
        try:
            write_status(self.settings.status_file, self.status)
        except (StatusError, OSError) as exc:
            log.warning("cannot write status file: %s", exc)

    def _on_imex(self, stats: ImexStats) -> None:
        imex = (stats.state, stats.signals, stats.restarts, stats.starts, stats.pid)
        changed, taken = take_imex(self.status, imex, stats.last_error, time.time())
        if taken:
            stats.last_error = None
        if changed:
            self.write_status()
            self.report()

    def _on_collected(self, result: Collected) -> None:
        """A collection pass ended (every ``report_interval``): status, then a report."""
        self.collected = result
        own = self.own.index if self.own is not None else None
        take_collected(self.status, result, own, time.time())
        self.write_status()
        self.report(force=True)

    def report(self, force: bool = False) -> None:
        """Submit the current report; ``force`` sends it even unchanged (the heartbeat)."""
        if self.reporter is None or self.own is None or self.own.index is None:
            return
        body = status_body(self.status, self.collected, with_cert=self.keeper is not None)
        self.reporter.submit(self.own.index, body, force=force)

    # -- the pipeline

    async def publish(self, view: View) -> None:
        """Discovery's publish callback (async by its contract; runs to completion)."""
        self.on_view(view)

    def on_view(self, view: View) -> None:
        """Discovery's publish callback: merge, then apply."""
        self.known = learn(self.known, view)
        if self.keeper is not None and view.source == "registry":
            self.keeper.set_registry_bundle(view.ca_bundle_sha256)
        log.info("view from %s: %d pinned, %d absent, generation %s",
                 view.source, len(view.pins), len(view.absent), view.generation)
        self.refresh()

    def refresh(self) -> ApplyResult | None:
        """Own slot, render, write, tell the supervisor, status; the whole pass."""
        known = self.known
        if known is None:
            return None
        plan = plan_pins(self.settings, known, self.local_addrs, self.hostname,
                         self.default_route)
        own = plan.own
        if own != self.own:
            log.info("own slot: %s", own.note)
        self.own = own
        try:
            result = self.applier.apply(plan.pins, plan.hosts_pins)
        except ApplyError as exc:
            log.error("apply failed: %s (trying again in %g s)", exc, self.retry.delay)
            self.record_error(f"apply: {exc}")
            self.retry.failed()
            return None
        self.retry.ok()
        if result.written:
            log.info("files written", extra={"nodes": result.nodes_written,
                                             "hosts": result.hosts_written})
        if result.reasserted:
            self._count_reassert("apply")
        creds = None
        if self.keeper is not None:
            self.keeper.set_slot(own.index, self.ens.slot(own.index)
                                 if own.index is not None else None)
            creds = self.keeper.creds_digest()
        self.supervisor.update(plan.told, result.nodes_sha256, own.pin_ip is not None, own.pin_ip,
                               creds=creds, creds_needed=self.keeper is not None)
        take_applied(self.status, self.ens, plan, known, result.nodes_sha256,
                     result.hosts_sha256)
        self.write_status()
        self.report()
        self.collector.kick()
        if not self.first_apply.is_set():
            self.first_apply.set()
            if self.keeper is None or self.keeper.ready.is_set():
                self.notified = sd_notify("READY=1")
        return result

    def on_files(self, reason: str) -> None:
        """Filewatch callback: re-assert the last applied pins if someone changed the files."""
        try:
            result = self.applier.assert_files()
        except ApplyError as exc:
            self.record_error(f"re-assert: {exc}")
            self.retry.failed()
            return
        if result is not None and result.reasserted:
            self._count_reassert(reason)
            self.status.hosts_sha256 = result.hosts_sha256
            self.status.nodes_config_sha256 = result.nodes_sha256
            self.write_status()

    def _count_reassert(self, reason: str) -> None:
        self.status.reasserts += 1
        log.warning(
            "managed file changed by another writer: re-asserted",
            extra={"path": reason, "reasserts": self.status.reasserts},
        )

    async def on_addresses(self) -> None:
        """Netwatch callback: our addresses may have changed (migration, DHCP), or the
        watch was just bound and a change before it would otherwise be lost."""
        before = (self.local_addrs, self.default_route)
        await self.update_addresses()
        if (self.local_addrs, self.default_route) == before:
            return
        log.info("local addresses changed: %s", sorted(self.local_addrs))
        if self.discovery is not None:
            self.discovery.kick()
        self.refresh()

    async def update_addresses(self) -> None:
        try:
            self.local_addrs, self.default_route = await local_view()
        except Exception as exc:  # netlink trouble must not stop the agent
            log.warning("cannot read local addresses: %s", exc)

    # -- IMEX channels

    def keep_channels(self) -> ChannelsState:
        """One channel pass (``run`` every poll_interval, ``once`` once), into the status."""
        s, old = self.settings, self.channels
        self.channels = state = keep_channels(s.imex_channels, s.channel_mode,
                                              s.imex_channel_group)
        log_news(old, state)
        note = state.summary()
        if state.present != old.present or note != self.status.imex_channels_note:
            self.status.imex_channels = list(state.present)
            self.status.imex_channel0 = 0 in state.present
            self.status.imex_channels_note = note
            self.write_status()
            if state.present != old.present:
                self.collector.kick()  # the registry hears of it with the next report
        return state

    # -- preflight

    async def _preflight(self) -> None:
        """The checks after the first apply (or 30 s without one) and every 10 minutes."""
        from guest_agent.workload.preflight_io import preflight_loop

        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.first_apply.wait(), 30.0)
        await preflight_loop(self.settings, self._preflight_facts, self._on_preflight)

    def _preflight_facts(self) -> dict[str, Any]:
        c, imex_pid = self.collected, self.status.imex_pid
        return {"channels": self.channels,
                "managed_pid": imex_pid if self.settings.imex_control == "process" else None,
                "domain": c.imex_domain if c is not None else None,
                "own_index": self.own.index if self.own is not None else None}

    def _on_preflight(self, doc: list[dict[str, str]]) -> None:
        self.status.preflight, self.status.preflight_at = doc, time.time()
        self.write_status()
        self.report()

    async def _keep_channels(self) -> None:
        if not self.settings.imex_channels:
            return
        while True:
            self.keep_channels()
            await asyncio.sleep(self.settings.poll_interval)

    # -- tasks

    async def _watch_files(self) -> None:
        from guest_agent.files.filewatch import watch_files

        await self.first_apply.wait()
        await watch_files(
            [self.settings.hosts_file, self.settings.nodes_config], self.on_files, stop=self.stop
        )

    async def _watch_addresses(self) -> None:
        from guest_agent.net import netwatch

        await netwatch.follow_addresses(self.on_addresses)

    async def _collect(self) -> None:
        await self.first_apply.wait()
        await self.collector.run()

    async def _supervise(self) -> None:
        await self.first_apply.wait()
        await self.supervisor.run()

    async def _startup_notify(self) -> None:
        """Tell systemd we are up after the first apply, or after 30 s regardless."""
        try:
            await asyncio.wait_for(self.first_apply.wait(), 30.0)
        except TimeoutError:
            if not self.notified:
                self.notified = sd_notify("READY=1")
                log.warning("nothing learned within 30 s; keeping the files as they are")
            return
        if self.keeper is None or self.notified:
            return
        # nvidia-imex.service is ordered after us: hold it back until its credentials
        # exist, but not forever (and below the unit's TimeoutStartSec of 60 s).
        wait = self.settings.cert_wait
        try:
            await asyncio.wait_for(self.keeper.ready.wait(), wait)
        except TimeoutError:
            why = self.keeper.status.last_error or self.keeper.status.waiting or "no answer"
            self.record_error(f"tls: no certificate within {wait:g} s ({why}); IMEX starts "
                              "without credentials and cannot reach its peers until one comes")
            log.error("no IMEX certificate within %g s: %s", wait, why)
        if not self.notified:
            self.notified = sd_notify("READY=1")

    def _on_stop_signal(self, sig: signal.Signals) -> None:
        if not self.stop.is_set():
            log.info("%s received: stopping", sig.name)
            self._watchdog = stop_watchdog(STOP_DEADLINE)
        self.stop.set()

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._on_stop_signal, sig)
        if self.settings.reserve_port:  # before the first connection this agent opens
            reserve_port(self.settings.port)
        pins_found, nodes_sha_found = self.applier.found()
        self.supervisor.adopt(pins_found, nodes_sha_found)
        await self.update_addresses()
        self.discovery = make_discovery(self.settings)
        self.write_status()
        tasks: list[asyncio.Task[Any]] = []
        failed = False
        try:
            async with asyncio.TaskGroup() as tg:
                tasks.append(tg.create_task(self.discovery.run(self.publish), name="discovery"))
                tasks.append(tg.create_task(self._watch_addresses(), name="netwatch"))
                tasks.append(tg.create_task(self._watch_files(), name="filewatch"))
                tasks.append(tg.create_task(self._supervise(), name="imex"))
                tasks.append(tg.create_task(self._collect(), name="domain"))
                tasks.append(tg.create_task(self._startup_notify(), name="notify"))
                tasks.append(tg.create_task(self._keep_channels(), name="channels"))
                tasks.append(tg.create_task(self._preflight(), name="preflight"))
                if self.reporter is not None:
                    tasks.append(tg.create_task(self.reporter.run(), name="reporter"))
                if self.keeper is not None:
                    tasks.append(tg.create_task(self.keeper.run(), name="tls"))
                await self.stop.wait()
                await cancel_all(tasks)
        except* Exception as group:
            failed = True
            for exc in group.exceptions:
                log.error("task failed: %r", exc, exc_info=exc)
        finally:
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            with contextlib.suppress(Exception):
                await asyncio.shield(self.supervisor.stop())
            self.write_status()
        return EXIT_FAILED if failed else EXIT_OK

    def disarm(self) -> None:
        """Called once the event loop has closed: shutdown finished in time."""
        if self._watchdog is not None:
            self._watchdog.cancel()
