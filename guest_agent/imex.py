"""Telling the IMEX daemon: a pure decision, three controllers, one supervisor.

Why the rules are what they are (FACTS.md "The IMEX daemon"):

- IMEX reads the nodes file only at start, so a changed nodes file needs a
  restart. In names mode the file depends only on the ensemble and never
  changes, so a moving peer costs a SIGUSR1 (re-resolve names), not a restart.
- IMEX acts on at most one SIGUSR1 per 5 s and ignores the rest. So signals
  are spaced ``signal_interval`` apart and a change inside the window is
  *held*, not dropped: when the window ends the latest state is signalled
  once. Ten changes in two seconds cost at most two signals.
- The first signal after a (re)start is held for one window too: a SIGUSR1
  that arrives before the daemon has installed its handler would kill it,
  and a freshly started daemon has just resolved every name anyway.
- IMEX binds to the nodes-file entry that matches a local address; started
  before our own slot is pinned it exits ("No matching network interface").
  So nothing is started (or restarted) until the own slot is pinned.
- ips mode (and ``on_change = "restart"``): every change is a restart, so a
  burst is debounced: act once the state has been still for ``settle_time``.
- A daemon that has not said READY (``nvidia-imex-ctl -q``) for
  ``ready_grace`` is restarted; so is a dead one (process mode with backoff).
- One more restart reason: our own pinned address moved (DHCP gave a new
  one) while IMEX runs. IMEX bound its server socket to the old address at
  start and SIGUSR1 only redials outgoing connections, so without a restart
  no peer could reach it again. An unknown bind address (a daemon we found
  running) never triggers this.

``decide`` is a pure function of (what IMEX was told, what the files now
say, policy, now) and returns the action plus when to look again; the
``Supervisor`` task only observes, calls ``decide`` and executes. All times
are ``time.monotonic()`` seconds.

Controllers: ``systemd`` (``systemctl`` argv lists, never a shell; on agent
exit IMEX is left running), ``process`` (IMEX is our child: started in its
own session, SIGTERM then SIGKILL on stop), ``none`` (observe only).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import enum
import logging
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, Literal, Protocol

from guest_agent.model import ABSENT_IP

log = logging.getLogger(__name__)

Pins = tuple[tuple[int, str], ...]

READY = "READY"


def freeze_pins(pins: Mapping[int, str]) -> Pins:
    """A hashable, order-independent form of an index -> IP map.

    A slot pinned to ABSENT_IP renders exactly like a slot without a pin, so
    both compare equal (a hosts block read back from disk lists every slot).
    """
    return tuple(sorted((i, ip) for i, ip in pins.items() if ip != ABSENT_IP))


class ImexError(RuntimeError):
    """Controlling the IMEX daemon failed (systemctl, spawning, signalling)."""


class ImexTimeout(ImexError):
    """A command for IMEX (systemctl, nvidia-imex-ctl) did not finish in time."""


class Action(enum.Enum):
    NOTHING = "nothing"
    SIGNAL = "signal"
    RESTART = "restart"
    START = "start"


@dataclass(frozen=True, slots=True)
class Policy:
    mode: Literal["names", "ips"] = "names"
    on_change: Literal["signal", "restart"] = "signal"
    signal_interval: float = 5.0
    settle_time: float = 2.0
    ready_grace: float = 120.0
    #: added to the window: IMEX times its window from when it acted, which is a
    #: little after we sent (scheduling), so a signal at exactly +5 s could be ignored.
    signal_slack: float = 0.15
    #: a change that only takes peers away is told this many windows after it (below)
    removal_windows: float = 3.0


@dataclass(frozen=True, slots=True)
class Want:
    """What the files say now (the agent's side)."""

    pins: Pins
    nodes_sha: str
    own_pinned: bool
    #: monotonic time of the last change of ``pins`` or ``nodes_sha``.
    changed_at: float
    #: the address our own slot is pinned to (what IMEX binds to at start).
    own_ip: str | None = None
    #: digest of the TLS files IMEX reads (authEncryption), None when there are none.
    creds: str | None = None
    #: authEncryption: IMEX must not start before ``creds`` exist.
    creds_needed: bool = False


@dataclass(frozen=True, slots=True)
class Told:
    """What the daemon knows (our record of it) and what we observed of it."""

    running: bool = False
    #: pins the daemon last resolved (at start or at the last acted-on SIGUSR1);
    #: None while it has never been started by or adopted by us.
    pins: Pins | None = None
    nodes_sha: str | None = None
    last_signal_at: float | None = None
    #: when the daemon was first seen not READY (None: READY or unknown).
    not_ready_since: float | None = None
    #: no start/restart before this time (backoff after a crash).
    hold_until: float = 0.0
    #: the own address IMEX bound to at its start (None: unknown, e.g. adopted).
    own_ip: str | None = None
    #: the TLS files' digest IMEX loaded (at start or the last acted-on SIGUSR1).
    creds: str | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    action: Action
    reason: str
    #: when ``decide`` should run again even without news (None: only on news).
    wake_at: float | None = None


def _earliest(*times: float | None) -> float | None:
    real = [t for t in times if t is not None]
    return min(real) if real else None


def decide(told: Told, want: Want, policy: Policy, now: float) -> Decision:
    """What IMEX needs now; pure, see the module docstring for the rules."""
    if not want.own_pinned:
        return Decision(Action.NOTHING, "own slot is not pinned yet: IMEX could not bind")
    if not told.running:
        if want.creds_needed and want.creds is None:
            return Decision(Action.NOTHING, "waiting for the IMEX certificate (authEncryption)")
        if now < told.hold_until:
            return Decision(Action.NOTHING, "IMEX is down, backing off", told.hold_until)
        if told.nodes_sha is None:
            return Decision(Action.START, "IMEX is not running")
        return Decision(Action.RESTART, "IMEX is dead")
    settle_at = want.changed_at + policy.settle_time
    if told.nodes_sha != want.nodes_sha:
        if policy.mode == "ips" and now < settle_at:
            return Decision(Action.NOTHING, "nodes file changed, waiting to settle", settle_at)
        return Decision(Action.RESTART, "the nodes file changed (IMEX reads it only at start)")
    if told.own_ip is not None and want.own_ip is not None and told.own_ip != want.own_ip:
        # IMEX bound its server socket to the old own address at start; SIGUSR1 only
        # restarts outgoing connections, so peers could never reach it again.
        return Decision(
            Action.RESTART, f"own address moved from {told.own_ip} to {want.own_ip}"
        )
    grace_at = (
        told.not_ready_since + policy.ready_grace if told.not_ready_since is not None else None
    )
    if grace_at is not None and now >= grace_at:
        return Decision(Action.RESTART, f"IMEX not READY for {policy.ready_grace:g}s")
    pins_changed = told.pins != want.pins
    # SIGUSR1 reloads IMEX's TLS credentials too: a renewal rides the same window as a
    # membership change, so both together cost one signal, and neither is dropped.
    creds_changed = want.creds is not None and told.creds != want.creds
    if pins_changed and (policy.on_change == "restart" or policy.mode == "ips"):
        if now < settle_at:
            return Decision(Action.NOTHING, "peers changed, waiting to settle", settle_at)
        return Decision(Action.RESTART, "peers changed (on_change = restart)")
    if pins_changed and not creds_changed and told.pins is not None and (
        set(want.pins) <= set(told.pins)
    ):
        # Only peers gone (a deletion, a clique split): IMEX's retries re-resolve every
        # attempt (FACTS.md), so they already dial nothing but 127.0.0.2; a signal would
        # only drop links still up, and it would close the 5 s window in the seconds when
        # a replacement's new address typically follows. So it waits: a gain in the
        # meantime carries it, or it is told when the hold ends.
        hold_at = want.changed_at + policy.removal_windows * policy.signal_interval
        if now < hold_at:
            return Decision(Action.NOTHING, "peers left, telling IMEX later", hold_at)
    if pins_changed or creds_changed:
        what = " and ".join(w for w, c in (("peers changed", pins_changed),
                                            ("credentials renewed", creds_changed)) if c)
        window = (
            told.last_signal_at + policy.signal_interval + policy.signal_slack
            if told.last_signal_at is not None
            else None
        )
        if window is not None and now < window:
            return Decision(
                Action.NOTHING, f"{what} inside the SIGUSR1 window, holding", window
            )
        return Decision(Action.SIGNAL, what)
    return Decision(Action.NOTHING, "IMEX is up to date", grace_at)


def after(told: Told, want: Want, action: Action, now: float) -> Told:
    """Our record of the daemon once ``action`` has been carried out."""
    if action is Action.SIGNAL:
        return replace(told, pins=want.pins, creds=want.creds, last_signal_at=now)
    if action in (Action.START, Action.RESTART):
        return replace(
            told,
            running=True,
            pins=want.pins,
            creds=want.creds,
            nodes_sha=want.nodes_sha,
            last_signal_at=now,
            not_ready_since=now,
            own_ip=want.own_ip,
        )
    return told


# --- controllers -----------------------------------------------------------


class Controller(Protocol):
    name: str

    async def alive(self) -> bool: ...

    async def start(self) -> None: ...

    async def restart(self) -> None: ...

    async def signal(self, sig: signal.Signals) -> None: ...

    async def stop(self) -> None: ...

    async def wait_exit(self) -> None:
        """Return when the daemon is seen to exit (may never return)."""
        ...


async def run_argv(argv: Sequence[str], timeout: float) -> tuple[int, str]:
    """Run ``argv`` (no shell); (returncode, stdout+stderr). ImexError when it cannot run."""
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.STDOUT,
        )
    except OSError as exc:
        raise ImexError(f"cannot run {argv[0]}: {exc.strerror}") from exc
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except BaseException as exc:  # a timeout, or cancelled because the agent is stopping
        # Never leave the child running, nor its transport for the GC to close later.
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await asyncio.shield(proc.wait())
        if isinstance(exc, TimeoutError):
            raise ImexTimeout(f"{' '.join(argv)}: no answer within {timeout:g}s") from exc
        raise
    assert proc.returncode is not None
    return proc.returncode, out.decode("utf-8", "replace").strip()


async def query_state(imex_ctl: Sequence[str], timeout: float = 5.0) -> str | None:
    """``nvidia-imex-ctl -q``: the daemon's state line (e.g. READY), None when unknown.

    NO_ANSWER when the tool itself did not finish within ``timeout``: on an
    overloaded guest that says nothing about IMEX, so the caller must not
    count it as "not READY" (18 healthy stand-ins were restarted every minute
    that way in the e2e sandbox).
    """
    try:
        rc, out = await run_argv([*imex_ctl, "-q"], timeout)
    except ImexTimeout as exc:
        log.debug("imex state query timed out: %s", exc)
        return NO_ANSWER
    except ImexError as exc:
        log.debug("imex state query failed: %s", exc)
        return None
    if rc != 0 or not out:
        return None
    # One short state word (READY, ...); a long first line is garbage, kept bounded
    # because it goes into the status file and the registry report (max 64).
    return out.splitlines()[0].strip()[:64] or None


#: ``query_state`` result when ``nvidia-imex-ctl -q`` did not answer in time.
NO_ANSWER: Final = "NO_ANSWER"


class SystemdController:
    """IMEX as a systemd unit. The agent's exit leaves the unit alone."""

    name = "systemd"

    def __init__(self, unit: str, systemctl: Sequence[str] = ("systemctl",)) -> None:
        self.unit = unit
        self.systemctl = tuple(systemctl)

    async def _run(self, *args: str, timeout: float = 90.0) -> None:
        argv = [*self.systemctl, *args, self.unit]
        rc, out = await run_argv(argv, timeout)
        if rc != 0:
            raise ImexError(f"{' '.join(argv)} failed (exit {rc}): {out}")

    async def alive(self) -> bool:
        rc, _ = await run_argv([*self.systemctl, "is-active", "--quiet", self.unit], 30.0)
        return rc == 0

    async def start(self) -> None:
        await self._run("start")

    async def restart(self) -> None:
        await self._run("restart")

    async def signal(self, sig: signal.Signals) -> None:
        await self._run("kill", "--kill-whom=main", f"--signal={sig.name}")

    async def stop(self) -> None:
        return None

    async def wait_exit(self) -> None:
        await asyncio.Event().wait()


class NoController:
    """``imex_control = "none"``: someone else runs IMEX; we only observe."""

    name = "none"

    async def alive(self) -> bool:
        return True

    async def start(self) -> None:
        return None

    async def restart(self) -> None:
        return None

    async def signal(self, sig: signal.Signals) -> None:
        return None

    async def stop(self) -> None:
        return None

    async def wait_exit(self) -> None:
        await asyncio.Event().wait()


class ProcessController:
    """IMEX as the agent's child process (containers, images without systemd, tests).

    The child runs in its own session so a terminal's Ctrl-C reaches only
    the agent, which then stops the child in order: SIGTERM, wait
    ``stop_timeout``, SIGKILL.
    """

    name = "process"

    def __init__(self, argv: Sequence[str], stop_timeout: float = 10.0) -> None:
        self.argv = tuple(argv)
        self.stop_timeout = stop_timeout
        self.proc: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    async def alive(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self) -> None:
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *self.argv,
                stdin=asyncio.subprocess.DEVNULL,
                start_new_session=True,
                preexec_fn=_die_with_parent(),
            )
        except OSError as exc:
            raise ImexError(f"cannot start {self.argv[0]}: {exc.strerror}") from exc
        log.info("started IMEX", extra={"pid": self.proc.pid, "argv": list(self.argv)})

    async def restart(self) -> None:
        await self.stop()
        await self.start()

    async def signal(self, sig: signal.Signals) -> None:
        if self.proc is None or self.proc.returncode is not None:
            raise ImexError("IMEX is not running, cannot signal it")
        try:
            self.proc.send_signal(sig)
        except ProcessLookupError as exc:
            raise ImexError("IMEX exited before it could be signalled") from exc

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), self.stop_timeout)
        except TimeoutError:
            log.warning("IMEX ignored SIGTERM for %gs, killing it", self.stop_timeout)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()

    async def wait_exit(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            await asyncio.Event().wait()
            return
        await proc.wait()


def _die_with_parent() -> Callable[[], None] | None:
    """A preexec hook: the child gets SIGTERM if the agent dies (even by SIGKILL).

    Without it an orphaned IMEX would keep its ports and the next agent's IMEX
    could never start. systemd (KillMode=mixed) cleans up too; this covers
    agents run by anything else. libc is loaded here, in the parent, so the
    forked child only makes one system call before exec.
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        prctl = libc.prctl
    except (OSError, AttributeError):
        return None
    sigterm = int(signal.SIGTERM)

    def hook() -> None:
        prctl(_PR_SET_PDEATHSIG, sigterm, 0, 0, 0)

    return hook


_PR_SET_PDEATHSIG = 1


def make_controller(kind: str, unit: str, command: Sequence[str]) -> Controller:
    if kind == "systemd":
        return SystemdController(unit)
    if kind == "process":
        return ProcessController(command)
    return NoController()


# --- supervisor --------------------------------------------------------------


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
            query = asyncio.ensure_future(query_state(self.imex_ctl, self.ctl_timeout))
            news = asyncio.ensure_future(self._news.wait())
            budget = max(0.0, until - now) if until is not None else None
            try:
                await asyncio.wait({query, news}, timeout=budget,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                news.cancel()
                if not query.done():
                    query.cancel()
                for t in (query, news):
                    with contextlib.suppress(asyncio.CancelledError):
                        await t
            if query.cancelled():
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
            wake = _earliest(decision.wake_at if decision else None, self._next_poll())
            timeout = max(0.0, (wake if wake is not None else now + self.ready_poll) - now)
            if decision is not None and decision.action is not Action.NOTHING:
                continue
            news = asyncio.ensure_future(self._news.wait())
            exited = asyncio.ensure_future(self.controller.wait_exit())
            try:
                await asyncio.wait({news, exited}, timeout=timeout, return_when="FIRST_COMPLETED")
            finally:
                for t in (news, exited):
                    t.cancel()
                for t in (news, exited):
                    with contextlib.suppress(asyncio.CancelledError):
                        await t

    async def stop(self) -> None:
        await self.controller.stop()

