"""Binary wheels for every target, from the package index (pip's own configuration).

Two promises the issue asks to prove without a container engine or an arm64 machine:

* the host agent image builds for linux/arm64 without compiling anything: every
  distribution of the ``host`` extra has a binary wheel for linux/arm64 on the image's
  Python (the Containerfile's ``PYTHON_IMAGE``). ``pip download --only-binary=:all:
  --platform ...`` into a scratch directory fails when one does not;
* ``make wheelhouse`` for linux/arm64 yields wheels an aarch64 guest installs, and nothing
  else: this tree's wheel, the guest closure for that Python, pip.

These reach the package index, like the venv bootstrap that every test needs anyway.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.utils import canonicalize_name, parse_wheel_filename

from tools import wheelhouse as wh

REPO = Path(__file__).resolve().parents[3]


def image_python() -> str:
    """``3.11`` from ``ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm``."""
    text = (REPO / "Containerfile").read_text()
    m = re.search(r"^ARG PYTHON_IMAGE=python:(3\.\d+)\.\d+-slim", text, re.MULTILINE)
    assert m, "Containerfile: ARG PYTHON_IMAGE=python:<x.y.z>-slim-... not found"
    return m.group(1)


def extra(name: str) -> list[str]:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    return list(doc["project"]["optional-dependencies"][name])


@pytest.mark.parametrize("platform", ["linux/arm64", "linux/amd64"])
def test_every_host_dependency_has_a_binary_wheel_for_the_image(tmp_path: Path,
                                                                  platform: str) -> None:
    target = wh.Target(platform, image_python())
    plats = [a for t in target.platform_tags() for a in ("--platform", t)]
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--disable-pip-version-check",
         "--only-binary=:all:", *plats, "--python-version", target.python,
         "--implementation", "cp", "--dest", str(tmp_path), *extra("host")],
        capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"{platform}: {proc.stdout[-2000:]}{proc.stderr[-2000:]}"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files and all(f.endswith(".whl") for f in files), files  # no sdist to build
    assert wh.incompatible(files, target) == []
    got = {canonicalize_name(parse_wheel_filename(f)[0]) for f in files}
    wanted = {canonicalize_name(r.split(">")[0].split("=")[0].split("[")[0].split(";")[0])
              for r in extra("host")}
    assert wanted <= got, wanted - got
    compiled = [f for f in files if not f.endswith("-none-any.whl")]
    machine = target.machine
    assert compiled and all(machine in f for f in compiled), compiled  # grpcio, pydantic-core


def test_make_wheelhouse_for_arm64_holds_the_guest_closure_and_nothing_else(
        tmp_path: Path) -> None:
    out = tmp_path / "wheelhouse"
    rc = wh.main(["--platform", "linux/arm64", "--python", "3.13", "--out", str(out),
                  "--no-build-isolation"])
    assert rc == 0
    (d,) = out.iterdir()
    assert d.name == "linux-arm64-py3.13"
    files = sorted(p.name for p in d.iterdir())
    names = {canonicalize_name(parse_wheel_filename(f)[0]) for f in files}
    target = wh.Target("linux/arm64", "3.13")
    assert wh.incompatible(files, target) == []
    wheels = {wh.wheel_info(d / f).name: wh.wheel_info(d / f) for f in files}
    needed, missing = wh.closure([wh.guest_requirement()], wheels, target)
    assert missing == []
    assert names == needed | {"pip"}  # nothing else
    assert {"imex-ensemble", "watchfiles", "cryptography", "dnspython", "pyroute2",
            "tenacity"} <= names
    (watchfiles,) = [f for f in files if f.startswith("watchfiles-")]
    assert "aarch64" in watchfiles and "x86_64" not in watchfiles
