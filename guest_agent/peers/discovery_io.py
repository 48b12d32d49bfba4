"""Discovery: registry fast path plus DNS fallback, combined into one stream of views.

Contract with the daemon (guest_agent/agent.py): :meth:`Discovery.run` calls ``publish(view)``
whenever what the guest should believe changes; a View (:mod:`guest_agent.peers.discovery`)
carries only validated ``index -> IP`` pins and the slots known to be absent, nothing else
can reach a file.

Which source wins:

* The **registry** (when ``registry_url`` is set) is long-polled; while it answers, its
  views are published and they are authoritative for *all* slots (absent = every slot not
  among its members).
* **DNS** is polled all the time, so its state (with the two-absences hysteresis of
  :mod:`guest_agent.peers.dns`) is warm when it is needed: every ``poll_interval`` while
  it is in charge, every ``dns_standby_interval`` while the registry is (a pass every
  2 s was the largest part of an idle guest's CPU). Its views are published only while
  the registry is not healthy: the last registry request failed, or no answer came for
  ``poll_interval + longpoll_timeout`` after it went out (counted from the request, not
  the answer before it, so a slow pass in between is not the registry's delay). A
  registry failure wakes the DNS loop at once, and a standby sleep never outlasts the
  moment the registry would be overdue, so failover takes one DNS pass either way.
  DNS views assert only what DNS said authoritatively; slots it knows nothing about are
  neither pinned nor absent and the daemon keeps what it had for them.
* A DNS view is published only from a pass that learned something: when both the
  registry and DNS are down, nothing is published and the last-known-good stays.

Backoff: both paths retry with tenacity (exponential with jitter); :meth:`kick` (own
address changed) cuts any wait short and restarts the long-poll without ``wait`` so
both paths rediscover at once.

Handover between registry replicas (host agents with leader election, behind one Service):

* An answer marked ``closing`` (the replica is shutting down) is used like any other, and
  the next request goes out at once, through the Service, so another replica holds it. A
  long-poll the replica ended without an answer (:class:`RegistryDropped`: it closed, or
  TCP keepalive found its node gone) is asked again at once too. Neither is a registry
  failure: connection errors of attempts begun within half a ``poll_interval`` after
  one (a connect that then times out included) are retried every 0.05-0.5 s without
  counting, so a rolling restart never sends a guest to DNS (a registry
  that is really gone still hands over to DNS within ``poll_interval``). A second drop
  without an answer in between is not a handover.
* An answer whose generation is **below** the one the guest holds comes from a replica that
  lags: it is not published and the guest asks again with its own ``wait`` (the registry
  answers only when the generation exceeds it). After ``MAX_BEHIND`` such answers in a row
  (two long-poll timeouts) the lower number is believed: the registry's numbering restarted.

Concurrency: :meth:`run` owns the two loops (daemon.run_all); ``publish`` is called
under a lock, so views arrive in order and never concurrently; a view equal to the last
published one is not published again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import tenacity

from guest_agent import eventloop
from guest_agent.config import Settings
from guest_agent.daemon import run_all
from guest_agent.peers.discovery import View, dns_view, registry_view
from guest_agent.peers.dns import DnsState, DnsTracker
from guest_agent.peers.dns_io import DnsClient
from guest_agent.peers.registry import (
    RegistryDropped,
    RegistryError,
    RegistrySnapshot,
    RegistryUnavailable,
)
from guest_agent.peers.registry_io import RegistryClient
from imex_shared.model import EnsembleId

log = logging.getLogger("guest_agent.discovery")  # logger name pinned

T = TypeVar("T")

#: Answers with a lower generation ignored in a row before the lower number is believed.
MAX_BEHIND = 2
Publish = Callable[[View], Awaitable[None]]


class Discovery:
    """Learns the ensemble's members; see the module docstring."""

    def __init__(self, settings: Settings, ens: EnsembleId, *, token: str | None = None) -> None:
        self.settings = settings
        self.ens = ens
        self.dns = DnsClient(settings, ens)
        self.tracker = DnsTracker(settings.max_members)
        self.registry = (
            RegistryClient(settings, ens, token=token) if settings.registry_url else None
        )
        self._registry_ok_at: float | None = None
        #: when the request now in flight went out: the server holds it from then, so a
        #: slow pass between an answer and the next request does not count against it
        self._registry_asked_at: float | None = None
        self._started_at: float | None = None
        self._registry_failing = False
        self._registry_failures = 0
        self._generation: int | None = None
        self._published: View | None = None
        self._publish_lock = asyncio.Lock()
        self._kick_registry = asyncio.Event()  # wakes the registry loop
        self._registry_kicked = False  # the next request goes without ``wait``
        self._kick_dns = asyncio.Event()  # wakes the DNS loop
        self._handover_until = 0.0  # monotonic; see "Handover" in the module docstring
        self._closing_in_a_row = 0
        self._handover_armed = False  # an answer came since the last drop
        self._behind = 0
        #: handovers ridden out (closing answers, dropped long-polls) and lagging answers
        self.handovers = 0
        self.behind_answers = 0
        #: last views per source, for status and tests
        self.last_registry_view: View | None = None
        self.last_dns_view: View | None = None

    # ------------------------------------------------------------------ public

    def _registry_in_charge(self) -> bool:
        """Whether DNS views must wait: the registry has not failed and is not overdue.

        Before its first answer the registry gets the same allowance, counted from the
        start of :meth:`run`: a registry that refuses connections fails over at once, one
        that hangs after ``poll_interval + longpoll_timeout``.
        """
        overdue_at = self._registry_overdue_at()
        return overdue_at is not None and time.monotonic() <= overdue_at

    def _registry_overdue_at(self) -> float | None:
        """When the registry stops being in charge unless it answers first (monotonic);
        None when it is not in charge at all (none configured, failed, not started)."""
        if self.registry is None or self._registry_failing:
            return None
        ref = self._registry_ok_at if self._registry_ok_at is not None else self._started_at
        if ref is None:
            return None
        if self._registry_asked_at is not None:
            ref = max(ref, self._registry_asked_at)
        return ref + self.settings.poll_interval + self.settings.longpoll_timeout

    @property
    def published(self) -> View | None:
        """The last view handed to ``publish``."""
        return self._published

    def kick(self) -> None:
        """Rediscover now on both paths (e.g. an own address appeared or went away)."""
        self._registry_kicked = True
        self._kick_registry.set()
        self._kick_dns.set()

    async def once(self) -> View | None:
        """One pass: the registry if it answers, else DNS; None when nothing was learned.

        A DNS slot that is absent once is asked again at once, so a pass can report an
        absence (two consecutive authoritative absences) without waiting a poll interval.
        """
        if self.registry is not None:
            try:
                snap = await self.registry.fetch(None)
            except RegistryError as exc:
                self._registry_failed_now(exc)
            else:
                return self._registry_answered(snap)
        state = await self._dns_pass_state()
        if state.pending:
            state = await self._dns_pass_state()
        if not self.tracker.observed:
            return None
        view = dns_view(state)
        self.last_dns_view = view
        return view

    async def run(self, publish: Publish) -> None:
        """Publish views forever (until cancelled)."""
        self._started_at = time.monotonic()
        loops = {"discovery-dns": self._dns_loop(publish)}
        if self.registry is not None:
            loops["discovery-registry"] = self._registry_loop(publish)
        await run_all(loops)  # not a bare TaskGroup: daemon.run_all says why

    # ------------------------------------------------------------------ publishing

    async def _publish(self, publish: Publish, view: View) -> None:
        async with self._publish_lock:
            if view.source == "dns" and self._registry_in_charge():
                return  # the registry answered meanwhile; it wins
            if view == self._published:
                return
            previous = self._published
            self._published = view
            if previous is not None and previous.source != view.source:
                log.info("discovery: now using %s views", view.source)
            try:
                await publish(view)
            except Exception:
                log.exception("discovery: publishing a %s view failed", view.source)

    # ------------------------------------------------------------------ registry

    def _registry_answered(self, snap: RegistrySnapshot) -> View:
        if self._registry_failing:
            log.info(
                "registry answering again after %d failure(s) (generation %d)",
                self._registry_failures,
                snap.generation,
            )
        self._registry_ok_at = time.monotonic()
        self._registry_failing = False
        self._registry_failures = 0
        self._generation = snap.generation
        view = registry_view(snap, self.settings.max_members)
        self.last_registry_view = view
        self.tracker.adopt(view.pins, view.absent)
        return view

    def _registry_failed_now(self, exc: BaseException) -> None:
        self._registry_failures += 1
        was_failing = self._registry_failing
        self._registry_failing = True
        if not was_failing:
            log.warning("registry unreachable, DNS takes over: %s", exc)
            self._kick_dns.set()  # fail over now, not at the next DNS tick
        else:
            log.debug("registry still unreachable (%d): %s", self._registry_failures, exc)

    async def _registry_before_sleep(self, state: tenacity.RetryCallState) -> None:
        exc = state.outcome.exception() if state.outcome is not None else None
        if exc is not None and not isinstance(exc, RegistryError):
            log.error("registry poll failed unexpectedly", exc_info=exc)
        self._registry_failed_now(exc or RuntimeError("unknown failure"))

    async def _registry_fetch(self) -> RegistrySnapshot:
        assert self.registry is not None
        while True:
            wait = self._generation
            self._kick_registry.clear()
            if self._registry_kicked:
                self._registry_kicked = False
                wait = None
            result = await _until(self._fetch_riding_handover(wait), self._kick_registry)
            if result is None:  # kicked during the long-poll: ask again at once, without wait
                self._kick_registry.clear()
                self._registry_kicked = False
                result = await self._fetch_riding_handover(None)
            held = self._generation
            if held is not None and result.generation < held and self._behind < MAX_BEHIND:
                # a replica that lags behind the number we hold: it answered (so the
                # registry is healthy), but we wait for it to move past what we have
                self._behind += 1
                self.behind_answers += 1
                self._registry_ok_at = time.monotonic()
                log.info("registry answered generation %d, below the %d this guest holds "
                         "(a replica that lags); asking again", result.generation, held)
                continue
            self._behind = 0
            return result

    async def _fetch_riding_handover(self, wait: int | None) -> RegistrySnapshot:
        """One fetch; a handover (closing answer, dropped request) is asked again at once
        and its connection errors are retried briefly without counting as failures."""
        assert self.registry is not None
        pause = 0.05
        window = self.settings.poll_interval / 2
        while True:
            started = time.monotonic()  # an attempt begun inside the window may end after it
            self._registry_asked_at = started
            try:
                snap = await self.registry.fetch(wait)
            except RegistryDropped as exc:
                if self._handover_armed:  # the first drop after an answer: ask again at once
                    self._handover_armed = False
                    self.handovers += 1
                    self._handover_until = time.monotonic() + window
                    # the request parks anew on another replica: the registry is in charge
                    # for a whole long-poll from now, not from the last answer
                    self._registry_ok_at = time.monotonic()
                    log.info("registry: request dropped by the replica (%s); asking again",
                             exc)
                    continue
                if started >= self._handover_until:
                    raise
                await asyncio.sleep(pause)
                pause = min(0.5, pause * 2)
                continue
            except RegistryUnavailable:
                if started >= self._handover_until:
                    raise
                await asyncio.sleep(pause)
                pause = min(0.5, pause * 2)
                continue
            self._handover_armed = True
            if snap.closing:
                self.handovers += 1
                self._handover_until = time.monotonic() + window
                self._closing_in_a_row += 1
                if self._closing_in_a_row > 1:  # the balancer still sends us there
                    await asyncio.sleep(min(0.5, 0.05 * 2 ** (self._closing_in_a_row - 2)))
            else:
                self._closing_in_a_row = 0
            return snap

    async def _registry_loop(self, publish: Publish) -> None:
        assert self.registry is not None
        cap = min(30.0, max(1.0, 4 * self.settings.poll_interval))
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_exception_type(Exception),
            wait=_backoff(initial=min(0.2, cap), cap=cap),
            stop=tenacity.stop_never,
            sleep=self._sleep_unless(self._kick_registry),
            before_sleep=self._registry_before_sleep,
            reraise=True,
        )
        while True:
            snap: RegistrySnapshot = await retrying(self._registry_fetch)
            await self._publish(publish, self._registry_answered(snap))

    # ------------------------------------------------------------------ DNS

    async def _dns_pass_state(self) -> DnsState:
        state, _ = await self._dns_observe()
        return state

    async def _dns_observe(self) -> tuple[DnsState, bool]:
        """One DNS pass folded into the tracker: (belief, whether the pass learned anything)."""
        try:
            obs = await self.dns.observe()
        except Exception:  # a bug must not stop discovery; the pass counts as unknown
            log.exception("DNS pass failed unexpectedly")
            return self.tracker.state, False
        return self.tracker.observe(obs), obs.learned

    async def _dns_pass(self, publish: Publish) -> bool:
        state, learned = await self._dns_observe()
        if not learned:
            return False  # DNS down or unusable: publish nothing, keep last-known-good
        view = dns_view(state)
        self.last_dns_view = view
        if not self._registry_in_charge():
            await self._publish(publish, view)
        return True

    async def _dns_loop(self, publish: Publish) -> None:
        interval = self.settings.poll_interval
        retrying = tenacity.AsyncRetrying(
            retry=tenacity.retry_if_result(lambda learned: not learned),
            wait=_backoff(initial=interval, cap=4 * interval),
            stop=tenacity.stop_never,
            sleep=self._sleep_unless(self._kick_dns),
        )
        while True:
            self._kick_dns.clear()
            await retrying(self._dns_pass, publish)
            await self._sleep_unless(self._kick_dns)(self._dns_interval())

    def _dns_interval(self) -> float:
        """Until the next DNS pass: ``poll_interval`` while DNS may be needed, else standby.

        A standby sleep ends when the registry would become overdue (a hung long-poll is
        noticed by no one else), so DNS takes over as fast as without standby.
        """
        interval = self.settings.poll_interval
        overdue_at = self._registry_overdue_at()
        overdue_in = None if overdue_at is None else overdue_at - time.monotonic()
        if overdue_in is None or overdue_in < 0:
            return interval
        return max(interval, min(self.settings.dns_standby_interval, overdue_in + 0.05))

    # ------------------------------------------------------------------ helpers

    @staticmethod
    def _sleep_unless(event: asyncio.Event) -> Callable[[float], Coroutine[Any, Any, None]]:
        """A sleep that ends early when ``event`` is set, and consumes it.

        Consuming matters: a kick that stayed set would turn every later backoff sleep
        into none, a hot loop while a server keeps refusing.
        """

        async def sleep(seconds: float) -> None:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(seconds):
                    await event.wait()
            event.clear()

        return sleep


def _backoff(initial: float, cap: float) -> tenacity.wait.wait_base:
    """Exponential from ``initial`` up to ``cap``, plus up to a quarter of ``cap`` of jitter."""
    return tenacity.wait_exponential(multiplier=initial, max=cap) + tenacity.wait_random(
        0, cap / 4
    )


async def _until(coro: Coroutine[Any, Any, T], event: asyncio.Event) -> T | None:
    """Run ``coro`` until it finishes (its result or exception) or ``event`` is set (None)."""
    outcome = await eventloop.race(coro, event.wait(),
                                   names=("discovery-request", "discovery-kick-wait"))
    return outcome.result() if outcome.done else None
