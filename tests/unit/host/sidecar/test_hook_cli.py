"""``--hook-socket`` / ``IMEX_HOST_AGENT_HOOK_SOCKET``: parsed, mirrored, refused with a reason."""

from __future__ import annotations

import pytest

from host_agent.cli import build_settings, main
from host_agent.settings import SettingsError

SOCK = "/var/run/kubevirt-hooks/imex-host-agent.sock"


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
