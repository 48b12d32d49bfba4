"""One container of a built image, run under podman for a test, and nothing left after.

``running(...)`` starts it detached (``podman run -d``) with a name and a label that
carries the test process's pid; on the way out, passed or failed, it stops the container
(SIGTERM, then the stop timeout), keeps its log, removes it, and checks that podman knows
no such container any more and that no mount of the host still names it. A test process
killed outright never reaches that: the next ``running`` removes every labelled
container whose pid is gone, and .ci/run removes any labelled container at its end.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from tools.image_base import podman, ulimits

LABEL = "io.imex-ensemble.test"
PID_LABEL = "io.imex-ensemble.test-pid"


class ContainerError(Exception):
    """podman failed, or the container left something behind."""


def _podman(*args: str, timeout: float = 120, check: bool = True
            ) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(podman(*args), capture_output=True, text=True, timeout=timeout,
                          check=False)
    if check and proc.returncode != 0:
        raise ContainerError(f"podman {' '.join(args[:3])} ... exited {proc.returncode}: "
                             f"{proc.stderr.strip()[-2000:]}")
    return proc


@dataclass
class Container:
    name: str
    id: str
    log: Path
    exit_code: int | None = None

    def exec(self, *argv: str) -> subprocess.CompletedProcess[str]:
        """Run ``argv`` inside (as the container's user); the result, checked or not."""
        return _podman("exec", self.name, *argv, timeout=60, check=False)

    def logs(self) -> str:
        """Its stdout, then its stderr (podman keeps the two apart; the agent logs to
        stderr)."""
        out = _podman("logs", self.name, check=False)
        return out.stdout + out.stderr

    def alive(self) -> bool:
        out = _podman("inspect", "--format", "{{.State.Running}}", self.name, check=False)
        return out.stdout.strip() == "true"

    def stop(self) -> int:
        """SIGTERM, the container's stop timeout, then SIGKILL; its exit code."""
        if self.exit_code is None:
            _podman("stop", self.name, timeout=120)
            self.log.write_text(self.logs())
            code = _podman("inspect", "--format", "{{.State.ExitCode}}", self.name)
            self.exit_code = int(code.stdout.strip())
        return self.exit_code


def remove_orphans() -> list[str]:
    """Remove labelled containers whose test process is gone; their names."""
    out = _podman("ps", "-a", "--filter", f"label={LABEL}", "--format",
                  f'{{{{.Names}}}} {{{{index .Labels "{PID_LABEL}"}}}}').stdout
    gone: list[str] = []
    for line in out.splitlines():
        name, _, pid = line.partition(" ")
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            _podman("rm", "--force", "--time", "0", name, check=False)
            gone.append(name)
    return gone


def leftovers(name: str, cid: str) -> list[str]:
    """What of container ``name`` (id ``cid``) still exists: podman's record, mounts."""
    found: list[str] = []
    if _podman("container", "exists", name, check=False).returncode == 0:
        found.append(f"podman still lists container {name}")
    with open("/proc/self/mountinfo", encoding="utf-8") as f:
        found += [f"mount: {line.strip()}" for line in f if cid in line]
    return found


@contextlib.contextmanager
def running(name: str, image: str, flags: Sequence[str], args: Sequence[str],
            log: Path) -> Iterator[Container]:
    """``podman run -d --network=host`` of ``image``; stopped, removed and checked after."""
    remove_orphans()
    proc = _podman("run", "--detach", "--name", name, "--label", f"{LABEL}={name}",
                   "--label", f"{PID_LABEL}={os.getpid()}", "--network=host", *ulimits(),
                   *flags, image, *args, timeout=300)
    box = Container(name, proc.stdout.strip(), log)
    problems: list[str] = []
    try:
        yield box
    finally:
        try:
            box.stop()
        except (ContainerError, subprocess.TimeoutExpired, ValueError) as e:
            problems.append(f"stop: {e}")
        with contextlib.suppress(OSError):
            if not log.exists():
                log.write_text(box.logs())
        _podman("rm", "--force", "--time", "0", name, check=False)
        problems += leftovers(name, box.id)
        if problems:
            raise ContainerError(f"container {name}: " + "; ".join(problems))
