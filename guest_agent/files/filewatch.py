"""Watch the hosts file and the nodes file; re-assert our content when someone else writes.

Who rewrites them: cloud-init's ``manage_etc_hosts`` re-renders /etc/hosts on
every boot, NetworkManager, an admin's editor, configuration management.

What is watched (inotify through watchfiles, non-recursive):

- each file itself: catches in-place writes, including to a bind-mounted
  /etc/hosts (``ip netns exec``, pods), whose directory entry lives in
  another directory (``/etc/netns/NAME``) so the ``/etc`` watch sees nothing;
- each file's directory: catches replacement by rename (editors, our own
  safe writer, ``sed -i``), after which the watch on the old inode is dead.
  After such an event the watcher is re-armed so the file watch follows the
  new inode.

The callback is level-triggered (``Applier.assert_files``): it renders the
desired content from whatever is on disk now and writes only when that
differs. So our own writes, which also raise events, cost one read and no
write, and there is no "ignore my own write" window that could swallow a
foreign write. A periodic call (``recheck``) heals anything inotify missed.
Events are batched (200 ms without a new event, at most ``debounce_ms``) and
then the files must stay unchanged for ``quiet`` (0.1 s) before they are
read, so a tool writing in several steps (truncate, then write) is read once
it is done: typically 0.3-0.6 s after the write, inside the 1 s budget.
The batching step is also how often watchfiles' thread wakes to look at the
stop event: at 50 ms that was a sixth of an idle guest agent's CPU.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable, Iterable

import watchfiles

log = logging.getLogger("guest_agent.filewatch")  # logger name pinned


def _targets(paths: Iterable[str]) -> tuple[set[str], set[str], set[str]]:
    """(watched paths, file paths we care about, basenames we care about)."""
    files: set[str] = set()
    for p in paths:
        files.add(os.path.abspath(p))
        files.add(os.path.realpath(p))
    watch: set[str] = set()
    for f in files:
        if os.path.exists(f):
            watch.add(f)
        d = os.path.dirname(f)
        if os.path.isdir(d):
            watch.add(d)
    return watch, files, {os.path.basename(f) for f in files}


async def watch_files(
    paths: Iterable[str],
    on_change: Callable[[str], None],
    *,
    stop: asyncio.Event | None = None,
    recheck: float = 5.0,
    debounce_ms: int = 300,
    quiet: float = 0.1,
) -> None:
    """Call ``on_change(reason)`` when one of ``paths`` may have changed; runs until ``stop``.

    ``reason`` is the changed path, or ``"recheck"`` for the periodic call.
    Exceptions from ``on_change`` are logged, never raised: a failed re-assert
    is retried on the next event or recheck.
    """
    paths = list(paths)
    stop = stop or asyncio.Event()
    while not stop.is_set():
        watch, files, names = _targets(paths)
        if not watch:
            log.warning("nothing to watch yet for %s; retrying", paths)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), recheck)
            continue

        relevant = _filter(files, names)

        rearm = False
        try:
            async for changes in watchfiles.awatch(
                *sorted(watch),
                watch_filter=relevant,
                debounce=debounce_ms,
                step=200,
                stop_event=stop,
                rust_timeout=int(recheck * 1000),
                yield_on_timeout=True,
                recursive=False,
            ):
                if not changes:
                    _call(on_change, "recheck")
                    continue
                await _settled(files, quiet)
                for path in sorted({p for _, p in changes}):
                    _call(on_change, path)
                # A replaced file leaves the inode watch dead: re-arm on the new one.
                replaced = (watchfiles.Change.added, watchfiles.Change.deleted)
                if any(c in replaced for c, _ in changes):
                    rearm = True
                    break
        except (OSError, RuntimeError) as exc:
            log.warning("file watch failed (%s); re-arming in 1 s", exc)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0)
            continue
        if not rearm:
            return


def _fingerprint(files: Iterable[str]) -> tuple[tuple[int, int, int] | None, ...]:
    out: list[tuple[int, int, int] | None] = []
    for f in sorted(files):
        try:
            st = os.stat(f)
        except OSError:
            out.append(None)
            continue
        out.append((st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


async def _settled(files: Iterable[str], quiet: float, limit: float = 0.6) -> None:
    """Wait until the files have not changed for ``quiet`` s (at most ``limit`` s).

    A writer that truncates and then writes (cloud-init) must be done before
    we read: merging our block into its half-written file and replacing it
    would lose the rest of what it writes to the old inode.
    """
    files = list(files)
    deadline = asyncio.get_running_loop().time() + limit
    last = _fingerprint(files)
    while asyncio.get_running_loop().time() < deadline:
        await asyncio.sleep(quiet)
        now = _fingerprint(files)
        if now == last:
            return
        last = now


def _filter(files: set[str], names: set[str]) -> Callable[[watchfiles.Change, str], bool]:
    def relevant(_change: watchfiles.Change, path: str) -> bool:
        return path in files or os.path.basename(path) in names

    return relevant


def _call(on_change: Callable[[str], None], reason: str) -> None:
    try:
        on_change(reason)
    except Exception as exc:  # the watcher must survive a failed re-assert
        log.error("re-asserting after a change of %s failed: %s", reason, exc)
