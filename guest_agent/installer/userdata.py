"""``imex-guest-agent cloudinit``: user-data that turns a fresh VM into an ensemble member.

The output is ``#cloud-config`` that (in cloud-init's own module order):
``bootcmd`` (every boot) re-arms the two modules below until their work is
committed to disk (see :func:`render_setup_script`); ``write_files`` (init
stage, before the network is up) writes the agent's config and token, IMEX's
``config.cfg`` and the first ``nodes_config.cfg``; ``runcmd`` (final stage,
network up) installs the agent into a venv, enables its unit (ordered before
``nvidia-imex.service``), commits, starts the agent and restarts IMEX once so
it reads the files written above instead of whatever it found at image boot. In
names mode the nodes file is final from the first boot (it depends only on
the ensemble); in ips mode it starts with every slot absent and the agent
rewrites it.

Deliberately *not* in the output: ``manage_etc_hosts`` is set to false
(cloud-init would re-render the whole ``/etc/hosts`` on every boot and wipe
the agent's block) and nothing touches ``resolv.conf`` (KubeVirt's DHCP hands
the guest the cluster DNS servers and search path; slot names never reach DNS
because the agent pins every slot in ``/etc/hosts``).

KubeVirt refuses inline ``userData`` over 2048 bytes, so when the user-data is
larger (or ``--output-secret`` is given) the generator prints a Secret with
key ``userdata`` for ``cloudInitNoCloud.secretRef`` instead, and says so on
stderr.

Standard library only (YAML is emitted by :mod:`guest_agent.installer.cloudyaml`). The
pure ``render_*`` functions do all the work; the command line
(:mod:`guest_agent.installer.cli`) reads files and prints.

Where other parts add to the user-data: a new file goes into
:func:`render_files` (its bytes join the setup digest, so a change re-arms the
setup), an IMEX setting into :func:`render_imex_config`, a command into
:func:`_install_lines` (before the commit) or ``_Setup.script`` (after it),
a flag into ``Options`` and :mod:`guest_agent.installer.cli`.
"""

from __future__ import annotations

import functools
import hashlib
import re
import shlex
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from typing import Final, Literal
from urllib.parse import urlsplit

from guest_agent.config import ConfigError, Settings, settings_from_mapping
from guest_agent.installer.cloudyaml import (
    WriteFile,
    block_safe,
    literal_item,
    render_write_files,
    yaml_quote,
)
from guest_agent.tls.imex_config import imex_tls_settings
from imex_shared.model import DEFAULT_MAX_MEMBERS, DEFAULT_PORT, EnsembleId
from imex_shared.render import render_nodes_config

#: KubeVirt's limit for inline ``cloudInitNoCloud.userData`` (bytes).
INLINE_USERDATA_LIMIT: Final = 2048

CONFIG_PATH: Final = "/etc/imex-guest-agent/config.toml"
TOKEN_PATH: Final = "/etc/imex-guest-agent/token"
IMEX_CONFIG_PATH: Final = "/etc/nvidia-imex/config.cfg"
NODES_CONFIG_PATH: Final = "/etc/nvidia-imex/nodes_config.cfg"
UNIT_NAME: Final = "imex-guest-agent.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT_NAME}"
UNIT_RESOURCE: Final = "data/imex-guest-agent.service"
VENV: Final = "/opt/imex-guest-agent"
#: where cloud-init writes the installer (guest_agent/installer/bootstrap.py, verbatim)
INSTALLER_PATH: Final = "/var/lib/imex-guest-agent/install.py"
INSTALLER_RESOURCE: Final = "bootstrap.py"
DISTRIBUTION: Final = "imex-ensemble"
IMEX_UNIT: Final = "nvidia-imex.service"
DEFAULT_IMEX_CMD_PORT: Final = 50005
SECRET_KEY: Final = "userdata"
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

InstallKind = Literal["pip-index", "wheel", "find-links", "preinstalled"]
_URL_KINDS: Final[dict[str, InstallKind]] = {
    "pip-index": "pip-index",
    "wheel": "wheel",
    "find-links": "find-links",
}

# RFC 6750 b64token: what an Authorization: Bearer header can carry verbatim.
_TOKEN = re.compile(r"^[A-Za-z0-9\-._~+/]+=*$")
# A PEP 508 name with optional extras, then an optional version spec.
_REQUIREMENT = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*(\[[A-Za-z0-9._,-]*\])?)([<>=!~][ -~]*)?$")
_K8S_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")


class CloudInitError(ValueError):
    """Bad generator input; the message names the flag and what is wrong."""


@dataclass(frozen=True, slots=True)
class InstallSource:
    """Where the guest gets the agent: a package index, a wheel, a wheelhouse, or the image."""

    kind: InstallKind
    url: str | None = None

    def __post_init__(self) -> None:
        if (self.kind == "preinstalled") != (self.url is None):
            raise CloudInitError(
                f"install source {self.kind!r}: a URL is needed for every "
                "kind but preinstalled, and only there"
            )

    @classmethod
    def parse(cls, text: str) -> InstallSource:
        if text == "preinstalled":
            return cls("preinstalled")
        name, _, url = text.partition(":")
        kind = _URL_KINDS.get(name)
        if kind is None or not url:
            raise CloudInitError(
                f"--install {text!r}: expected pip-index:URL, wheel:URL, find-links:URL "
                "or preinstalled"
            )
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https", "file") or not (parts.netloc or parts.path):
            raise CloudInitError(f"--install {text!r}: {url!r} is not an http(s) or file URL")
        if not _printable_ascii(url):
            raise CloudInitError(
                f"--install {text!r}: the URL must be printable ASCII without spaces "
                "(percent-encode anything else)"
            )
        return cls(kind, url)


@dataclass(frozen=True, slots=True)
class Options:
    """Everything the generator needs; ``options_from_args`` builds it from the flags."""

    ensemble: str
    namespace: str
    max_members: int = DEFAULT_MAX_MEMBERS
    cluster_domain: str | None = None
    registry_url: str | None = None
    token: str | None = None
    install: InstallSource = InstallSource("preinstalled")
    package: str | None = None
    mode: Literal["names", "ips"] = "names"
    imex_port: int = DEFAULT_PORT
    imex_cmd_port: int = DEFAULT_IMEX_CMD_PORT
    wait_for_quorum: Literal["RECOVERY", "NONE"] = "RECOVERY"
    own_slot: Literal["auto", "published", "local"] = "auto"
    nameservers: tuple[str, ...] = ()
    restart_imex: bool = True
    output_secret: str | None = None
    raw: bool = False
    #: IMEX mutual TLS (issue 19): the config keys, and the CA fingerprint guests pin.
    auth_encryption: bool = False
    ca_sha256: str | None = None

    @property
    def ens(self) -> EnsembleId:
        return EnsembleId(self.namespace, self.ensemble)


@dataclass(frozen=True, slots=True)
class Generated:
    """The generator's result: what to print, whether it is a Secret, notes for stderr."""

    text: str
    user_data: str
    is_secret: bool
    notes: tuple[str, ...]



# ---------------------------------------------------------------------------
# The files.


def _toml_value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        out = ['"']
        for ch in value:
            code = ord(ch)
            if ch in '"\\':
                out.append("\\" + ch)
            elif code < 0x20 or code == 0x7F:
                out.append(f"\\u{code:04X}")
            else:
                out.append(ch)
        out.append('"')
        return "".join(out)
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} as TOML")


def agent_config(opts: Options) -> dict[str, object]:
    """The agent config keys this ensemble needs (defaults left out, so the agent's own apply)."""
    raw: dict[str, object] = {"ensemble": opts.ensemble, "namespace": opts.namespace}
    if opts.cluster_domain is not None:
        raw["cluster_domain"] = opts.cluster_domain
    raw["max_members"] = opts.max_members
    raw["port"] = opts.imex_port
    raw["mode"] = opts.mode
    raw["own_slot"] = opts.own_slot
    if opts.registry_url is not None:
        raw["registry_url"] = opts.registry_url
    if opts.token is not None:
        raw["token_file"] = TOKEN_PATH
    if opts.nameservers:
        raw["nameservers"] = list(opts.nameservers)
    if opts.auth_encryption:
        raw["auth_encryption"] = True
        raw["ca_sha256"] = opts.ca_sha256
    return raw


def render_agent_config(opts: Options) -> str:
    """``config.toml`` text; loads back through the agent's own validator or raises."""
    raw = agent_config(opts)
    text = f"# imex-guest-agent config for ensemble {opts.ens.key} (written by cloud-init)\n"
    text += "".join(f"{key} = {_toml_value(value)}\n" for key, value in raw.items())
    check_agent_config(text)
    return text


def check_agent_config(text: str) -> Settings:
    """Load ``text`` exactly as the agent will; CloudInitError names the bad key."""
    try:
        return settings_from_mapping(tomllib.loads(text), CONFIG_PATH)
    except (tomllib.TOMLDecodeError, ConfigError) as exc:
        raise CloudInitError(f"the generated agent config would be refused: {exc}") from exc


def render_imex_config(opts: Options) -> str:
    """IMEX's ``config.cfg``. BIND_INTERFACE_IP stays empty: IMEX finds itself in the nodes file."""
    return (
        f"# nvidia-imex config for ensemble {opts.ens.key} (written by cloud-init)\n"
        "DAEMONIZE=1\n"
        "LOG_FILE_NAME=/var/log/nvidia-imex.log\n"
        "LOG_LEVEL=4\n"
        f"SERVER_PORT={opts.imex_port}\n"
        f"IMEX_NODE_CONFIG_FILE={NODES_CONFIG_PATH}\n"
        "BIND_INTERFACE_IP=\n"
        "IMEX_CMD_ENABLED=1\n"
        f"IMEX_CMD_PORT={opts.imex_cmd_port}\n"
        "IMEX_CMD_BIND_INTERFACE_IP=\n"
        f"IMEX_WAIT_FOR_QUORUM={opts.wait_for_quorum}\n"
        + (_tls_lines() if opts.auth_encryption else "")
    )


def _tls_lines() -> str:
    """The TLS keys, from the one list the agent also asserts (guest_agent/tls/imex_config.py)."""
    return "".join(f"{k}={v}\n" for k, v in imex_tls_settings())


def render_files(opts: Options, unit: str | None) -> list[WriteFile]:
    """Every file cloud-init writes, in write order (``unit`` None: the image has it)."""
    ens = opts.ens
    files = [WriteFile(CONFIG_PATH, render_agent_config(opts).encode())]
    if opts.token is not None:
        files.append(WriteFile(TOKEN_PATH, opts.token.encode(), "0600"))
    files.append(WriteFile(IMEX_CONFIG_PATH, render_imex_config(opts).encode()))
    files.append(
        WriteFile(NODES_CONFIG_PATH, render_nodes_config(ens, opts.max_members, opts.mode, {}))
    )
    if opts.install.url is not None:
        files.append(WriteFile(INSTALLER_PATH, installer_source().encode()))
    if unit is not None:
        files.append(WriteFile(UNIT_PATH, unit.encode()))
    return files


@functools.cache
def installer_source() -> str:
    """The installer cloud-init writes: guest_agent/installer/bootstrap.py, byte for byte.

    Read from this package (the same file in a checkout, a wheel or a zip), so what runs on
    the guest is exactly the module the tests import."""
    return resources.files("guest_agent.installer").joinpath(INSTALLER_RESOURCE).read_text("utf-8")


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
    m = _REQUIREMENT.match(package_requirement(opts))
    return m.group(1) if m else f"{DISTRIBUTION}[guest]"


def _printable_ascii(text: str) -> bool:
    return all(0x21 <= ord(c) <= 0x7E for c in text)


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
    lines.append(f"systemctl enable {UNIT_NAME}")
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
    return _Setup.of(opts, unit).script(opts)


def setup_sem(opts: Options, unit: str | None) -> str:
    """The path of the semaphore that says this user-data's setup is on disk."""
    return _Setup.of(opts, unit).sem


def render_bootcmd(opts: Options, unit: str | None) -> str:
    """The bootcmd (every boot, read from the seed): re-arm the setup until it is on disk.

    ``write_files`` and ``runcmd`` run once per instance, so a VM that comes
    back (same disk, same instance-id) would keep a half-written install for
    good. Removing their semaphores makes cloud-init run them again in this
    boot. A no-op once our semaphore for this user-data exists, and on the
    first boot (no semaphores yet); a changed user-data (new digest) is set up
    again at the next boot."""
    return _Setup.of(opts, unit).bootcmd()


@dataclass(frozen=True, slots=True)
class _Setup:
    """One user-data's setup, rendered once: its files, install lines and semaphore."""

    files: list[WriteFile]
    install: list[str]
    sem: str

    @classmethod
    def of(cls, opts: Options, unit: str | None) -> _Setup:
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


def render_user_data(opts: Options, unit: str | None) -> str:
    """The whole ``#cloud-config`` document."""
    setup = _Setup.of(opts, unit)
    lines = [
        "#cloud-config",
        f"# imex-ensemble {opts.ens.key}; /etc/hosts is the agent's, not cloud-init's",
        "manage_etc_hosts: false",
        "bootcmd:",
        *literal_item(setup.bootcmd()),
        *render_write_files(setup.files),
        "runcmd:",
        *literal_item(setup.script(opts)),
    ]
    return "\n".join(lines) + "\n"


def render_secret(name: str, opts: Options, user_data: str) -> str:
    """A Secret holding ``user_data`` under key ``userdata`` (``cloudInitNoCloud.secretRef``)."""
    if not block_safe(user_data):
        raise CloudInitError("user-data cannot be put into a Secret as text")  # never: we wrote it
    body = user_data[:-1] if user_data.endswith("\n") else user_data
    chomp = "" if user_data.endswith("\n") else "-"
    lines = [
        "# Generated by imex-guest-agent cloudinit"
        + (". Holds the ensemble token: keep it a Secret." if opts.token is not None else "."),
        "apiVersion: v1",
        "kind: Secret",
        "metadata:",
        f"  name: {yaml_quote(name)}",
        f"  namespace: {yaml_quote(opts.namespace)}",
        "  labels:",
        f"    imex-ensemble.io/ensemble: {yaml_quote(opts.ensemble)}",
        "type: Opaque",
        "stringData:",
        f"  {SECRET_KEY}: |{chomp}",
    ]
    lines += [f"    {line}" if line else "" for line in body.split("\n")]
    return "\n".join(lines) + "\n"


def token_sha256(token: str) -> str:
    """What the ensemble Service's ``imex-ensemble.io/token-sha256`` annotation must say."""
    return hashlib.sha256(token.encode()).hexdigest()


def generate(opts: Options, unit: str | None) -> Generated:
    """User-data, or a Secret wrapping it when inline would be too big or was not asked for."""
    user_data = render_user_data(opts, unit)
    size = len(user_data.encode())
    notes: list[str] = []
    secret_name = opts.output_secret
    if secret_name is None and size > INLINE_USERDATA_LIMIT and not opts.raw:
        secret_name = f"{opts.ensemble}-userdata"
        notes.append(
            f"user-data is {size} bytes, over KubeVirt's {INLINE_USERDATA_LIMIT}-byte inline "
            f"limit: printing Secret {opts.namespace}/{secret_name} (key {SECRET_KEY!r}) for "
            f"cloudInitNoCloud.secretRef instead"
        )
    elif secret_name is not None:
        notes.append(
            f"printing Secret {opts.namespace}/{secret_name} (key {SECRET_KEY!r}, user-data "
            f"{size} bytes) for cloudInitNoCloud.secretRef"
        )
    elif size > INLINE_USERDATA_LIMIT:
        notes.append(
            f"user-data is {size} bytes: too big for inline userData "
            f"({INLINE_USERDATA_LIMIT}); put it into a Secret yourself"
        )
    else:
        notes.append(f"user-data is {size} bytes (inline userData holds {INLINE_USERDATA_LIMIT})")
    if opts.token is not None:
        notes.append(
            f"annotate the ensemble Service: imex-ensemble.io/token-sha256: "
            f"{token_sha256(opts.token)}"
        )
    elif opts.registry_url is not None:
        notes.append("no --token: the registry will refuse this guest's status reports")
    if opts.imex_port != DEFAULT_PORT:
        notes.append(f"annotate the ensemble Service: imex-ensemble.io/port: '{opts.imex_port}'")
    if secret_name is None:
        return Generated(user_data, user_data, False, tuple(notes))
    return Generated(render_secret(secret_name, opts, user_data), user_data, True, tuple(notes))



__all__ = [
    "INLINE_USERDATA_LIMIT",
    "CloudInitError",
    "Generated",
    "InstallSource",
    "Options",
    "WriteFile",
    "agent_config",
    "generate",
    "installer_source",
    "render_files",
    "render_secret",
    "render_user_data",
    "render_write_files",
    "token_sha256",
    "yaml_quote",
]
