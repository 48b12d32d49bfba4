"""``--version`` on both command lines: the installed console scripts print their name and
pyproject.toml's version, exit 0, and need no config, cluster or subcommand."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from imex_shared.version import package_version

REPO = Path(__file__).resolve().parents[3]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


def test_the_installed_version_is_pyprojects() -> None:
    assert package_version() == VERSION


def test_the_guest_console_script_prints_its_version(tmp_path: Path) -> None:
    """The host's twin is tests/unit/host/test_host_version.py: the guest's venv (the chroot
    tier runs this folder there) has the host script but not the host's dependencies."""
    exe = Path(sys.executable).with_name("imex-guest-agent")
    # no config file, no kubeconfig, no subcommand: --version needs none of them
    proc = subprocess.run([str(exe), "--config", str(tmp_path / "absent.toml"), "--version"],
                          capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env={"PATH": "/usr/bin:/bin"}, check=False)
    assert (proc.returncode, proc.stdout, proc.stderr) == (0, f"imex-guest-agent {VERSION}\n", "")


# -- the skew policy (docs/install.md "Upgrades") --------------------------------------

from imex_shared.version import (  # noqa: E402
    BAD,
    GUEST_TOO_OLD,
    OLDER_HOST,
    SUPPORTED,
    TOO_OLD,
    host_verdict,
    series,
    version_doc,
)


@pytest.mark.parametrize(("text", "want"), [
    ("0.2.0", (0, 2)), ("0.2", (0, 2)), ("1.10.3rc1", (1, 10)), ("0.2.0+local.1", (0, 2)),
    ("0+unknown", None), ("", None), ("v0.2.0", None), (None, None), (2, None),
])
def test_series(text: object, want: tuple[int, int] | None) -> None:
    assert series(text) == want


def test_the_version_document_supports_one_minor_back() -> None:
    assert version_doc("0.2.0") == {"version": "0.2.0", "api": "v1", "min_guest": "0.1",
                                    "max_guest": "0.2"}
    assert version_doc("1.0.0")["min_guest"] == "1.0"  # a major starts its own range


@pytest.mark.parametrize(("doc", "guest", "verdict", "words"), [
    (version_doc("0.2.0"), "0.2.0", SUPPORTED, "supports this guest"),
    (version_doc("0.3.1"), "0.2.0", SUPPORTED, "supports this guest"),  # host first
    (version_doc("0.4.0"), "0.2.0", GUEST_TOO_OLD, "upgrade the guest agent"),
    (None, "0.2.0", OLDER_HOST, "predates GET /version"),  # a 0.1 host agent: 404
    (version_doc("0.2.0"), "0.3.0", OLDER_HOST, "tolerated for reports only"),
    (version_doc("0.2.0"), "0.4.0", TOO_OLD, "too old for this guest"),
    (version_doc("0.2.0"), "1.0.0", TOO_OLD, "too old for this guest"),
    ({"version": "0.2.0", "api": "v2", "min_guest": "0.1", "max_guest": "0.2"}, "0.2.0",
     BAD, "registry API 'v2'"),
    ({"version": "0.2.0", "api": "v1", "min_guest": "x", "max_guest": "0.2"}, "0.2.0",
     BAD, "not a MAJOR.MINOR range"),
    ("<html>", "0.2.0", BAD, "not a version document"),
    (version_doc("0.2.0"), "0+unknown", SUPPORTED, "version is unknown"),
])
def test_what_a_guest_makes_of_its_host(doc: object, guest: str, verdict: str,
                                        words: str) -> None:
    got, message = host_verdict(doc, guest)
    assert got == verdict and words in message, message
    if verdict in (OLDER_HOST, TOO_OLD):
        assert "upgrade the host agent first" in message
