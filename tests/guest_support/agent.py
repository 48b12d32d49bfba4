"""Running the real ``imex-guest-agent`` as a process in tests (root namespace or a netns node).

The agent is started exactly as systemd would (``python -m guest_agent.cli run --config``),
with JSON logs to a file that a failing test prints. Waiting is polling of the status file
and other real files with a deadline: the agent is another process, there is no event to
await across the process boundary.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
FAKE_IMEX = [PY, str(ROOT / "tests" / "guest_support" / "fake_imex.py")]
#: /etc/hosts re-asserted by a running agent after a foreign write. The product's budget
#: is 1 s (0.3-0.6 s typical: guest_agent/files/filewatch.py). Measured 2026-12-02 from
#: the write to the block back: max 0.72 s (23 restores at load average 6-32 from other
#: jobs) and 0.91 s beside stress-ng (24); the file watch's own test saw 1.04 s loaded.
#: Bound 2 s: a dead watch leaves it to the 5 s recheck.
RESTORED = 2.0
#: ``-q``: READY; ``-N -j``: an empty but valid domain view
READY_CTL = ["/bin/sh", "-c", 'if [ "$1" = -N ]; then echo \'{"nodes": {}}\'; else echo READY; fi',
             "imex-ctl"]
STANDIN_IMEX = str(ROOT / "tests" / "sandbox" / "bin" / "nvidia-imex")
STANDIN_CTL = str(ROOT / "tests" / "sandbox" / "bin" / "nvidia-imex-ctl")

T = TypeVar("T")


def toml_value(v: object) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int | float):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list | tuple):
        return "[" + ", ".join(toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def write_config(path: Path, values: Mapping[str, object]) -> Path:
    path.write_text("".join(f"{k} = {toml_value(v)}\n" for k, v in values.items()))
    return path


def env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}


def cli(*args: str, wrap: Sequence[str] = (), timeout: float = 30
        ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*wrap, PY, "-m", "guest_agent.cli", *args], capture_output=True,
                          text=True, env=env(), timeout=timeout, check=False)


def wait_until(what: str, probe: Callable[[], T | None], timeout: float,
               interval: float = 0.05, log: Callable[[], str] | None = None) -> T:
    """Poll ``probe`` until it returns something truthy; fail naming ``what``."""
    deadline = time.monotonic() + timeout
    last: T | None = None
    while time.monotonic() < deadline:
        last = probe()
        if last:
            return last
        time.sleep(interval)
    extra = f"\n--- agent log ---\n{log()}" if log else ""
    raise AssertionError(f"timed out after {timeout:g}s waiting for {what} "
                         f"(last: {last!r}){extra}")


class AgentProc:
    """One running agent; ``stop()`` sends SIGTERM and returns the exit code."""

    def __init__(self, config: Path, status_file: Path, log_file: Path,
                 wrap: Sequence[str] = (), extra_env: Mapping[str, str] | None = None) -> None:
        self.config = config
        self.status_file = status_file
        self.log_file = log_file
        self._log = open(log_file, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [*wrap, PY, "-m", "guest_agent.cli", "run", "--config", str(config), "--json"],
            stdout=self._log, stderr=subprocess.STDOUT, env={**env(), **(extra_env or {})},
            start_new_session=True,
        )

    def log(self) -> str:
        try:
            return self.log_file.read_text()[-6000:]
        except OSError:
            return ""

    def status(self) -> dict[str, Any]:
        try:
            data = json.loads(self.status_file.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def wait(self, what: str, pred: Callable[[dict[str, Any]], bool], timeout: float = 60.0
             ) -> dict[str, Any]:
        """Until the status satisfies ``pred``: a generous deadline for a start or a
        change to show (a test that means a bound passes its own ``timeout``)."""
        def probe() -> dict[str, Any] | None:
            if self.proc.poll() is not None:
                raise AssertionError(f"agent exited ({self.proc.returncode}) while waiting for "
                                     f"{what}\n{self.log()}")
            s = self.status()
            return s if s and pred(s) else None

        return wait_until(what, probe, timeout, log=self.log)

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
                raise AssertionError(
                    f"agent ignored SIGTERM for {timeout}s\n{self.log()}") from None
        self._log.close()
        return self.proc.returncode

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self._log.close()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie still answers kill(0); look at its state.
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def read_events(path: Path) -> list[dict[str, Any]]:
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except OSError:
        return []
