"""The user-data's install script, run for real: the installer, a wheelhouse, the unit's binary.

The ``runcmd`` script the generator writes is executed by ``sh`` as cloud-init
would, in a private mount namespace where a scratch directory is bind-mounted
over ``/opt`` (the script hard-codes ``/opt/imex-guest-agent``, which the
agent's unit names in ExecStart). ``python3`` is the system Python and the only
one on PATH, as in a Debian guest; the wheelhouse is laid out as ``make
wheelhouse`` lays it out, with this tree's wheel built here and the guest
closure repacked from the test venv (offline). ``systemctl`` is a recorder on
PATH: there is no systemd to talk to, and what matters is which commands run in
which order. The binary the unit starts must exist afterwards and run.
cloud-init's semaphore directory and the installer's path are scratch paths too
(swapped in the script's text); this machine has no ``/var/lib/cloud`` to bind
over.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from importlib.metadata import version
from pathlib import Path

import pytest

from guest_agent.installer import cli, guest_files, setup_script
from guest_agent.installer import options as opt
from tests.guest_support.wheels import guest_wheelhouse

SYSTEM_PYTHON = "/usr/bin/python3"

pytestmark = [
    pytest.mark.root,
    pytest.mark.skipif(
        not Path(SYSTEM_PYTHON).exists() or shutil.which("unshare") is None,
        reason="needs the system python3 and unshare",
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
    return script.replace(setup_script.CLOUD_INIT_SEM_DIR, str(sem_dir)), sem_dir


def with_installer(script: str, opts: opt.Options, tmp_path: Path) -> str:
    """Write the installer as write_files would (its bytes from the rendered files) at a
    scratch path, and point the script there."""
    (entry,) = [f for f in guest_files.render_files(opts, None)
                if f.path == guest_files.INSTALLER_PATH]
    path = tmp_path / "lib" / "install.py"
    path.parent.mkdir()
    path.write_bytes(entry.content)
    return script.replace(guest_files.INSTALLER_PATH, str(path))


def exec_start(unit: str) -> list[str]:
    line = next(x for x in unit.splitlines() if x.startswith("ExecStart="))
    return line.removeprefix("ExecStart=").split()


def run_setup(script: str, tmp_path: Path, after: str = "") -> subprocess.CompletedProcess[str]:
    """``script`` under sh as cloud-init runs it, /opt a scratch dir, systemctl a recorder."""
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "systemctl").write_text(RECORDER)
    (fakebin / "systemctl").chmod(0o755)
    (fakebin / "python3").symlink_to(SYSTEM_PYTHON)  # the image's python3, nothing else
    opt = tmp_path / "opt"
    opt.mkdir()
    runner = f'mount --bind {opt} /opt && sh -c "$SCRIPT"{after}'
    # A guest has none of this machine's pip settings (find-links, index).
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env = dict(clean, PATH=f"{fakebin}:/usr/sbin:/usr/bin:/sbin:/bin", SCRIPT=script,
               SYSTEMCTL_LOG=str(tmp_path / "systemctl.log"))
    return subprocess.run(
        ["unshare", "--mount", "--propagation", "private", "sh", "-c", runner],
        env=env, capture_output=True, text=True, timeout=300, check=False)


def test_install_script_installs_what_the_unit_starts(tmp_path: Path) -> None:
    # A wheelhouse of this very tree and its guest closure (repacked: offline), laid out as
    # make wheelhouse lays it out, on a file: URL (a wheelhouse copied into the image).
    guest_wheelhouse(tmp_path / "w" / "linux-amd64-py3.11")
    opts = opt.Options(
        ensemble="gb200",
        namespace="gpu-jobs",
        install=opt.InstallSource("find-links", (tmp_path / "w").as_uri()),
    )
    script, sem_dir = in_scratch_sems(setup_script.render_setup_script(opts, cli.load_unit()),
                                      tmp_path)
    script = with_installer(script, opts, tmp_path)
    argv = exec_start(cli.load_unit())
    assert argv[0].startswith(setup_script.VENV + "/")
    proc = run_setup(script, tmp_path, f" && {argv[0]} --help >/dev/null")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    installed = tmp_path / "opt" / Path(argv[0]).relative_to("/opt")
    assert installed.is_file() and os.access(installed, os.X_OK)
    assert f"imex-ensemble[guest]=={version('imex-ensemble')}" in proc.stdout
    assert (tmp_path / "systemctl.log").read_text().splitlines() == [
        "daemon-reload",
        "enable imex-guest-agent.service imex-domain-ready.service",
        "restart imex-guest-agent.service",
        "cat nvidia-imex.service",
        "enable nvidia-imex.service",
        "restart nvidia-imex.service",
        "start --no-block imex-domain-ready.service",
    ]
    # committed: the next boot's bootcmd leaves cloud-init's semaphores alone
    sem = Path(setup_script.setup_sem(opts, cli.load_unit()))
    assert [p.name for p in sem_dir.iterdir()] == [sem.name]


def test_install_script_stops_at_the_first_failure(tmp_path: Path) -> None:
    """A failed install must not go on to enable a unit whose binary is missing."""
    (tmp_path / "empty" / "linux-amd64-py3.11").mkdir(parents=True)  # not even pip
    opts = opt.Options(
        ensemble="gb200",
        namespace="gpu-jobs",
        install=opt.InstallSource("find-links", (tmp_path / "empty").as_uri()),
    )
    script, sem_dir = in_scratch_sems(setup_script.render_setup_script(opts, None), tmp_path)
    proc = run_setup(with_installer(script, opts, tmp_path), tmp_path)
    assert proc.returncode != 0
    (line,) = proc.stderr.splitlines()
    assert line.startswith("imex-ensemble setup: error: the wheelhouse ") and "no pip" in line
    assert not (tmp_path / "systemctl.log").exists()  # nothing enabled
    assert list(sem_dir.iterdir()) == []  # never committed: the next boot sets up again
    assert list((tmp_path / "opt").iterdir()) == []  # nothing half-installed


BOOT_SEMS = ("config_write_files", "config_runcmd", "config_scripts_user", "config_ssh")


@pytest.mark.parametrize("state", ["committed", "never committed", "other user-data"])
def test_bootcmd_rearms_the_setup_until_it_is_committed(state: str, tmp_path: Path) -> None:
    """A guest that died before the commit gets write_files and runcmd again; others do not."""
    o = opt.Options(ensemble="gb200", namespace="gpu-jobs")
    bootcmd, sem_dir = in_scratch_sems(setup_script.render_bootcmd(o, None), tmp_path)
    for name in BOOT_SEMS:  # what cloud-init left from the first boot
        (sem_dir / name).write_text("")
    ours = Path(setup_script.setup_sem(o, None)).name
    if state == "committed":
        (sem_dir / ours).write_text("")
    elif state == "other user-data":
        other = opt.Options(ensemble="gb200", namespace="other")
        (sem_dir / Path(setup_script.setup_sem(other, None)).name).write_text("")
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


def test_bootcmd_fails_loudly_without_cloud_inits_semaphore_directory(tmp_path: Path) -> None:
    o = opt.Options(ensemble="gb200", namespace="gpu-jobs")
    bootcmd = setup_script.render_bootcmd(o, None).replace(setup_script.CLOUD_INIT_SEM_DIR,
                                                           str(tmp_path / "sem"))
    fakebin = tmp_path / "bin"
    fakebin.mkdir()
    (fakebin / "cloud-init").write_text("#!/bin/sh\necho '/usr/bin/cloud-init 25.1.4'\n")
    (fakebin / "cloud-init").chmod(0o755)
    # a python3 without cloud-init's modules: nothing can say where its semaphores are
    (fakebin / "python3").write_text("#!/bin/sh\nexit 1\n")
    (fakebin / "python3").chmod(0o755)
    proc = subprocess.run(["sh", "-c", bootcmd], capture_output=True, text=True, timeout=10,
                          env={"PATH": f"{fakebin}:/usr/bin:/bin"}, check=False)
    assert proc.returncode == 1 and proc.stdout == ""
    (line,) = proc.stderr.splitlines()
    assert line == ("imex-ensemble setup: error: no semaphore directory in cloud-init "
                    f"/usr/bin/cloud-init 25.1.4 (not {tmp_path}/sem, nor what it says: "
                    "nothing): cannot commit or redo a torn setup")
