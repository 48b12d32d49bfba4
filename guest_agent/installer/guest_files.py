"""The files cloud-init writes on the guest (``write_files``, before the network is up).

The agent's ``config.toml`` (loaded back through the agent's own validator before it is
written, so a value the guest would refuse is refused here), its token, IMEX's
``config.cfg`` (with the TLS keys when authEncryption is on), the first
``nodes_config.cfg``, the installer (guest_agent/installer/bootstrap.py, byte for byte),
the agent's unit, the barrier unit ``imex-domain-ready.service`` and, with
``--imex-channel0-module-param``, a modprobe.d file setting NVreg_CreateImexChannel0=1.
``render_*`` are pure and return text or :class:`WriteFile` entries (the installer's
bytes are read once, from this package).

A new file goes into :func:`render_files` (its bytes join the setup digest, so a change
re-arms the setup, guest_agent/installer/setup_script.py), an IMEX setting into
:func:`render_imex_config`.
"""

from __future__ import annotations

import functools
import tomllib
from importlib import resources
from typing import Final

from guest_agent.config import ConfigError, Settings, settings_from_mapping
from guest_agent.installer.cloudyaml import WriteFile
from guest_agent.installer.options import CloudInitError, Options
from guest_agent.tls.imex_config import imex_tls_settings
from imex_shared.render import render_nodes_config

CONFIG_PATH: Final = "/etc/imex-guest-agent/config.toml"
TOKEN_PATH: Final = "/etc/imex-guest-agent/token"
IMEX_CONFIG_PATH: Final = "/etc/nvidia-imex/config.cfg"
NODES_CONFIG_PATH: Final = "/etc/nvidia-imex/nodes_config.cfg"
UNIT_NAME: Final = "imex-guest-agent.service"
UNIT_PATH: Final = f"/etc/systemd/system/{UNIT_NAME}"
UNIT_RESOURCE: Final = "data/imex-guest-agent.service"
#: the barrier jobs order themselves after (guest_agent/data/imex-domain-ready.service)
READY_UNIT_NAME: Final = "imex-domain-ready.service"
READY_UNIT_PATH: Final = f"/etc/systemd/system/{READY_UNIT_NAME}"
READY_UNIT_RESOURCE: Final = "data/imex-domain-ready.service"
#: --imex-channel0-module-param: the nvidia module makes channel 0 itself at load
MODPROBE_PATH: Final = "/etc/modprobe.d/imex-channel0.conf"
MODPROBE_TEXT: Final = ("# written by cloud-init (imex-guest-agent cloudinit "
                        "--imex-channel0-module-param): the driver creates\n"
                        "# /dev/nvidia-caps-imex-channels/channel0 when it loads "
                        "(NVIDIA's IMEX guide, IMEX Channels)\n"
                        "options nvidia NVreg_CreateImexChannel0=1\n")
#: where cloud-init writes the installer (guest_agent/installer/bootstrap.py, verbatim)
INSTALLER_PATH: Final = "/var/lib/imex-guest-agent/install.py"
INSTALLER_RESOURCE: Final = "bootstrap.py"


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
    if opts.expected_members is not None:
        raw["expected_members"] = opts.expected_members
    raw["port"] = opts.imex_port
    raw["mode"] = opts.mode
    raw["own_slot"] = opts.own_slot
    if opts.registry_url is not None:
        raw["registry_url"] = opts.registry_url
    if opts.registry_ca_sha256 is not None:
        raw["registry_ca_sha256"] = opts.registry_ca_sha256
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
    # the barrier unit is written in every install mode: it names the fixed venv path,
    # so a baked image and a downloaded agent get the same file
    files.append(WriteFile(READY_UNIT_PATH, ready_unit_source().encode()))
    if opts.imex_channel0_module_param:
        files.append(WriteFile(MODPROBE_PATH, MODPROBE_TEXT.encode()))
    return files


@functools.cache
def ready_unit_source() -> str:
    """guest_agent/data/imex-domain-ready.service, byte for byte."""
    return resources.files("guest_agent").joinpath(READY_UNIT_RESOURCE).read_text("utf-8")


@functools.cache
def installer_source() -> str:
    """The installer cloud-init writes: guest_agent/installer/bootstrap.py, byte for byte.

    Read from this package (the same file in a checkout, a wheel or a zip), so what runs on
    the guest is exactly the module the tests import."""
    return resources.files("guest_agent.installer").joinpath(INSTALLER_RESOURCE).read_text("utf-8")
