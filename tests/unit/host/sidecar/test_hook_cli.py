"""``--hook-socket`` / ``IMEX_HOST_AGENT_HOOK_SOCKET``: parsed, mirrored, refused with a reason."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from host_agent.cli import build_settings, main
from host_agent.settings import SettingsError

SOCK = "/var/run/kubevirt-hooks/imex-host-agent.sock"
REPO = Path(__file__).resolve().parents[4]


def test_flag_environment_and_default() -> None:
    assert build_settings([], {}).hook_socket is None
    assert build_settings(["--hook-socket", SOCK], {}).hook_socket == SOCK
    env = {"IMEX_HOST_AGENT_HOOK_SOCKET": SOCK}
    assert build_settings([], env).hook_socket == SOCK
    assert build_settings(["--hook-socket", "/run/x.sock"], env).hook_socket == "/run/x.sock"


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("imex.sock", "must be an absolute path"),
        ("/var/run/kubevirt-hooks/", "names a directory"),
        ("/" + "d" * 120 + ".sock", "too long for a unix socket"),
    ],
)
def test_unusable_paths_are_refused(path: str, reason: str) -> None:
    with pytest.raises(SettingsError, match=f"--hook-socket: .*{reason}"):
        build_settings(["--hook-socket", path], {})


def test_refusal_exits_2_before_anything_starts(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--hook-socket", "relative.sock"]) == 2
    assert "--hook-socket" in capsys.readouterr().err


GRPC_PROBE = """
import sys
from host_agent import cli
if sys.argv[1] == "serve-hook":  # what main.run imports to serve a hook socket
    from host_agent.sidecar import hook_io
code = cli.main(sys.argv[2:])
print(code, "grpc" in sys.modules)
"""


@pytest.mark.parametrize(
    ("args", "loads_grpc"),
    [
        (["-"], False),  # a Deployment replica: no hook socket, no grpc
        (["-", "--hook-socket", "relative.sock"], False),  # refused by the syntax check
        (["-", "--hook-socket", SOCK], False),  # a sidecar, until it serves the socket
        (["serve-hook"], True),  # the probe sees grpc once something imports it
    ],
)
def test_grpc_is_loaded_only_to_serve_a_hook_socket(
        tmp_path: Path, args: list[str], loads_grpc: bool) -> None:
    """grpc's extension is the largest library the agent maps (docs/benchmarks.md, "The
    host agent's memory without grpc"), so the CLI checks and reports hook socket errors
    without it. A real process, stopped early by a kubeconfig that does not exist (exit 2)."""
    out = subprocess.run(
        [sys.executable, "-c", GRPC_PROBE, *args[:1], "--kubeconfig", str(tmp_path / "none"),
         *args[1:]],
        capture_output=True, text=True, timeout=60, cwd=REPO, check=False)
    assert out.stdout.split() == ["2", str(loads_grpc)], out.stderr
