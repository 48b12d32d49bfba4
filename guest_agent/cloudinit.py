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

Standard library only: the guest package installs without PyYAML, so YAML is
emitted by hand. Every scalar we did not write ourselves is double-quoted with
YAML escapes, and file contents go into literal block scalars only when that
is provably lossless (else base64), so what cloud-init writes is exactly the
bytes rendered here. The pure ``render_*`` functions do all the work; only
``main`` reads files and prints.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import re
import shlex
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import metadata, resources
from pathlib import Path
from typing import Final, Literal
from urllib.parse import urlsplit

from guest_agent.config import ConfigError, Settings, parse_nameserver, settings_from_mapping
from guest_agent.from_ensemble import (
    FromEnsembleError,
    apply_to_flags,
    load_document,
    settings_from_object,
)
from guest_agent.model import DEFAULT_MAX_MEMBERS, DEFAULT_PORT, EnsembleId, ModelError
from guest_agent.render import render_nodes_config
from guest_agent.tlsconfig import imex_tls_settings

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
DISTRIBUTION: Final = "imex-ensemble"
IMEX_UNIT: Final = "nvidia-imex.service"
DEFAULT_IMEX_CMD_PORT: Final = 50005
SECRET_KEY: Final = "userdata"
#: cloud-init's per-instance semaphores: ``config_<module>`` (module name, ``-`` as ``_``).
CLOUD_INIT_SEM_DIR: Final = "/var/lib/cloud/instance/sem"
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
class WriteFile:
    """One ``write_files`` entry: exact bytes and octal permissions."""

    path: str
    content: bytes
    permissions: str = "0644"


@dataclass(frozen=True, slots=True)
class Generated:
    """The generator's result: what to print, whether it is a Secret, notes for stderr."""

    text: str
    user_data: str
    is_secret: bool
    notes: tuple[str, ...]


# ---------------------------------------------------------------------------
# YAML emission (the subset we need, exact).


def yaml_quote(text: str) -> str:
    """A YAML double-quoted scalar that loads back to exactly ``text``.

    Printable characters stay as they are; ``"`` and ``\\`` and everything
    YAML 1.1 does not allow raw in a stream (C0/C1 controls, DEL, surrogates,
    U+FFFE/FFFF) are escaped, so PyYAML (cloud-init's parser) reads it back
    unchanged.
    """
    out = ['"']
    for ch in text:
        code = ord(ch)
        if ch == '"':
            out.append('\\"')
        elif ch == "\\":
            out.append("\\\\")
        elif ch == "\n":
            out.append("\\n")
        elif ch == "\t":
            out.append("\\t")
        elif _yaml_printable(code):
            out.append(ch)
        elif code <= 0xFF:
            out.append(f"\\x{code:02x}")
        elif code <= 0xFFFF:
            out.append(f"\\u{code:04x}")
        else:
            out.append(f"\\U{code:08x}")
    out.append('"')
    return "".join(out)


def _yaml_printable(code: int) -> bool:
    # YAML 1.1 c-printable, minus NEL and U+2028/2029, which PyYAML treats as
    # line breaks (and would fold), and minus the byte-order mark.
    return (
        0x20 <= code <= 0x7E
        or (0xA0 <= code <= 0xD7FF and code not in (0x2028, 0x2029))
        or (0xE000 <= code <= 0xFFFD and code != 0xFEFF)
        or 0x10000 <= code <= 0x10FFFF
    )


def _block_safe(text: str) -> bool:
    """True when a literal block scalar reproduces ``text`` exactly.

    Refused (the caller falls back to base64): empty text, a first line that
    starts with a space (it would set the indentation), carriage returns and
    anything not plainly printable, and text ending in several newlines
    (keep-chomping works but is easy to get wrong in review).
    """
    if not text or text[0] in " \t\n" or text.endswith("\n\n"):
        return False
    return all(ch in "\n\t" or _yaml_printable(ord(ch)) for ch in text)


def _content_lines(content: bytes, indent: str) -> list[str]:
    """``content:`` (and ``encoding:`` when needed) lines of one write_files entry."""
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    if text is not None and "\n" not in text and "\r" not in text:
        return [f"{indent}content: {yaml_quote(text)}"]
    if text is not None and _block_safe(text):
        chomp = "" if text.endswith("\n") else "-"
        body = text[:-1] if text.endswith("\n") else text
        lines = [f"{indent}content: |{chomp}"]
        lines += [f"{indent}  {line}" if line else "" for line in body.split("\n")]
        return lines
    return [
        f"{indent}encoding: b64",
        f"{indent}content: {base64.b64encode(content).decode('ascii')}",
    ]


def render_write_files(files: Sequence[WriteFile]) -> list[str]:
    lines = ["write_files:"]
    for f in files:
        lines.append(f"  - path: {yaml_quote(f.path)}")
        lines.append(f"    permissions: {yaml_quote(f.permissions)}")
        lines += _content_lines(f.content, "    ")
    return lines


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
    """The TLS keys, from the one list the agent also asserts (guest_agent/tlsconfig.py)."""
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
    if unit is not None:
        files.append(WriteFile(UNIT_PATH, unit.encode()))
    return files


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


def trusted_host_flag(url: str) -> str:
    """`` --trusted-host HOST[:PORT]`` for a plain-HTTP index or wheelhouse, else "".

    pip ignores an ``http://`` index or find-links location on any host but localhost
    unless that host is trusted ("is not a trusted or secure host and is being ignored"),
    and an air-gapped wheelhouse is often plain HTTP on the site network. Found by the VM
    tier (tests/vm): a real guest's pip 23 refused the wheelhouse without this flag.
    """
    parts = urlsplit(url)
    if parts.scheme != "http" or not parts.netloc:
        return ""
    return f" --trusted-host {shlex.quote(parts.netloc.rpartition('@')[2])}"


def _install_lines(opts: Options) -> list[str]:
    """Install the agent from scratch and enable the units; nothing is started yet.

    The venv is removed first: a re-run after a crash must not keep files that
    pip considers installed but that never reached the disk."""
    q = shlex.quote
    pip = f"{VENV}/bin/pip install -q --disable-pip-version-check"
    req = q(package_requirement(opts))
    src = opts.install
    lines = ["set -eu"]
    if src.url is not None:
        lines.append(f"rm -rf {VENV}")
        lines.append(f"python3 -m venv {VENV}")
        trust = trusted_host_flag(src.url)
        if src.kind == "pip-index":
            lines.append(f"{pip} --index-url {q(src.url)}{trust} {req}")
        elif src.kind == "find-links":
            lines.append(f"{pip} --no-index --find-links {q(src.url)}{trust} {req}")
        else:
            # A direct reference names the project and extras, never a version.
            lines.append(f"{pip} {q(f'{requirement_name(opts)} @ {src.url}')}")
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

    def script(self, opts: Options) -> str:
        lines = [
            *self.install,
            f"sync; touch {self.sem}; sync",
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
        sems = " ".join(f"{CLOUD_INIT_SEM_DIR}/config_{m}" for m in SETUP_MODULES)
        # Full paths, no cd: cloud-init runs every bootcmd item in one shell script.
        return f"[ -e {self.sem} ] ||\n  rm -fv {sems}\n"


def _literal_item(script: str) -> list[str]:
    """A shell script as one list item in a literal block (our own text: no escaping)."""
    return ["  - |", *(f"    {line}" for line in script[:-1].split("\n"))]


def render_user_data(opts: Options, unit: str | None) -> str:
    """The whole ``#cloud-config`` document."""
    setup = _Setup.of(opts, unit)
    lines = [
        "#cloud-config",
        f"# imex-ensemble {opts.ens.key}; /etc/hosts is the agent's, not cloud-init's",
        "manage_etc_hosts: false",
        "bootcmd:",
        *_literal_item(setup.bootcmd()),
        *render_write_files(setup.files),
        "runcmd:",
        *_literal_item(setup.script(opts)),
    ]
    return "\n".join(lines) + "\n"


def render_secret(name: str, opts: Options, user_data: str) -> str:
    """A Secret holding ``user_data`` under key ``userdata`` (``cloudInitNoCloud.secretRef``)."""
    if not _block_safe(user_data):
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


# ---------------------------------------------------------------------------
# Command line.


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="imex-guest-agent cloudinit",
        description=(
            "Print #cloud-config user-data that installs and configures the imex guest agent "
            "and IMEX for one ensemble member (or a Secret holding it, when it is over "
            "KubeVirt's 2048-byte inline limit)."
        ),
    )
    p.add_argument("--ensemble", help="ensemble (Service) name (required without "
                   "--from-ensemble)")
    p.add_argument("--namespace", help="namespace of the Service and the VMs (required "
                   "without --from-ensemble)")
    p.add_argument(
        "--from-ensemble",
        metavar="FILE",
        help="take the ensemble, namespace, max-members, port and mode from an ImexEnsemble "
        "(`kubectl get imexensemble NAME -o json`; '-' reads standard input; YAML needs "
        "PyYAML); a flag that says otherwise is refused",
    )
    p.add_argument("--max-members", type=int, default=None, help="default 18")
    p.add_argument("--cluster-domain", help="cluster DNS zone (agent default: cluster.local)")
    p.add_argument(
        "--registry-url",
        help="host agent registry, e.g. http://imex-host-agent.imex-system.svc.cluster.local:8080",
    )
    tok = p.add_mutually_exclusive_group()
    tok.add_argument("--token", help="ensemble token (prefer --token-file: argv is visible)")
    tok.add_argument("--token-file", help="file holding the ensemble token")
    p.add_argument(
        "--install",
        default="preinstalled",
        help="pip-index:URL | wheel:URL | find-links:URL | preinstalled (default)",
    )
    p.add_argument(
        "--package",
        help="pip requirement to install (default: imex-ensemble[guest]==<this version>)",
    )
    p.add_argument("--mode", choices=("names", "ips"), default=None, help="default names")
    p.add_argument("--imex-port", type=int, default=None, help="IMEX SERVER_PORT (default "
                   f"{DEFAULT_PORT})")
    p.add_argument("--imex-cmd-port", type=int, default=DEFAULT_IMEX_CMD_PORT)
    p.add_argument("--wait-for-quorum", choices=("RECOVERY", "NONE"), default="RECOVERY")
    p.add_argument("--own-slot", choices=("auto", "published", "local"), default="auto")
    p.add_argument(
        "--nameserver",
        action="append",
        default=[],
        metavar="IP[:PORT]",
        help="DNS server for the agent's fallback (repeatable; default resolv.conf)",
    )
    p.add_argument(
        "--no-restart-imex",
        action="store_true",
        help="do not enable and restart nvidia-imex.service at first boot",
    )
    p.add_argument(
        "--auth-encryption",
        action="store_true",
        help="IMEX mutual TLS: certificates from the registry (needs --registry-url, --token "
        "and --ca-sha256; mode names only)",
    )
    p.add_argument(
        "--ca-sha256",
        metavar="HEX",
        help="the ensemble CA's fingerprint guests pin: the ImexEnsemble's status.caSHA256 "
        "(or the Service's imex-ensemble.io/ca-sha256 annotation)",
    )
    out = p.add_mutually_exclusive_group()
    out.add_argument("--output-secret", metavar="NAME", help="always print a Secret named NAME")
    out.add_argument(
        "--raw",
        action="store_true",
        help="always print plain user-data, even over the inline limit",
    )
    return p


def _port(flag: str, value: int) -> int:
    if not 1 <= value <= 65535:
        raise CloudInitError(f"{flag}: {value} is not a port number (1..65535)")
    return value


def _read_token(path: str) -> str:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CloudInitError(f"--token-file {path}: cannot read: {exc}") from exc
    return text.strip()


def from_ensemble_args(args: argparse.Namespace) -> list[str]:
    """``--from-ensemble``: fill the flags from the ImexEnsemble (refusing contradictions);
    returns notes for stderr. Without it, nothing changes."""
    if getattr(args, "from_ensemble", None) is None:
        return []
    token: str | None = args.token
    if args.token_file is not None:
        token = _read_token(args.token_file)
    dests = ["ensemble", "namespace", "max_members", "imex_port", "mode",
             *(d for d in ("auth_encryption", "ca_sha256") if hasattr(args, d))]
    source = "standard input" if args.from_ensemble == "-" else args.from_ensemble
    try:
        settings = settings_from_object(load_document(args.from_ensemble))
        filled, notes = apply_to_flags(settings, {d: getattr(args, d) for d in dests},
                                       token, source)
    except FromEnsembleError as exc:
        raise CloudInitError(f"--from-ensemble: {exc}") from exc
    for dest, value in filled.items():
        setattr(args, dest, value)
    return notes


def options_from_args(args: argparse.Namespace) -> Options:
    """Turn parsed flags into Options, refusing anything the guest would refuse later."""
    if args.ensemble is None or args.namespace is None:
        raise CloudInitError("--ensemble and --namespace are required (or --from-ensemble)")
    token: str | None = args.token
    if args.token_file is not None:
        token = _read_token(args.token_file)
    if token is not None and not _TOKEN.match(token):
        raise CloudInitError(
            "the token must be one line of letters, digits and -._~+/ (a bearer token), "
            "e.g. from `openssl rand -hex 32`"
        )
    if args.output_secret is not None and not _K8S_NAME.match(args.output_secret):
        raise CloudInitError(f"--output-secret {args.output_secret!r} is not a Kubernetes name")
    for ns in args.nameserver:
        try:
            parse_nameserver("--nameserver", ns)
        except ConfigError as exc:
            raise CloudInitError(str(exc)) from exc
    if args.package is not None and not _REQUIREMENT.match(args.package):
        raise CloudInitError(
            f"--package {args.package!r} is not a pip requirement such as "
            "'imex-ensemble[guest]==0.1.0'"
        )
    ca_sha256 = getattr(args, "ca_sha256", None)
    auth = bool(getattr(args, "auth_encryption", False))
    if ca_sha256 is not None:
        ca_sha256 = ca_sha256.strip().lower()
        if len(ca_sha256) != 64 or any(c not in "0123456789abcdef" for c in ca_sha256):
            raise CloudInitError(f"--ca-sha256 {ca_sha256!r} is not 64 hex digits")
    if auth:
        if args.mode == "ips":
            raise CloudInitError(
                "--auth-encryption cannot be used with --mode ips: IMEX then dials IP "
                "addresses, which a slot-named certificate cannot match")
        if args.registry_url is None:
            raise CloudInitError(
                "--auth-encryption needs --registry-url: certificates come from the registry "
                "(a DNS-only guest cannot get a first certificate)")
        if token is None:
            raise CloudInitError("--auth-encryption needs --token or --token-file: the "
                                 "certificate request is authenticated like the status PUT")
        if ca_sha256 is None:
            raise CloudInitError(
                "--auth-encryption needs --ca-sha256 (the ensemble's status.caSHA256): guests "
                "never trust a CA because the registry sent it")
    elif ca_sha256 is not None:
        raise CloudInitError("--ca-sha256 is only meaningful with --auth-encryption")
    opts = Options(
        auth_encryption=auth,
        ca_sha256=ca_sha256,
        ensemble=args.ensemble,
        namespace=args.namespace,
        max_members=DEFAULT_MAX_MEMBERS if args.max_members is None else args.max_members,
        cluster_domain=args.cluster_domain,
        registry_url=args.registry_url,
        token=token,
        install=InstallSource.parse(args.install),
        package=args.package,
        mode=args.mode or "names",
        imex_port=_port("--imex-port", DEFAULT_PORT if args.imex_port is None
                        else args.imex_port),
        imex_cmd_port=_port("--imex-cmd-port", args.imex_cmd_port),
        wait_for_quorum=args.wait_for_quorum,
        own_slot=args.own_slot,
        nameservers=tuple(args.nameserver),
        restart_imex=not args.no_restart_imex,
        output_secret=args.output_secret,
        raw=args.raw,
    )
    try:
        opts.ens  # noqa: B018 - validates both names
    except ModelError as exc:
        raise CloudInitError(f"--ensemble/--namespace: {exc}") from exc
    render_agent_config(opts)  # the agent's validator has the last word on every key
    return opts


def load_unit() -> str:
    """The agent's systemd unit, shipped as package data of guest_agent."""
    try:
        return resources.files("guest_agent").joinpath(UNIT_RESOURCE).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CloudInitError(
            f"the agent's systemd unit (guest_agent/{UNIT_RESOURCE}) is missing from this "
            f"installation: {exc}"
        ) from exc


def main(argv: Sequence[str]) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        for note in from_ensemble_args(args):
            print(f"imex-guest-agent cloudinit: {note}", file=sys.stderr)
        opts = options_from_args(args)
        unit = None if opts.install.kind == "preinstalled" else load_unit()
        out = generate(opts, unit)
    except CloudInitError as exc:
        print(f"imex-guest-agent cloudinit: error: {exc}", file=sys.stderr)
        return 2
    for note in out.notes:
        if args.from_ensemble is not None and note.startswith("annotate the ensemble Service"):
            continue  # the ImexEnsemble already says it (and its agent annotates the Service)
        print(f"imex-guest-agent cloudinit: {note}", file=sys.stderr)
    sys.stdout.write(out.text)
    sys.stdout.flush()
    return 0


__all__ = [
    "INLINE_USERDATA_LIMIT",
    "CloudInitError",
    "Generated",
    "InstallSource",
    "Options",
    "WriteFile",
    "agent_config",
    "generate",
    "main",
    "render_files",
    "render_secret",
    "render_user_data",
    "token_sha256",
    "yaml_quote",
]
