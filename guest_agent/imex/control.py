"""The IMEX daemon's three controllers, and ``nvidia-imex-ctl -q``.

Controllers: ``systemd`` (``systemctl`` argv lists, never a shell; on agent
exit IMEX is left running), ``process`` (IMEX is our child: started in its
own session, SIGTERM then SIGKILL on stop), ``none`` (observe only).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import signal
from collections.abc import Callable, Sequence
from typing import Final, Protocol

log = logging.getLogger("guest_agent.imex_control")  # logger name pinned


class ImexError(RuntimeError):
    """Controlling the IMEX daemon failed (systemctl, spawning, signalling)."""


class ImexTimeout(ImexError):
    """A command for IMEX (systemctl, nvidia-imex-ctl) did not finish in time."""


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
