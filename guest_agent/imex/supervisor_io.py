"""The one task that talks to IMEX: observe, ``decide`` (supervisor.py), execute.

The rules it follows are in ``guest_agent.imex.supervisor``; the daemon is reached
through a ``guest_agent.imex.control`` controller. All times are
``time.monotonic()`` seconds.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from guest_agent.eventloop import race
from guest_agent.imex.control import NO_ANSWER, Controller, ImexError, query_state
from guest_agent.imex.supervisor import (
    READY,
    Action,
    Decision,
    Pins,
    Policy,
    Told,
    Want,
    after,
    decide,
    earliest,
    freeze_pins,
)

log = logging.getLogger("guest_agent.imex")  # logger name pinned


@dataclass
class ImexStats:
    """What the status file and the registry report say about IMEX."""

    state: str = "UNKNOWN"
    signals: int = 0
    restarts: int = 0
    starts: int = 0
    last_action: str | None = None
    last_reason: str | None = None
    last_error: str | None = None
    pid: int | None = None


@dataclass
class Backoff:
    """Restart delays after crashes: ``base`` doubling to ``cap``; reset after a stable run."""

    base: float = 0.5
    cap: float = 30.0
    stable_after: float = 60.0
    current: float = field(default=0.0)

    def next_delay(self, ran_for: float) -> float:
        if ran_for >= self.stable_after:
            self.current = 0.0
        self.current = self.base if self.current == 0.0 else min(self.cap, self.current * 2)
        return self.current


class Supervisor:
    """The one task that talks to IMEX; fed ``Want`` values by the agent."""

    def __init__(
        self,
        controller: Controller,
        policy: Policy,
        imex_ctl: Sequence[str],
        *,
        ready_poll: float = 0.5,
        ready_poll_ready: float = 5.0,
        on_stats: Callable[[ImexStats], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
        backoff: Backoff | None = None,
        ctl_timeout: float = 5.0,
    ) -> None:
        self.controller = controller
        #: how long one ``imex_ctl -q`` may take before it counts as no answer
        self.ctl_timeout = ctl_timeout
        self.policy = policy
        self.imex_ctl = tuple(imex_ctl)
        #: ``imex_ctl -q`` every ``ready_poll`` s while IMEX is not READY (a start is
        #: followed closely), every ``ready_poll_ready`` s once it is (cheap when healthy).
        self.ready_poll = ready_poll
        self.ready_poll_ready = ready_poll_ready
        self.on_stats = on_stats
        self.clock = clock
        self.backoff = backoff or Backoff()
        self.stats = ImexStats()
        self.told = Told()
        self.want: Want | None = None
        self._news = asyncio.Event()
        self._started_at: float | None = None
        self._last_poll = float("-inf")
        self._adopted: tuple[Pins | None, str | None] | None = None
        self._observed = False

    def adopt(self, pins: Mapping[int, str] | None, nodes_sha: str | None) -> None:
        """Before our first write: the files as found, which an already-running IMEX read.

        Used only if the first observation finds IMEX running (an agent restart):
        the daemon then carries on without a restart unless the files differ.
        """
        self._adopted = (freeze_pins(pins) if pins is not None else None, nodes_sha)

    def update(
        self,
        pins: Mapping[int, str],
        nodes_sha: str,
        own_pinned: bool,
        own_ip: str | None = None,
        creds: str | None = None,
        creds_needed: bool = False,
    ) -> None:
        """New desired state (the files were just written)."""
        frozen = freeze_pins(pins)
        now = self.clock()
        old = self.want
        if old is None or old.pins != frozen or old.nodes_sha != nodes_sha:
            changed_at = now
        else:
            changed_at = old.changed_at
        self.want = Want(frozen, nodes_sha, own_pinned, changed_at, own_ip, creds, creds_needed)
        self._news.set()

    def update_creds(self, creds: str | None) -> None:
        """The TLS files changed (a renewal): same pins, new credentials."""
        if self.want is not None and self.want.creds != creds:
            self.want = replace(self.want, creds=creds)
            self._news.set()

    def _publish(self) -> None:
        if self.on_stats is not None:
            self.on_stats(self.stats)

    async def _observe(self, now: float) -> None:
        """Is IMEX running (a cheap check): crashes, adoptions, backoff."""
        try:
            running = await self.controller.alive()
        except ImexError as exc:  # e.g. systemctl missing: treat as down, keep going
            log.error("cannot tell whether IMEX runs: %s", exc)
            self.stats.last_error = str(exc)
            running = False
        if self.told.running and not running:
            ran_for = now - (self._started_at or now)
            delay = self.backoff.next_delay(ran_for)
            log.warning("IMEX exited after %.1fs; restarting in %.1fs", ran_for, delay)
            self.told = replace(self.told, running=False, hold_until=now + delay)
        elif running and not self.told.running:
            if self.told.nodes_sha is None:
                # Running, but not started by us: someone (systemd at boot, an admin)
                # started it. Before our first write it read the files as found;
                # after it, ours. Its first SIGUSR1 waits one window either way.
                if not self._observed and self._adopted is not None:
                    pins, sha = self._adopted
                else:
                    pins, sha = None, self.want.nodes_sha if self.want else None
                self.told = replace(
                    self.told, running=True, pins=pins, nodes_sha=sha, last_signal_at=now
                )
                self._started_at = now
            else:
                self.told = replace(self.told, running=True)
        self._observed = True
        if not running:
            self.stats.state = "NOT_RUNNING"
            self.told = replace(self.told, not_ready_since=None)

    def _poll_due(self, now: float) -> bool:
        return self.told.running and now >= self._next_poll()

    async def _poll(self, now: float, until: float | None = None) -> None:
        """``nvidia-imex-ctl -q`` when due: READY or not (the grace clock's input).

        News preempts a query in flight, and so does ``until``, the moment a held
        decision falls due (a SIGUSR1 waiting for its window): the child is killed and
        reaped, and the poll is due again at once. A ctl that is slow on a loaded
        guest, or hangs up to ``ctl_timeout``, must not hold back the SIGUSR1 that
        tells IMEX a peer moved.
        """
        if self._poll_due(now):
            self._last_poll = now
            budget = max(0.0, until - now) if until is not None else None
            query = await race(query_state(self.imex_ctl, self.ctl_timeout),
                               self._news.wait(), timeout=budget)
            if not query.done:
                self._last_poll = float("-inf")
                return
            state = query.result()
            self.stats.state = state or "UNKNOWN"
            if state == NO_ANSWER:
                pass  # the clock neither starts nor resets on a query that did not finish
            elif state == READY:
                self.told = replace(self.told, not_ready_since=None)
            elif self.told.not_ready_since is None:
                self.told = replace(self.told, not_ready_since=now)

    def _next_poll(self) -> float:
        every = self.ready_poll_ready if self.stats.state == READY else self.ready_poll
        return self._last_poll + every

    async def _execute(self, decision: Decision, want: Want, now: float) -> None:
        action = decision.action
        log.info("IMEX: %s (%s)", action.value, decision.reason)
        try:
            if action is Action.SIGNAL:
                await self.controller.signal(signal.SIGUSR1)
                self.stats.signals += 1
            elif action is Action.START:
                await self.controller.start()
                self.stats.starts += 1
            else:
                await self.controller.restart()
                self.stats.restarts += 1
        except ImexError as exc:
            now = self.clock()
            log.error("IMEX %s failed: %s", action.value, exc)
            self.stats.last_error = str(exc)
            delay = self.backoff.next_delay(0.0)
            self.told = replace(self.told, running=False, hold_until=now + delay)
            return
        now = self.clock()  # the time it was done: IMEX's window starts no earlier
        self.told = after(self.told, want, action, now)
        if action is not Action.SIGNAL:
            self._started_at = now
            self._last_poll = float("-inf")
        self.stats.last_action = action.value
        self.stats.last_reason = decision.reason
        self.stats.pid = getattr(self.controller, "pid", None)

    async def step(self) -> Decision | None:
        """Observe, decide, act once; the decision taken (None before any Want).

        News is acted on before a due readiness poll: a SIGUSR1 that waited for an
        ``nvidia-imex-ctl -q`` child (a process start, up to ``ctl_timeout``) would
        leave the daemon dialling the old address that much longer. The poll then
        runs in the next step, which follows at once after any action.
        """
        await self._observe(self.clock())
        want = self.want
        if want is None or self.controller.name == "none":
            await self._poll(self.clock())
            self._publish()
            return None if want is None else Decision(Action.NOTHING, "imex_control = none")
        decision = decide(self.told, want, self.policy, self.clock())
        if decision.action is Action.NOTHING and self._poll_due(self.clock()):
            await self._poll(self.clock(), decision.wake_at)
            # what the poll saw may be a reason to act (not READY past the grace time)
            decision = decide(self.told, want, self.policy, self.clock())
        if decision.action is not Action.NOTHING:
            await self._execute(decision, want, self.clock())
        self._publish()
        return decision

    async def run(self) -> None:
        """Forever: step, then sleep until news, a timer, a readiness poll or a child exit."""
        while True:
            self._news.clear()
            decision = await self.step()
            now = self.clock()
            wake = earliest(decision.wake_at if decision else None, self._next_poll())
            timeout = max(0.0, (wake if wake is not None else now + self.ready_poll) - now)
            if decision is not None and decision.action is not Action.NOTHING:
                continue
            await race(self._news.wait(), self.controller.wait_exit(), timeout=timeout)

    async def stop(self) -> None:
        await self.controller.stop()
