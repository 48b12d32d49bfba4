"""The setup script: install the agent, commit, start it; and the re-arm until committed.

``runcmd`` (final stage, network up) runs :func:`render_setup_script`: it installs the
agent into a venv with the installer (:mod:`guest_agent.installer.bootstrap`, run by the
image's ``python3``), enables its unit (ordered before ``nvidia-imex.service``),
commits, starts the agent and restarts IMEX once so it reads the files cloud-init wrote
instead of whatever it found at image boot. ``bootcmd`` (every boot) runs
:func:`render_bootcmd`: until the setup is committed to disk it has cloud-init run the
whole setup again. One setup is named by a digest of the files and the install
commands (:func:`setup_digest`), so a changed user-data is set up again too.

A command goes into :func:`_install_lines` (before the commit) or ``Setup.script``
(after it).
"""

from __future__ import annotations

import hashlib
import shlex
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata
from typing import Final

from guest_agent.installer.cloudyaml import WriteFile, render_write_files
from guest_agent.installer.guest_files import (
    INSTALLER_PATH,
    READY_UNIT_NAME,
    UNIT_NAME,
    render_files,
)
from guest_agent.installer.options import REQUIREMENT_PATTERN, Options

VENV: Final = "/opt/imex-guest-agent"
DISTRIBUTION: Final = "imex-ensemble"
IMEX_UNIT: Final = "nvidia-imex.service"
#: cloud-init's per-instance semaphores: ``config_<module>`` (module name, ``-`` as ``_``),
#: under its default ``cloud_dir`` (checked on 22.4 and 25.1 in tests/chroot).
CLOUD_INIT_SEM_DIR: Final = "/var/lib/cloud/instance/sem"
#: asks the guest's own cloud-init where its semaphores are, when not at the default (a
#: ``system_info.paths.cloud_dir`` of its own); the same internals on 22.4 and 25.1
SEM_DIR_PROBE: Final = (
    "from cloudinit.stages import Init;i=Init();i.read_cfg();"
    "print(i.paths.get_ipath_cur('sem'))"
)
#: The modules that carry the setup: write_files, runcmd (writes the script),
#: scripts_user (runs it).
SETUP_MODULES: Final = ("write_files", "runcmd", "scripts_user")
#: Our own semaphore beside cloud-init's: ``<prefix><digest>`` exists once that setup is on
#: disk. Per instance like theirs, and gone with them on ``cloud-init clean``.
SETUP_SEM_PREFIX: Final = "imex_ensemble_setup_"
SETUP_DIGEST_CHARS: Final = 16


def package_requirement(opts: Options) -> str:
    """The pip requirement: the guest extra, pinned to this generator's version."""
    if opts.package is not None:
        return opts.package
    try:
        return f"{DISTRIBUTION}[guest]=={metadata.version(DISTRIBUTION)}"
    except metadata.PackageNotFoundError:
        return f"{DISTRIBUTION}[guest]"


def requirement_name(opts: Options) -> str:
    """The requirement without its version spec: ``imex-ensemble[guest]``."""
    m = REQUIREMENT_PATTERN.match(package_requirement(opts))
    return m.group(1) if m else f"{DISTRIBUTION}[guest]"


def _install_lines(opts: Options) -> list[str]:
    """Install the agent from scratch and enable the units; nothing is started yet.

    The installer (:mod:`guest_agent.installer.bootstrap`, run by the image's ``python3``) picks the
    interpreter, creates the venv without pip, runs pip from its own wheel and removes the
    venv on any failure: a re-run after a crash never keeps files that pip considers
    installed but that never reached the disk. It fails with one line naming what is
    wrong, and ``set -e`` stops the script before the commit."""
    q = shlex.quote
    src = opts.install
    lines = ["set -eu"]
    if src.url is not None:
        if src.kind == "wheel":
            # A direct reference names the project and extras, never a version.
            source, req = "--wheel", f"{requirement_name(opts)} @ {src.url}"
        else:
            source = "--find-links" if src.kind == "find-links" else "--index-url"
            req = package_requirement(opts)
        lines.append(f"python3 {INSTALLER_PATH} {source} {q(src.url)} "
                     f"--requirement {q(req)} --venv {VENV}")
    lines.append("systemctl daemon-reload")
    lines.append(f"systemctl enable {UNIT_NAME} {READY_UNIT_NAME}")
    return lines


def setup_digest(files: Sequence[WriteFile], install: Sequence[str]) -> str:
    """Names one setup: the files cloud-init writes and the install commands."""
    h = hashlib.sha256()
    for line in [*render_write_files(files), *install]:
        h.update(line.encode() + b"\n")
    return h.hexdigest()[:SETUP_DIGEST_CHARS]


def render_setup_script(opts: Options, unit: str | None) -> str:
    """The runcmd shell script: install, commit, (re)start the agent, restart IMEX once.

    Stops at the first failure. The commit is ``sync``, creating our semaphore
    (:func:`setup_sem`), ``sync``: the semaphore is on disk only if everything
    before it is. Until it is, the bootcmd (:func:`render_bootcmd`) has
    cloud-init run the whole setup again at the next boot, which a guest killed
    in its first minutes needs: cloud-init does not fsync, and ext4 can leave
    just-written files empty after a crash (seen in tests/vm)."""
    return Setup.of(opts, unit).script(opts)


def setup_sem(opts: Options, unit: str | None) -> str:
    """The path of the semaphore that says this user-data's setup is on disk."""
    return Setup.of(opts, unit).sem


def render_bootcmd(opts: Options, unit: str | None) -> str:
    """The bootcmd (every boot, read from the seed): re-arm the setup until it is on disk.

    ``write_files`` and ``runcmd`` run once per instance, so a VM that comes
    back (same disk, same instance-id) would keep a half-written install for
    good. Removing their semaphores makes cloud-init run them again in this
    boot. A no-op once our semaphore for this user-data exists, and on the
    first boot (no semaphores yet); a changed user-data (new digest) is set up
    again at the next boot."""
    return Setup.of(opts, unit).bootcmd()


@dataclass(frozen=True, slots=True)
class Setup:
    """One user-data's setup, rendered once: its files, install lines and semaphore."""

    files: list[WriteFile]
    install: list[str]
    sem: str

    @classmethod
    def of(cls, opts: Options, unit: str | None) -> Setup:
        files, install = render_files(opts, unit), _install_lines(opts)
        return cls(files, install,
                   f"{CLOUD_INIT_SEM_DIR}/{SETUP_SEM_PREFIX}{setup_digest(files, install)}")

    @property
    def sem_name(self) -> str:
        return self.sem.rpartition("/")[2]

    def script(self, opts: Options) -> str:
        # where to commit, checked before anything is installed
        lines = [
            *self.install[:1],
            *_sem_dir_lines(),
            *self.install[1:],
            f"sync; touch $imex_sem/{self.sem_name}; sync",
            # restart, not start: on a re-run an old agent may be running from the
            # venv just replaced. Type=notify: this returns once the files are written.
            f"systemctl restart {UNIT_NAME}",
        ]
        if opts.restart_imex:
            # IMEX reads config.cfg and the nodes file only at start; it may have
            # started from the image before write_files ran.
            lines.append(
                f"if systemctl cat {IMEX_UNIT} >/dev/null 2>&1; then "
                f"systemctl enable {IMEX_UNIT}; systemctl restart {IMEX_UNIT}; fi"
            )
        # enabled above, too late for this boot's multi-user.target: start the barrier
        # now, without waiting for it (it waits for the whole domain)
        lines.append(f"systemctl start --no-block {READY_UNIT_NAME}")
        return "".join(f"{line}\n" for line in lines)

    def bootcmd(self) -> str:
        sems = " ".join(f"$imex_sem/config_{m}" for m in SETUP_MODULES)
        lines = [*_sem_dir_lines(), f"[ -e $imex_sem/{self.sem_name} ] || rm -fv {sems}"]
        return "".join(f"{line}\n" for line in lines)


def _sem_dir_lines() -> list[str]:
    """``imex_sem`` := cloud-init's semaphore directory, or one error line and exit 1.

    The default first; else what this guest's cloud-init says (its own ``cloud_dir``).
    Never a silent skip: a setup that cannot be re-armed or committed says so, and
    cloud-init records the failed bootcmd or runcmd. One shell script holds every bootcmd
    item, so the variable name is ours alone."""
    return [
        f"imex_sem={CLOUD_INIT_SEM_DIR}",
        f'[ -d $imex_sem ] || imex_sem=$(python3 -c "{SEM_DIR_PROBE}" 2>/dev/null) &&'
        ' [ -d "$imex_sem" ] || { echo "imex-ensemble setup: error: no semaphore directory'
        f' in cloud-init $(cloud-init --version 2>&1) (not {CLOUD_INIT_SEM_DIR},'
        ' nor what it says: ${imex_sem:-nothing}): cannot commit or redo a torn setup" >&2;'
        " exit 1; }",
    ]
