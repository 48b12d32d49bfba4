"""Guest agent settings: TOML in, one frozen ``Settings`` out.

Everything is checked at start so a typo never becomes a silent default on a
rack: unknown keys, wrong types and bad values raise ConfigError naming the
key. The settings object is passed explicitly; nothing reads globals.
"""

from __future__ import annotations

import ipaddress
import re
import tomllib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from imex_shared.model import (
    DEFAULT_MAX_MEMBERS,
    DEFAULT_PORT,
    DEFAULT_ZONE,
    MAX_MEMBERS_LIMIT,
    ModelError,
    check_dns_label,
    is_sha256_hex,
)

DEFAULT_CONFIG_PATH = "/etc/imex-guest-agent/config.toml"

#: where the IMEX channel nodes live (NVIDIA's IMEX guide, "IMEX Channels")
CHANNEL_DIR = "/dev/nvidia-caps-imex-channels"
#: The nvidia module makes ``NVreg_ImexChannelCount`` channels, 2048 by default (shown as
#: ``ImexChannelCount: 2048`` in /proc/driver/nvidia/params): minors 0..2047.
CHANNEL_COUNT = 2048
MAX_CHANNEL = CHANNEL_COUNT - 1
#: mode bits a channel node may get: rwx for owner, group, other; no setuid/setgid/sticky
MODE_MASK = 0o777

ImexControl = Literal["systemd", "process", "none"]
OnChange = Literal["signal", "restart"]
OwnSlot = Literal["auto", "published", "local"]
Mode = Literal["names", "ips"]


def parse_mode(text: str) -> int:
    """``imex_channel_mode``: an octal string such as ``"0666"``; ValueError otherwise."""
    if not re.fullmatch(r"0?[0-7]{3}", text):
        raise ValueError(f"{text!r} is not an octal mode such as \"0666\" or \"0660\" "
                         "(three octal digits, an optional leading 0; no setuid, setgid "
                         "or sticky bit)")
    return int(text, 8) & MODE_MASK


def check_channels(values: Sequence[object]) -> tuple[int, ...]:
    """``imex_channels``: distinct integers 0..MAX_CHANNEL; ValueError names the bad one."""
    out: list[int] = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int):
            raise ValueError(f"{v!r} is not a channel number")
        if not 0 <= v <= MAX_CHANNEL:
            raise ValueError(f"channel {v} is out of range 0-{MAX_CHANNEL} (the nvidia "
                             f"module's default ImexChannelCount is {CHANNEL_COUNT})")
        if v in out:
            raise ValueError(f"channel {v} is listed twice")
        out.append(v)
    return tuple(sorted(out))


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the file."""


@dataclass(frozen=True, slots=True)
class Nameserver:
    ip: str
    port: int = 53

    def __str__(self) -> str:
        host = f"[{self.ip}]" if ":" in self.ip else self.ip
        return f"{host}:{self.port}"


@dataclass(frozen=True, slots=True)
class Settings:
    """The guest agent's whole configuration (DESIGN.md "Guest agent")."""

    ensemble: str
    namespace: str
    cluster_domain: str = DEFAULT_ZONE
    max_members: int = DEFAULT_MAX_MEMBERS
    port: int = DEFAULT_PORT
    mode: Mode = "names"
    registry_url: str | None = None
    #: hex sha256 of the registry CA's certificate (an ImexEnsemble's
    #: status.registryCASHA256): an https registry_url is trusted only through it
    #: (guest_agent/registry_trust.py); unset: the system trust store.
    registry_ca_sha256: str | None = None
    token_file: str | None = None
    nameservers: tuple[Nameserver, ...] = ()
    nodes_config: str = "/etc/nvidia-imex/nodes_config.cfg"
    hosts_file: str = "/etc/hosts"
    imex_control: ImexControl = "systemd"
    imex_unit: str = "nvidia-imex.service"
    imex_command: tuple[str, ...] = ("/usr/bin/nvidia-imex", "-c", "/etc/nvidia-imex/config.cfg")
    imex_ctl: tuple[str, ...] = ("/usr/bin/nvidia-imex-ctl",)
    on_change: OnChange = "signal"
    poll_interval: float = 2.0
    own_index: int | None = None
    own_slot: OwnSlot = "auto"
    status_file: str = "/run/imex-guest-agent/status.json"
    #: IMEX acts on at most one SIGUSR1 per 5 s (FACTS.md).
    signal_interval: float = 5.0
    #: ips mode: wait this long without a further change before restarting IMEX.
    settle_time: float = 2.0
    #: Restart IMEX when it has not said READY for this long.
    ready_grace: float = 120.0
    dns_timeout: float = 2.0
    longpoll_timeout: float = 30.0
    #: DNS pass interval while the registry answers (DNS views are not used then).
    dns_standby_interval: float = 10.0
    #: Mutual TLS between the IMEX daemons (issue 19): a key made here, a certificate
    #: from the registry, IMEX's config pointing at them. Needs registry_url,
    #: token_file and ca_sha256; names mode only.
    auth_encryption: bool = False
    #: hex sha256 of the ensemble CA's certificate (status.caSHA256): the trust anchor.
    ca_sha256: str | None = None
    #: where the key, the certificate and the CA bundle live (docs/guest-agent.md).
    tls_dir: str = "/etc/imex-guest-agent/tls"
    #: how long the first start of IMEX waits for the first certificate (systemd's
    #: TimeoutStartSec of the agent's unit is 60 s, so this stays below it).
    cert_wait: float = 45.0
    #: IMEX's config.cfg: with auth_encryption the agent makes sure its TLS keys are set.
    imex_config: str = "/etc/nvidia-imex/config.cfg"
    #: Keep ``port`` out of the kernel's ephemeral range (portreserve.py), so no
    #: outgoing connection can take IMEX's port before IMEX binds it.
    reserve_port: bool = True
    #: Status report (and -N -j collection) at least this often, changes or not.
    report_interval: float = 10.0
    nvidia_smi: tuple[str, ...] = ("/usr/bin/nvidia-smi",)
    #: IMEX channels the agent keeps as device nodes (guest_agent/imex/channels.py):
    #: numbers 0-2047; () turns the feature off.
    imex_channels: tuple[int, ...] = (0,)
    #: the nodes' mode: 0666, as NVIDIA's guide shows and as the driver's own
    #: /dev/nvidia* nodes are (a VM is normally one tenant); 0660 with a group narrows it
    imex_channel_mode: str = "0666"
    #: the nodes' group (None: root)
    imex_channel_group: str | None = None
    #: deprecated (use imex_channels): channel<N> under /dev/nvidia-caps-imex-channels
    imex_channel_device: str | None = None
    #: ``wait --for domain`` needs this many published members (None: max_members)
    expected_members: int | None = None
    source: str = field(default="<defaults>", compare=False)
    #: what loading the config had to say (deprecated keys), logged by the commands
    warnings: tuple[str, ...] = field(default=(), compare=False)

    @property
    def channel_mode(self) -> int:
        return parse_mode(self.imex_channel_mode)

    @property
    def members_expected(self) -> int:
        """``expected_members``, else ``max_members``: at boot a VM that sees only
        itself is not a domain."""
        return self.expected_members if self.expected_members is not None else \
            self.max_members


def _want(key: str, value: object, kind: type | tuple[type, ...], what: str) -> None:
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ConfigError(f"{key}: expected {what}, got a boolean")
    if not isinstance(value, kind):
        raise ConfigError(f"{key}: expected {what}, got {type(value).__name__} {value!r}")


def _str(key: str, v: object) -> str:
    _want(key, v, str, "a string")
    assert isinstance(v, str)
    if not v:
        raise ConfigError(f"{key}: must not be empty")
    return v


def _choice(*choices: str) -> Callable[[str, object], str]:
    def check(key: str, v: object) -> str:
        s = _str(key, v)
        if s not in choices:
            raise ConfigError(f"{key}: must be one of {', '.join(map(repr, choices))}, not {s!r}")
        return s

    return check


def _int_range(lo: int, hi: int) -> Callable[[str, object], int]:
    def check(key: str, v: object) -> int:
        _want(key, v, int, "an integer")
        assert isinstance(v, int)
        if not lo <= v <= hi:
            raise ConfigError(f"{key}: must be between {lo} and {hi}, not {v}")
        return v

    return check


def _seconds(lo: float, hi: float) -> Callable[[str, object], float]:
    def check(key: str, v: object) -> float:
        _want(key, v, (int, float), "a number of seconds")
        assert isinstance(v, int | float)
        if not lo <= float(v) <= hi:
            raise ConfigError(f"{key}: must be between {lo} and {hi} seconds, not {v}")
        return float(v)

    return check


def _bool(key: str, v: object) -> bool:
    if not isinstance(v, bool):
        raise ConfigError(f"{key}: expected true or false, got {type(v).__name__} {v!r}")
    return v


def _sha256(key: str, v: object) -> str:
    s = _str(key, v).strip().lower()
    if not is_sha256_hex(s):
        raise ConfigError(f"{key}: must be 64 hex digits (a sha256 fingerprint), not {s!r}")
    return s


def _argv(key: str, v: object) -> tuple[str, ...]:
    _want(key, v, list, "a list of strings (argv)")
    assert isinstance(v, list)
    if not v or not all(isinstance(a, str) and a for a in v):
        raise ConfigError(f"{key}: must be a non-empty list of non-empty strings")
    return tuple(v)


def _channels(key: str, v: object) -> tuple[int, ...]:
    _want(key, v, list, "a list of channel numbers, e.g. [0]")
    assert isinstance(v, list)
    try:
        return check_channels(v)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def _mode(key: str, v: object) -> str:
    s = _str(key, v)
    try:
        parse_mode(s)
    except ValueError as exc:
        raise ConfigError(f"{key}: {exc}") from exc
    return s


def _group(key: str, v: object) -> str:
    s = _str(key, v)
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?", s):
        raise ConfigError(f"{key}: {s!r} is not a group name")
    return s


def _label(key: str, v: object) -> str:
    try:
        return check_dns_label(_str(key, v), key)
    except ModelError as exc:
        raise ConfigError(f"{key}: {exc}") from exc


def _domain(key: str, v: object) -> str:
    s = _str(key, v).strip(".")
    try:
        for part in s.split("."):
            check_dns_label(part, "label")
    except ModelError as exc:
        raise ConfigError(f"{key}: {s!r} is not a DNS domain") from exc
    return s


def _url(key: str, v: object) -> str:
    s = _str(key, v)
    parts = urlsplit(s)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ConfigError(f"{key}: {s!r} is not an http(s) URL")
    return s.rstrip("/")


def _path(key: str, v: object) -> str:
    s = _str(key, v)
    if not s.startswith("/"):
        raise ConfigError(f"{key}: {s!r} must be an absolute path")
    return s


def parse_nameserver(key: str, text: str) -> Nameserver:
    """``IP``, ``IP:PORT`` or ``[IPv6]:PORT``."""
    host, port = text, 53
    if text.startswith("["):
        host, sep, rest = text[1:].partition("]")
        if not sep or (rest and not rest.startswith(":")):
            raise ConfigError(f"{key}: {text!r} is not IP, IP:PORT or [IPv6]:PORT")
        if rest:
            port = _port_of(key, text, rest[1:])
    elif text.count(":") == 1:
        host, _, p = text.partition(":")
        port = _port_of(key, text, p)
    try:
        ip = ipaddress.ip_address(host)
    except ValueError as exc:
        raise ConfigError(f"{key}: {text!r} is not IP, IP:PORT or [IPv6]:PORT") from exc
    return Nameserver(str(ip), port)


def _port_of(key: str, text: str, p: str) -> int:
    if not p.isdigit() or not 0 < int(p) < 65536:
        raise ConfigError(f"{key}: {text!r} has a bad port")
    return int(p)


def _nameservers(key: str, v: object) -> tuple[Nameserver, ...]:
    _want(key, v, list, 'a list of "IP" or "IP:PORT" strings')
    assert isinstance(v, list)
    out = []
    for item in v:
        _want(key, item, str, "a list of strings")
        out.append(parse_nameserver(key, item))
    return tuple(out)


_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "ensemble": _label,
    "namespace": _label,
    "cluster_domain": _domain,
    "max_members": _int_range(1, MAX_MEMBERS_LIMIT),
    "port": _int_range(1, 65535),
    "mode": _choice("names", "ips"),
    "registry_url": _url,
    "registry_ca_sha256": _sha256,
    "token_file": _path,
    "nameservers": _nameservers,
    "nodes_config": _path,
    "hosts_file": _path,
    "imex_control": _choice("systemd", "process", "none"),
    "imex_unit": _str,
    "imex_command": _argv,
    "imex_ctl": _argv,
    "on_change": _choice("signal", "restart"),
    "poll_interval": _seconds(0.05, 3600),
    "own_index": _int_range(0, MAX_MEMBERS_LIMIT - 1),
    "own_slot": _choice("auto", "published", "local"),
    "status_file": _path,
    "signal_interval": _seconds(0.0, 600),
    "settle_time": _seconds(0.0, 600),
    "ready_grace": _seconds(0.0, 86400),
    "dns_timeout": _seconds(0.05, 60),
    "longpoll_timeout": _seconds(0.1, 60),
    "dns_standby_interval": _seconds(0.05, 3600),
    "auth_encryption": _bool,
    "ca_sha256": _sha256,
    "tls_dir": _path,
    "cert_wait": _seconds(0.0, 55.0),
    "imex_config": _path,
    "reserve_port": _bool,
    "report_interval": _seconds(0.5, 3600),
    "nvidia_smi": _argv,
    "imex_channels": _channels,
    "imex_channel_mode": _mode,
    "imex_channel_group": _group,
    "imex_channel_device": _path,
    "expected_members": _int_range(1, MAX_MEMBERS_LIMIT),
}
assert set(_CHECKS) == {f.name for f in fields(Settings)} - {"source", "warnings"}


def _deprecated_channel_device(raw: Mapping[str, object], values: dict[str, Any],
                               source: str) -> str:
    """``imex_channel_device`` (before imex_channels): still read, with a warning naming
    the keys that replace it."""
    path = values["imex_channel_device"]
    m = re.fullmatch(re.escape(CHANNEL_DIR) + r"/channel(\d{1,4})", path)
    note = (f"{source}: imex_channel_device is deprecated: use imex_channels (a list of "
            "channel numbers), imex_channel_mode and imex_channel_group")
    if "imex_channels" in raw:
        return note + "; imex_channels is set too and wins"
    if m is None:
        return note + f"; {path!r} is not {CHANNEL_DIR}/channel<N>, so it is ignored"
    try:
        values["imex_channels"] = check_channels([int(m.group(1))])
    except ValueError as exc:
        raise ConfigError(f"{source}: imex_channel_device: {exc}") from exc
    return note + f"; read as imex_channels = [{m.group(1)}]"


def settings_from_mapping(raw: Mapping[str, object], source: str = "<mapping>") -> Settings:
    """Validate ``raw`` (parsed TOML) into Settings; ConfigError names the bad key."""
    unknown = sorted(set(raw) - set(_CHECKS))
    if unknown:
        raise ConfigError(
            f"{source}: unknown key(s) {', '.join(unknown)} (known: {', '.join(sorted(_CHECKS))})"
        )
    for required in ("ensemble", "namespace"):
        if required not in raw:
            raise ConfigError(f"{source}: {required}: required key is missing")
    values: dict[str, Any] = {}
    for key, value in raw.items():
        try:
            values[key] = _CHECKS[key](key, value)
        except ConfigError as exc:
            raise ConfigError(f"{source}: {exc}") from exc
    warnings: list[str] = []
    if "imex_channel_device" in values:
        warnings.append(_deprecated_channel_device(raw, values, source))
    settings = Settings(**values, source=source, warnings=tuple(warnings))
    if settings.expected_members is not None and \
            settings.expected_members > settings.max_members:
        raise ConfigError(
            f"{source}: expected_members: {settings.expected_members} is more than "
            f"max_members = {settings.max_members}")
    if settings.own_index is not None and settings.own_index >= settings.max_members:
        raise ConfigError(
            f"{source}: own_index: {settings.own_index} is out of range for "
            f"max_members = {settings.max_members}"
        )
    if settings.imex_control == "process" and "imex_command" not in raw:
        raise ConfigError(f'{source}: imex_command: required when imex_control = "process"')
    if settings.mode == "ips" and settings.own_slot == "local":
        raise ConfigError(
            f'{source}: own_slot: "local" cannot work in mode "ips" (the nodes file must be '
            "identical on every member); use bridge binding"
        )
    if settings.registry_ca_sha256 is not None and not (
            settings.registry_url or "").startswith("https://"):
        raise ConfigError(
            f"{source}: registry_ca_sha256: pins the registry's TLS CA, so registry_url "
            f"must be an https:// URL (it is {settings.registry_url or 'unset'})")
    if settings.auth_encryption:
        missing = [k for k in ("registry_url", "token_file", "ca_sha256")
                   if getattr(settings, k) is None]
        if missing:
            raise ConfigError(
                f"{source}: auth_encryption: needs {', '.join(missing)} (certificates come "
                "from the registry and are checked against the pinned CA fingerprint)"
            )
        if settings.mode == "ips":
            raise ConfigError(
                f'{source}: auth_encryption: cannot work in mode "ips" (IMEX dials IP '
                "addresses, which a slot-named certificate does not match)"
            )
    return settings


def load_settings(path: str | Path = DEFAULT_CONFIG_PATH) -> Settings:
    """Read and validate the TOML file at ``path``."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror}") from exc
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
    return settings_from_mapping(raw, str(path))
