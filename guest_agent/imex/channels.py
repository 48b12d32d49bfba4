"""IMEX channel device nodes: which to create, replace, fix or refuse (pure).

A CUDA job that imports memory across nodes opens
``/dev/nvidia-caps-imex-channels/channel<N>``: a character device whose major is the
``nvidia-caps-imex-channels`` line of ``/proc/devices`` and whose minor is N (NVIDIA's
IMEX guide, "IMEX Channels"; FACTS.md "The workload's side"). The driver registers the
major but creates no node (unless the module parameter ``NVreg_CreateImexChannel0=1``
asks it for channel 0), and the nodes are lost at every reboot. In a VM nobody else
makes them, so the agent keeps them, like the hosts block.

This module decides; :mod:`guest_agent.imex.channels_io` looks (``lstat``, reads
``/proc/devices``) and acts (``mknod``, ``rename``, ``chmod``, ``chown``). The rules:

- **missing**: create it;
- **a character device with the right major and minor**: never replaced; its mode or
  group are set in place when they differ from the configured ones;
- **a character device with another major or minor** (the driver was reloaded and got a
  new major): replaced, by ``mknod`` to a temporary name in the directory, then
  ``rename`` over it, so a job never sees the path missing;
- **anything else** (a regular file, a symlink, a directory, a block device, a socket):
  refused and left alone, with a message naming the path;
- **no major yet** (the driver has not registered ``nvidia-caps-imex-channels``):
  nothing to do but wait, and say so. Not a failure.

``/proc/devices`` is parsed strictly: its "Character devices:" section only, at most
:data:`PROC_DEVICES_MAX` bytes, and a name listed twice (or a section that is not
``<number> <name>`` lines) is an error, never a guess: a wrong major would make a node
that opens another driver's device.
"""

from __future__ import annotations

import re
import stat
from dataclasses import dataclass, field
from typing import Final, Literal

from guest_agent.config import CHANNEL_DIR

__all__ = ["CHANNEL_DIR", "MAJOR_NAME", "PROC_DEVICES", "Action", "ChannelsState",
           "DevicesError", "Observed", "channel_path", "channels_ready", "parse_major",
           "plan_channel"]

PROC_DEVICES: Final = "/proc/devices"
MAJOR_NAME: Final = "nvidia-caps-imex-channels"
#: /proc/devices is about 1 KB on a real host; anything past this is not /proc/devices
PROC_DEVICES_MAX: Final = 64 * 1024
#: Linux majors are 12 bits (MAJORBITS 12 in linux/kdev_t.h)
MAX_MAJOR: Final = 4095

_LINE = re.compile(r"^\s*(\d{1,4})\s+(\S{1,64})\s*$")


class DevicesError(ValueError):
    """/proc/devices is not what the kernel prints; the message says what is wrong."""


def channel_path(n: int, directory: str = CHANNEL_DIR) -> str:
    return f"{directory}/channel{n}"


def parse_major(text: str, name: str = MAJOR_NAME) -> int | None:
    """The character-device major registered as ``name`` in ``/proc/devices``; None when
    the driver has not registered it. Raises DevicesError for anything the kernel would
    not print (no section header, a malformed line, the name twice, too much text)."""
    if len(text) > PROC_DEVICES_MAX:
        raise DevicesError(f"{PROC_DEVICES} is {len(text)} bytes, over {PROC_DEVICES_MAX}: "
                           "not the kernel's device list")
    lines = text.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Character devices:")
    except StopIteration:
        raise DevicesError(f'{PROC_DEVICES} has no "Character devices:" line') from None
    found: list[int] = []
    for lineno, line in enumerate(lines[start + 1:], start + 2):
        if not line.strip():
            break  # the blank line before "Block devices:"
        m = _LINE.match(line)
        if m is None:
            raise DevicesError(f"{PROC_DEVICES} line {lineno} is not '<major> <name>': "
                               f"{line[:60]!r}")
        if m.group(2) == name:
            found.append(int(m.group(1)))
    if len(found) > 1:
        raise DevicesError(f"{PROC_DEVICES} lists {name} {len(found)} times (majors "
                           f"{', '.join(map(str, found))}): refusing to guess which is real")
    if found and not 0 < found[0] <= MAX_MAJOR:
        raise DevicesError(f"{PROC_DEVICES}: {name} has major {found[0]}, outside 1-{MAX_MAJOR}")
    return found[0] if found else None


Kind = Literal["missing", "chr", "blk", "reg", "dir", "symlink", "other"]


@dataclass(frozen=True, slots=True)
class Observed:
    """What ``lstat`` found at one path (never following a symlink)."""

    kind: Kind
    major: int | None = None
    minor: int | None = None
    mode: int | None = None  # permission bits only
    gid: int | None = None

    @classmethod
    def of_stat(cls, st_mode: int, rdev: int, major: int, minor: int, gid: int) -> Observed:
        perms = stat.S_IMODE(st_mode)
        if stat.S_ISCHR(st_mode):
            return cls("chr", major, minor, perms, gid)
        kind: Kind = ("blk" if stat.S_ISBLK(st_mode) else "reg" if stat.S_ISREG(st_mode)
                      else "dir" if stat.S_ISDIR(st_mode) else "symlink"
                      if stat.S_ISLNK(st_mode) else "other")
        return cls(kind, mode=perms, gid=gid)


_WHAT: Final[dict[str, str]] = {
    "blk": "a block device", "reg": "a regular file", "dir": "a directory",
    "symlink": "a symlink", "other": "not a character device",
}

Verb = Literal["ok", "create", "replace", "fix", "refuse"]


@dataclass(frozen=True, slots=True)
class Action:
    channel: int
    path: str
    verb: Verb
    why: str = ""


def plan_channel(n: int, path: str, major: int, seen: Observed, mode: int,
                 gid: int | None) -> Action:
    """What to do about channel ``n`` at ``path`` (see the module docstring).
    ``gid`` None: the group is not known here (leave it as it is)."""
    if seen.kind == "missing":
        return Action(n, path, "create", "missing")
    if seen.kind != "chr":
        return Action(n, path, "refuse",
                      f"{path} is {_WHAT[seen.kind]}, not the IMEX channel device; "
                      "left alone (remove it to let the agent create the channel)")
    if (seen.major, seen.minor) != (major, n):
        return Action(n, path, "replace", f"device {seen.major}:{seen.minor}, want {major}:{n}")
    wrong = []
    if seen.mode != mode:
        wrong.append(f"mode {seen.mode or 0:04o}, want {mode:04o}")
    if gid is not None and seen.gid != gid:
        wrong.append(f"gid {seen.gid}, want {gid}")
    if wrong:
        return Action(n, path, "fix", ", ".join(wrong))
    return Action(n, path, "ok")


@dataclass
class ChannelsState:
    """The last pass: the configured channels that are correct nodes now, and why not."""

    configured: tuple[int, ...] = ()
    present: list[int] = field(default_factory=list)
    #: the driver has not registered the major (yet): waiting, not failing
    waiting: str | None = None
    errors: list[str] = field(default_factory=list)
    major: int | None = None
    #: what the pass changed, e.g. "created channel0"
    changed: list[str] = field(default_factory=list)

    def summary(self) -> str:
        if not self.configured:
            return "off (imex_channels = [])"
        if self.waiting:
            return f"waiting: {self.waiting}"
        have = ", ".join(map(str, self.present)) or "none"
        text = f"present: {have} of {', '.join(map(str, self.configured))}"
        return text + (f"; {'; '.join(self.errors)}" if self.errors else "")


def channels_ready(state: ChannelsState) -> bool:
    """Every configured channel is a correct node (no channels configured: trivially)."""
    return set(state.configured) <= set(state.present)
