"""The user-data's install script, run for real: venv, pip from a wheelhouse, the unit's binary.

The ``runcmd`` script the generator writes is executed by ``sh`` as cloud-init
would, in a private mount namespace where a scratch directory is bind-mounted
over ``/opt`` (the script hard-codes ``/opt/imex-guest-agent``, which the
agent's unit names in ExecStart). ``python3`` is the system Python, as in a
Debian guest; the wheelhouse holds this repository's wheel, built here.
``systemctl`` is a recorder on PATH: there is no systemd to talk to, and what
matters is which commands run in which order. The binary the unit starts
must exist afterwards and run. cloud-init's semaphore directory is a scratch
directory too (its path is swapped in the script's text); this machine has
no ``/var/lib/cloud`` to bind over.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import pytest

from guest_agent import cloudinit as ci

REPO = Path(__file__).resolve().parents[2]
SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not Path(SYSTEM_PYTHON).exists() or shutil.which("unshare") is None,
        reason="needs the system python3 (with venv) and unshare",
    ),
]

RECORDER = """#!/bin/sh
echo "$*" >> "$SYSTEMCTL_LOG"
[ "$1" = cat ] && [ "$2" = nvidia-imex.service ] && exit 0
exit 0
"""


def in_scratch_sems(script: str, tmp_path: Path) -> tuple[str, Path]:
    """``script`` with cloud-init's semaphore directory swapped for a new scratch one."""
    sem_dir = tmp_path / "sem"
    sem_dir.mkdir()
    return script.replace(ci.CLOUD_INIT_SEM_DIR, str(sem_dir)), sem_dir


def exec_start(unit: str) -> list[str]:
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    return line.removeprefix("ExecStart=").split()


def test_install_script_installs_what_the_unit_starts(tmp_path: Path) -> None:
    # A wheel of this very tree, built from a copy so the work tree stays clean.
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for pkg in ("guest_agent", "host_agent"):
        shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    wheelhouse = tmp_path / "wheels"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(wheelhouse),
            str(src),
        ],
        check=True,
        capture_output=True,
        timeout=120,
    )
    # The [guest] extra's dependencies are not in this offline wheelhouse, so
    # the requirement is the bare distribution, pinned like the default one.
    opts = ci.Options(
        ensemble="gb200",
        namespace="gpu-jobs",
        install=ci.InstallSource("find-links", wheelhouse.as_uri()),
        package=f"imex-ensemble=={version('imex-ensemble')}",
    )
    script, sem_dir = in_scratch_sems(ci.render_setup_script(opts, ci.load_unit()), tmp_path)
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(RECORDER)
    (fakebin / "systemctl").chmod(0o755)
    opt = tmp_path / "opt"
    opt.mkdir()
    log = tmp_path / "systemctl.log"
    argv = exec_start(ci.load_unit())
    assert argv[0].startswith(ci.VENV + "/")
    runner = f'mount --bind {opt} /opt && sh -c "$SCRIPT" && {argv[0]} --help >/dev/null'
    # A guest has none of this machine's pip settings (find-links, index).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env = dict(
        clean,
        PATH=f"{fakebin}:/usr/sbin:/usr/bin:/sbin:/bin",
        SCRIPT=script,
        SYSTEMCTL_LOG=str(log),
        PIP_NO_CACHE_DIR="1",
    )
    proc = subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", runner],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installed = opt / Path(argv[0]).relative_to("/opt")
    assert installed.is_file() and os.access(installed, os.X_OK)
    assert log.read_text().splitlines() == [
        "daemon-reload",
        "enable imex-guest-agent.service",
        "restart imex-guest-agent.service",
        "cat nvidia-imex.service",
        "enable nvidia-imex.service",
        "restart nvidia-imex.service",
    ]
    # committed: the next boot's bootcmd leaves cloud-init's semaphores alone
    sem = Path(ci.setup_sem(opts, ci.load_unit()))
    assert [p.name for p in sem_dir.iterdir()] == [sem.name]


def test_install_script_stops_at_the_first_failure(tmp_path: Path) -> None:
    """A pip failure must not go on to enable a unit whose binary is missing."""
    opts = ci.Options(
        ensemble="gb200",
        namespace="gpu-jobs",
        install=ci.InstallSource("find-links", (tmp_path / "empty").as_uri()),
    )
    (tmp_path / "empty").mkdir()
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    for tool in ("systemctl", "python3"):
        (fakebin / tool).write_text(RECORDER)  # python3 too: no real venv needed here
        (fakebin / tool).chmod(0o755)
    log = tmp_path / "calls.log"
    script, sem_dir = in_scratch_sems(ci.render_setup_script(opts, None), tmp_path)
    proc = subprocess.run(
        ["sh", "-c", script],
        env=dict(os.environ, PATH=f"{fakebin}:/usr/bin:/bin", SYSTEMCTL_LOG=str(log)),
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert proc.returncode != 0  # /opt/imex-guest-agent/bin/pip does not exist
    assert log.read_text().splitlines() == ["-m venv /opt/imex-guest-agent"]
    assert list(sem_dir.iterdir()) == []  # never committed: the next boot sets up again


BOOT_SEMS = ("config_write_files", "config_runcmd", "config_scripts_user", "config_ssh")


@pytest.mark.parametrize("state", ["committed", "never committed", "other user-data"])
def test_bootcmd_rearms_the_setup_until_it_is_committed(state: str, tmp_path: Path) -> None:
    """A guest that died before the commit gets write_files and runcmd again; others do not."""
    o = ci.Options(ensemble="gb200", namespace="gpu-jobs")
    bootcmd, sem_dir = in_scratch_sems(ci.render_bootcmd(o, None), tmp_path)
    for name in BOOT_SEMS:  # what cloud-init left from the first boot
        (sem_dir / name).write_text("")
    ours = Path(ci.setup_sem(o, None)).name
    if state == "committed":
        (sem_dir / ours).write_text("")
    elif state == "other user-data":
        other = ci.Options(ensemble="gb200", namespace="other")
        (sem_dir / Path(ci.setup_sem(other, None)).name).write_text("")
    # as cloud-init runs it: every bootcmd item in one sh script
    proc = subprocess.run(["sh", "-c", bootcmd], capture_output=True, text=True, timeout=10,
                          check=False)
    assert proc.returncode == 0, proc.stderr
    left = sorted(p.name for p in sem_dir.iterdir())
    if state == "committed":
        assert left == sorted([*BOOT_SEMS, ours])
        assert proc.stdout == ""
    else:
        # only the three modules of the setup run again; ssh keys and the rest stay done
        assert [n for n in left if n.startswith("config_")] == ["config_ssh"]
        assert proc.stdout.count("removed") == 3
