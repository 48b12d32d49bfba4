"""The guest package under each interpreter Debian ships, installed the way guests install it.

In each chroot the product's own installer (``python3 install.py --find-links
file:///wheelhouse/``, the bytes cloud-init writes) installs ``imex-ensemble[guest]`` from
the wheelhouse tree with the suite's python3 and no ensurepip or pip in the image. Then:

* bookworm (3.11) and trixie (3.13), amd64: the guest unit tests run inside, under that
  interpreter, from the repository mounted read-only at /src;
* bookworm arm64 under qemu-user: the arm64 wheels install and the agent runs (what baking
  an arm64 image on an x86 machine does); the same guest refuses an amd64-only wheelhouse;
* bullseye (3.9, below the floor): the one-line refusal, from a real 3.9;
* the host extra installs into the arm64 root and ``imex-host-agent --help`` runs: what the
  arm64 host agent image needs, without a container engine.

3.12 has no Debian suite here; it is backed by the static checks in
tests/unit/guest/installer/test_bootstrap.py and the wheelhouse's cp312 directory (expected, not
tested: docs/install.md).
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest

from guest_agent.installer import guest_files, setup_script
from tests.chroot.conftest import GUESTS, ChrootFactory
from tests.chroot.sandbox import Chroot
from tests.chroot.wheels import TEST_RUNNER, host_wheels, runner_wheels
from tests.vm.wheelhouse import target_for

pytestmark = [pytest.mark.chroot, pytest.mark.root, pytest.mark.timeout(3600)]

INSTALL = (f"mkdir -p {Path(guest_files.INSTALLER_PATH).parent} && "
           f"cp /src/guest_agent/installer/bootstrap.py {guest_files.INSTALLER_PATH} && "
           f"python3 {guest_files.INSTALLER_PATH} --find-links file:///wheelhouse/ "
           f"--requirement 'imex-ensemble[guest]' --venv {setup_script.VENV}")


def install(c: Chroot) -> str:
    p = c.sh(INSTALL, timeout=1800)
    assert p.returncode == 0, f"{c.name}: {p.stdout}{p.stderr}"
    assert p.stderr == ""
    (line,) = p.stdout.splitlines()
    return line


def python_version(c: Chroot) -> str:
    return c.check("python3 -c 'import sys; print(\"%d.%d\" % sys.version_info[:2])'").strip()


@pytest.mark.parametrize("gid", ["debian-12-amd64", "debian-13-amd64"])
def test_guest_unit_tests_pass_under_the_suites_python(chroot: ChrootFactory, gid: str,
                                                       tmp_path: Path) -> None:
    guest = GUESTS[gid]
    runner = runner_wheels(target_for(guest.arch, guest.python))
    c = chroot(guest, binds={"/testwheels": runner})
    assert python_version(c) == guest.python
    assert c.sh("python3 -c 'import ensurepip'").returncode != 0  # stock: no python3-venv
    assert c.sh("python3 -m pip --version").returncode != 0  # and no pip
    line = install(c)
    assert f"with python{guest.python} (/usr/bin/python3" in line
    assert f"linux-{guest.arch}-py{guest.python}/" in line
    # the test runner into the same venv, with the same pip-from-its-wheel trick
    pip = c.check(f"ls /wheelhouse/linux-{guest.arch}-py{guest.python}/pip-*.whl").strip()
    c.check(f"{setup_script.VENV}/bin/python {pip}/pip install -q --no-index --no-cache-dir "
            f"--find-links /testwheels/ {' '.join(TEST_RUNNER)}", timeout=1800)
    p = c.sh(f"cd /src && PYTHONDONTWRITEBYTECODE=1 {setup_script.VENV}/bin/python -m pytest -q "
             "-p no:cacheprovider tests/unit/guest tests/unit/shared", timeout=1800)
    summary = p.stdout.strip().splitlines()[-1] if p.stdout.strip() else p.stderr[-2000:]
    assert p.returncode == 0, f"{gid}: {p.stdout[-4000:]}{p.stderr[-2000:]}"
    m = re.search(r"(\d+) passed", summary)
    assert m and int(m.group(1)) > 200, summary
    print(f"\nchroot {gid} python{guest.python}: {summary}")


def test_debian_11s_python_3_9_is_refused_in_one_line(chroot: ChrootFactory) -> None:
    c = chroot(GUESTS["debian-11-amd64"])
    assert python_version(c) == "3.9"
    p = c.sh(INSTALL)
    assert p.returncode == 1 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line == (
        "imex-ensemble setup: error: python3.9 (/usr/bin/python3) is the newest python3 here, "
        "below the floor 3.11: install python3.11 or newer from your distribution, then boot "
        "again")
    assert not c.path(setup_script.VENV).exists()


def test_arm64_installs_its_own_wheels_and_refuses_an_amd64_wheelhouse(
        chroot: ChrootFactory, wheelhouse: Path, tmp_path: Path) -> None:
    guest = GUESTS["debian-12-arm64"]
    c = chroot(guest)
    assert c.check("uname -m").strip() == "aarch64"
    line = install(c)
    assert "from file:///wheelhouse/linux-arm64-py3.11/" in line
    venv = setup_script.VENV
    out = c.check(f"{venv}/bin/imex-guest-agent --help && {venv}/bin/python -c "
                  "'import watchfiles._rust_notify, cryptography.hazmat.bindings._rust as r; "
                  "print(watchfiles._rust_notify.__file__)'", timeout=900)
    assert "aarch64-linux-gnu" in out or "abi3" in out, out
    assert "render" in out
    # the same guest, a wheelhouse built for amd64 only
    amd_only = tmp_path / "amd64-only"
    amd_only.mkdir()
    for d in wheelhouse.glob("linux-amd64-*"):
        shutil.copytree(d, amd_only / d.name)
    c2 = chroot(guest, name="arm64-amd64-wheelhouse", binds={"/wheelhouse": amd_only})
    p = c2.sh(INSTALL, timeout=900)
    assert p.returncode == 1
    (refusal,) = p.stderr.splitlines()
    assert refusal == (
        "imex-ensemble setup: error: the wheelhouse file:///wheelhouse/ has nothing for "
        "linux-arm64 (this guest is aarch64); it serves linux-amd64-py3.11, "
        "linux-amd64-py3.13: run make wheelhouse PLATFORM=linux/arm64")
    assert not c2.path(setup_script.VENV).exists()


def test_the_host_extra_installs_and_runs_on_arm64(chroot: ChrootFactory,
                                                  wheelhouse: Path) -> None:
    # the host agent image is python:3.11-slim-bookworm: the same Debian and Python
    guest = GUESTS["debian-12-arm64"]
    wheels = host_wheels(target_for("arm64", "3.11"))
    c = chroot(guest, binds={"/hostwheels": wheels})
    pip = "$(ls /wheelhouse/linux-arm64-py3.11/pip-*.whl)/pip"
    c.check("python3 -m venv --without-pip /opt/host && "
            f"/opt/host/bin/python {pip} install -q --no-index --no-cache-dir "
            "--find-links /hostwheels/ --find-links /wheelhouse/linux-arm64-py3.11/ "
            "'imex-ensemble[host]'", timeout=2400)
    out = c.check("/opt/host/bin/imex-host-agent --help && /opt/host/bin/python -c "
                  "'import grpc, pydantic_core, httptools, uvicorn, fastapi; print(\"ok\")'",
                  timeout=900)
    assert "--listen" in out and out.rstrip().endswith("ok")
