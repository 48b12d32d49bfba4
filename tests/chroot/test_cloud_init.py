"""The generated user-data under each suite's own cloud-init (bookworm 22.4, trixie 25.x).

cloud-init really runs in the chroot, from a NoCloud seed in ``/var/lib/cloud/seed/nocloud/``:
``cloud-init init --local`` (finds the seed), ``cloud-init init`` (bootcmd, write_files),
``cloud-init modules --mode config`` and ``--mode final`` (runcmd, scripts_user). One "boot"
is those four commands in a fresh /run, as systemd runs them (or, from 24.3, as
cloud-init-main.service runs them in one process). So its module names, semaphore paths
and frequencies are its own, not ours:

* boot 1: the files land byte for byte, the installer installs from the wheelhouse, and
  cloud-init's semaphores for the setup's modules are exactly the paths our bootcmd
  removes; the setup is committed;
* a crash tears the setup (commit gone, config emptied); boot 2: the bootcmd re-arms,
  cloud-init runs write_files and runcmd again, the setup is committed again;
* boot 3 (committed): nothing re-armed, nothing reinstalled;
* a cloud-init with a ``cloud_dir`` of its own: the bootcmd and the commit ask it where
  its semaphores are, and the re-arm works there; when it cannot say, our one line and
  cloud-init's own record of a failed bootcmd, never a silent skip;
* the agent unit's ``After=`` names the unit of this cloud-init's network stage (24.3
  renamed ``cloud-init.service`` to ``cloud-init-network.service``);
* ``cloud-init single --frequency always`` (the VM tier's live re-render) is accepted.

systemctl is a recorder (no systemd in a chroot); everything else is the suite's own.
"""

from __future__ import annotations

import configparser
import re

import pytest

from guest_agent.installer import cli, guest_files, setup_script
from guest_agent.installer import options as opt
from guest_agent.installer import userdata as ci
from tests.chroot.conftest import GUESTS, ChrootFactory
from tests.chroot.sandbox import Chroot
from tests.vm.image import CLOUD_CFG

pytestmark = [pytest.mark.chroot, pytest.mark.root, pytest.mark.timeout(3600)]

SUITES = ["debian-12-amd64", "debian-13-amd64"]
TOKEN = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef"
RECORDER = """#!/bin/sh
echo "$*" >> /var/log/systemctl.log
[ "$1" = cat ] && exit 1   # no nvidia-imex.service in this root
exit 0
"""
STAGES = ("cloud-init init --local", "cloud-init init", "cloud-init modules --mode config",
          "cloud-init modules --mode final")


def options(**kw: object) -> opt.Options:
    base: dict[str, object] = {
        "ensemble": "gb200", "namespace": "gpu-jobs", "token": TOKEN,
        "registry_url": "http://10.77.0.1:8080",
        "install": opt.InstallSource("find-links", "file:///wheelhouse/")}
    base.update(kw)
    return opt.Options(**base)  # type: ignore[arg-type]


def prepare(c: Chroot, opts: opt.Options, extra_cfg: str = "",
            cloud_dir: str = "/var/lib/cloud") -> str:
    user_data = ci.render_user_data(opts, cli.load_unit())
    seed = c.path(f"{cloud_dir}/seed/nocloud")
    seed.mkdir(parents=True)
    (seed / "user-data").write_text(user_data)
    (seed / "meta-data").write_text("instance-id: gb200-0-disk1\nlocal-hostname: gb200-0\n")
    cfg = c.path("/etc/cloud/cloud.cfg.d/90-imex-chroot.cfg")
    cfg.parent.mkdir(parents=True, exist_ok=True)
    cfg.write_text(CLOUD_CFG + extra_cfg)
    rec = c.path("/usr/local/sbin/systemctl")
    rec.parent.mkdir(parents=True, exist_ok=True)
    rec.write_text(RECORDER)
    rec.chmod(0o755)
    return user_data


def boot(c: Chroot) -> str:
    """One boot's cloud-init stages; their console output (stdout and stderr)."""
    out = []
    for stage in STAGES:
        p = c.sh(stage, timeout=1800)
        out.append(f"== {stage}: exit {p.returncode}\n{p.stdout}{p.stderr}")
    return "\n".join(out)


def sems(c: Chroot, sem_dir: str = setup_script.CLOUD_INIT_SEM_DIR) -> set[str]:
    """The semaphore files, listed inside (``instance`` is a symlink cloud-init made)."""
    p = c.sh(f"ls -1 {sem_dir}/")
    return set(p.stdout.split()) if p.returncode == 0 else set()


@pytest.mark.parametrize("gid", SUITES)
def test_setup_runs_and_is_redone_after_a_torn_boot_by_this_cloud_init(
        chroot: ChrootFactory, gid: str) -> None:
    c = chroot(GUESTS[gid], name="gb200-0")
    opts = options()
    prepare(c, opts)
    ours = setup_script.setup_sem(opts, cli.load_unit()).rpartition("/")[2]
    setup = {f"config_{m}" for m in setup_script.SETUP_MODULES}

    log1 = boot(c)
    for f in guest_files.render_files(opts, cli.load_unit()):
        assert c.path(f.path).read_bytes() == f.content, f"{gid}: {f.path}\n{log1[-3000:]}"
        assert oct(c.path(f.path).stat().st_mode & 0o777) == oct(int(f.permissions, 8))
    output = c.read("/var/log/cloud-init-output.log")
    assert output.count("imex-ensemble setup: installed imex-ensemble[guest]") == 1, log1[-4000:]
    assert "linux-amd64-py" in output
    first = sems(c)
    assert setup | {ours} <= first, f"{gid}: semaphores {sorted(first)}"
    assert c.read("/var/log/systemctl.log").splitlines()[:2] == [
        "daemon-reload", "enable imex-guest-agent.service imex-domain-ready.service"]

    # a crash in the first minutes: the commit never reached the disk, the config is empty
    c.check(f"rm {setup_script.CLOUD_INIT_SEM_DIR}/{ours} && : > {guest_files.CONFIG_PATH}")
    log2 = boot(c)
    assert all(f"{setup_script.CLOUD_INIT_SEM_DIR}/{s}" in log2 for s in setup), log2[-4000:]
    assert c.path(guest_files.CONFIG_PATH).read_text() == guest_files.render_agent_config(opts)
    output = c.read("/var/log/cloud-init-output.log")
    assert output.count("imex-ensemble setup: installed imex-ensemble[guest]") == 2
    assert ours in sems(c)

    # committed: the next boot leaves the setup alone
    log3 = boot(c)
    assert "config_write_files" not in log3.split("== cloud-init modules")[0]
    output = c.read("/var/log/cloud-init-output.log")
    assert output.count("imex-ensemble setup: installed imex-ensemble[guest]") == 2
    assert setup | {ours} <= sems(c)


ELSEWHERE = "system_info:\n  paths:\n    cloud_dir: /srv/cloud/\n"


@pytest.mark.parametrize("gid", SUITES)
def test_a_cloud_dir_of_its_own_is_asked_of_this_cloud_init(chroot: ChrootFactory,
                                                            gid: str) -> None:
    """Semaphores under another cloud_dir: the bootcmd and the commit ask cloud-init."""
    c = chroot(GUESTS[gid], name="gb200-0")
    opts = options()
    prepare(c, opts, ELSEWHERE, cloud_dir="/srv/cloud")
    ours = setup_script.setup_sem(opts, cli.load_unit()).rpartition("/")[2]
    boot(c)
    here = "/srv/cloud/instance/sem"
    assert {ours, "config_write_files", "config_runcmd", "config_scripts_user"} <= sems(c, here)
    assert not sems(c)  # nothing at the default place
    c.check(f"rm {here}/{ours} && : > {guest_files.CONFIG_PATH}")
    log = boot(c)
    assert f"removed '{here}/config_write_files'" in log, log[-3000:]
    assert c.path(guest_files.CONFIG_PATH).read_text() == guest_files.render_agent_config(opts)
    assert ours in sems(c, here)


@pytest.mark.parametrize("gid", SUITES)
def test_no_semaphore_directory_is_a_loud_failure_in_cloud_inits_own_log(
        chroot: ChrootFactory, gid: str) -> None:
    """cloud-init's semaphores elsewhere and its python cannot be asked: never a silent
    skip. (A python3 on PATH without cloud-init's modules stands for internals that
    changed; cloud-init itself runs on its own /usr/bin/python3.)"""
    c = chroot(GUESTS[gid], name="gb200-0")
    prepare(c, options(), ELSEWHERE, cloud_dir="/srv/cloud")
    stub = c.path("/usr/local/bin/python3")
    stub.parent.mkdir(parents=True, exist_ok=True)
    stub.write_text("#!/bin/sh\nexit 1\n")
    stub.chmod(0o755)
    log = boot(c)
    version = c.check("cloud-init --version 2>&1").strip()
    line = (f"imex-ensemble setup: error: no semaphore directory in cloud-init {version} "
            f"(not {setup_script.CLOUD_INIT_SEM_DIR}, nor what it says: nothing): cannot commit or "
            "redo a torn setup")
    assert line in log, log[-4000:]
    assert line in c.read("/var/log/cloud-init-output.log")
    cloud_log = c.read("/var/log/cloud-init.log")
    assert "Failed to run bootcmd module bootcmd" in cloud_log, cloud_log[-3000:]
    assert re.search(r"Running module bootcmd .* failed", cloud_log)
    assert sems(c, "/srv/cloud/instance/sem"), "cloud-init kept its semaphores elsewhere"


@pytest.mark.parametrize("gid", SUITES)
def test_agent_unit_orders_after_this_cloud_inits_network_stage(chroot: ChrootFactory,
                                                                gid: str) -> None:
    c = chroot(GUESTS[gid])
    units = set(c.check("ls /usr/lib/systemd/system/ /lib/systemd/system/ 2>/dev/null "
                        "| grep '^cloud-' | sort -u").split())
    cp = configparser.ConfigParser(strict=False, interpolation=None)
    cp.read_string(cli.load_unit())
    after = set(cp["Unit"]["After"].split())
    stage = "cloud-init-network.service" if gid == "debian-13-amd64" else "cloud-init.service"
    assert stage in units and stage in after, sorted(units)
    text = c.read(f"/usr/lib/systemd/system/{stage}")
    assert re.search(r"(?i)network", text), text  # the stage whose modules edit /etc/hosts
    missing = {u for u in after if u.startswith("cloud-")} - units
    # the other name simply does not exist there: systemd ignores ordering against it
    assert len(missing) == 1, missing


@pytest.mark.parametrize("gid", SUITES)
def test_single_module_with_frequency_always_is_accepted(chroot: ChrootFactory,
                                                         gid: str) -> None:
    c = chroot(GUESTS[gid], name="gb200-0")
    prepare(c, options(install=opt.InstallSource("preinstalled")))
    c.sh(STAGES[0], timeout=900)
    p = c.sh("cloud-init single --name update_etc_hosts --frequency always", timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    print(f"\n{gid}: {c.check('cloud-init --version 2>&1').strip()}")
