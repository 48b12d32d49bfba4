"""Collect what the registry's domain view needs: ``-N -j``, the fabric, the IMEX channel.

One task (``DomainCollector.run``), woken every ``report_interval`` seconds and after
each applied change (``kick``). Each pass:

- runs ``nvidia-imex-ctl -N -j`` with a deadline; on timeout (or the agent stopping) the
  child is killed and reaped, as for ``-q``; output over 1 MiB is cut off and the child
  killed. The output is parsed and rebuilt by :class:`imex_shared.imex_domain.DomainParser`;
  anything it refuses is dropped, counted (``errors``) and named (``last_error``);
- runs ``nvidia-smi -q`` at most once a minute: a GPU's fabric identity does not change
  while the VM runs. A missing ``nvidia-smi`` means no fabric (``null``), not an error; a
  failed or garbled query keeps the last good answer;
- takes the channel nodes' state from the channel keeper (``channels``, the agent's
  :func:`guest_agent.imex.channels_io.keep_channels` pass), which the agent runs on its
  own every ``poll_interval``.

The result goes to a callback (the agent), which puts it into the status file and the
next report. Nothing here raises out of ``run`` for bad output.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from guest_agent.config import Settings
from guest_agent.report.report import Collected
from imex_shared.imex_domain import (
    OUTPUT_MAX_BYTES,
    DomainError,
    DomainParser,
    parse_fabric,
)

log = logging.getLogger("guest_agent.collect")  # logger name pinned

#: nvidia-smi is asked at most this often (seconds).
FABRIC_EVERY = 60.0
#: two passes are never closer than this (seconds).
MIN_GAP = 1.0
#: a kicked pass waits this long after the change, so -N sees IMEX act on it
KICK_SETTLE = 0.5


class CommandFailed(Exception):
    """The command could not run, did not finish in time, or exited non-zero."""


async def run_bounded(
    argv: Sequence[str], timeout: float, limit: int = OUTPUT_MAX_BYTES
) -> bytes:
    """stdout of ``argv`` (no shell, stderr discarded); DomainError past ``limit`` bytes.

    The child never outlives the call: a timeout, too much output or a cancellation
    kills it and waits for it.
    """
    try:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            start_new_session=True,  # so a kill reaches whatever it started, too
        )
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise CommandFailed(f"cannot run {argv[0]}: {exc.strerror}") from exc
    assert proc.stdout is not None
    stdout = proc.stdout

    async def read_all() -> bytes:
        chunks: list[bytes] = []
        size = 0
        while chunk := await stdout.read(65536):
            size += len(chunk)
            if size > limit:
                raise DomainError(f"{argv[0]} printed over {limit} bytes")
            chunks.append(chunk)
        await proc.wait()
        return b"".join(chunks)

    try:
        out = await asyncio.wait_for(read_all(), timeout)
    except BaseException as exc:
        await asyncio.shield(_kill(proc, stdout))
        if isinstance(exc, TimeoutError):
            raise CommandFailed(f"{' '.join(argv)}: no answer within {timeout:g}s") from exc
        raise
    if proc.returncode != 0:
        raise CommandFailed(f"{' '.join(argv)} exited {proc.returncode}")
    return out


async def _kill(proc: asyncio.subprocess.Process, stdout: asyncio.StreamReader) -> None:
    """SIGKILL the child's whole session, read its pipe to EOF (the transport only ends
    once the pipe is drained), then reap it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(TimeoutError, OSError):
        async with asyncio.timeout(5.0):
            while await stdout.read(65536):
                pass
    await proc.wait()


class DomainCollector:
    """The collecting task; see the module docstring."""

    def __init__(
        self,
        settings: Settings,
        on_result: Callable[[Collected], None],
        channels: Callable[[], list[int]] = list,
        *,
        ctl_timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.on_result = on_result
        #: the configured channels that are correct nodes now (the channel keeper's)
        self.channels = channels
        self.ctl_timeout = ctl_timeout
        self.clock = clock
        self.result = Collected()
        self._kick = asyncio.Event()
        self._parser = DomainParser(settings.max_members)

    def kick(self) -> None:
        """Collect now (an applied change), not at the end of the interval."""
        self._kick.set()

    def _error(self, message: str) -> None:
        log.warning("dropped: %s", message)
        self.result.errors += 1
        self.result.last_error = message

    async def _domain(self) -> dict[str, Any] | None:
        argv = [*self.settings.imex_ctl, "-N", "-j"]
        try:
            out = await run_bounded(argv, self.ctl_timeout)
            return self._parser.parse(out)
        except FileNotFoundError:
            log.debug("%s is not installed", argv[0])
        except CommandFailed as exc:  # IMEX down or slow: no view this time, not garbage
            log.debug("imex domain query: %s", exc)
        except DomainError as exc:
            self._error(str(exc))
        return None

    async def _fabric(self, now: float) -> None:
        r = self.result
        if r.fabric_checked_at is not None and now - r.fabric_checked_at < FABRIC_EVERY:
            return
        r.fabric_checked_at = now
        argv = [*self.settings.nvidia_smi, "-q"]
        try:
            out = await run_bounded(argv, self.ctl_timeout * 2)
        except FileNotFoundError:
            r.fabric, r.fabric_known = None, True  # no driver tools: no fabric
            return
        except CommandFailed as exc:
            log.info("fabric query: %s (keeping %s)", exc, r.fabric)
            return
        except DomainError as exc:
            self._error(str(exc))
            return
        try:
            r.fabric, r.fabric_known = parse_fabric(out), True
        except DomainError as exc:
            self._error(str(exc))

    async def collect(self) -> Collected:
        """One pass (also used by tests); updates and returns ``result``."""
        r = self.result
        r.imex_domain = await self._domain()
        await self._fabric(self.clock())
        r.channels = self.channels()
        r.at = time.time()
        r.passes += 1
        return r

    async def run(self) -> None:
        """Forever: collect, hand the result over, sleep until the interval ends or a kick.

        Kicks come with every applied change (18 in a boot storm); passes stay at least
        ``MIN_GAP`` apart, since each one starts a process or two.
        """
        while True:
            self._kick.clear()
            started = self.clock()
            await self.collect()
            self.on_result(self.result)
            kicked = True
            try:
                await asyncio.wait_for(self._kick.wait(), self.settings.report_interval)
            except TimeoutError:
                kicked = False
            # After a kick, wait KICK_SETTLE too: the change is being told to IMEX at
            # this moment (SIGUSR1), and a -N taken now would show the links before it
            # acted, while its process start competed with the signal for the CPU.
            gap = max(MIN_GAP - (self.clock() - started), KICK_SETTLE if kicked else 0.0)
            if gap > 0:
                await asyncio.sleep(gap)
