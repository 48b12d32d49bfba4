"""A stand-in for the NVIDIA IMEX daemon (``nvidia-imex``), as far as peer discovery sees it.

Why it exists: there is no GPU and no nvidia-imex here (FACTS.md, "This machine"), yet the
guest agent's whole job is to keep IMEX's view of its peers true. This process reproduces
the parts of IMEX's behaviour that the agent depends on (FACTS.md, "The IMEX daemon"):

* ``config.cfg`` and the nodes file are read **once**, at start. Nothing re-reads them.
* Each nodes-file line is a node; its position is the node id. Every entry is resolved with
  the system resolver (``getaddrinfo``, so ``/etc/hosts`` counts). The own node is the
  entry whose address is on a local interface (or equals ``BIND_INTERFACE_IP``); with no
  match the daemon exits non-zero with "No matching network interface found for any IP
  addresses in the node configuration file", as IMEX does.
* It listens on ``SERVER_PORT`` on its own address and keeps one outgoing connection to
  every other node, retrying forever (500 ms doubling to 3 s) and resolving the name again
  on every attempt as the system resolver does (glibc asks ``/etc/hosts``, then DNS with
  the search list, A and AAAA): ``/etc/hosts`` is read by :class:`HostsFile` on the loop
  (parsed again only when it changed), any other name goes to ``getaddrinfo``, any
  family (in a thread: a DNS lookup may block). A missing peer does not keep
  it from READY. When a name gives several addresses they are dialled in the order the
  resolver returns them until one connects (gRPC's ``pick_first``, without its Happy
  Eyeballs stagger); FACTS.md does not say which address IMEX takes, this is the
  assumption.
* Peers exchange a hash of their nodes file and their node id in a one-line handshake. A
  different hash marks the connection as a node-map mismatch (``MISMATCH``; ``!M!`` in
  ``nvidia-imex-ctl -N``), communication disabled until a restart, as IMEX does. A peer
  that answers with another node id (a stale address now used by another member) is not
  accepted: the connection counts as DISCONNECTED and is retried. (Whether real IMEX
  compares names or resolved addresses is undocumented; the stand-in hashes the file's
  lines as written.)
* SIGUSR1 restarts all outgoing connections, re-resolving names, at most once per 5 s; a
  SIGUSR1 inside the window is ignored (counted as received, not acted). SIGTERM, SIGINT
  and SIGQUIT stop cleanly (peers see the connections close). SIGHUP only logs.
* States: INITIALIZING -> WAITING_FOR_PEERS -> READY (-> SHUTTING_DOWN).
* ``nvidia-imex-ctl -N -j`` is built from the links the daemon really holds: its own entry
  lists each outgoing link's state (NEVER_CONNECTED until it first connects, CONNECTED,
  DISCONNECTED after a loss, MISMATCH), each connected peer's entry is the peer's own
  view relayed over that link, and a peer without a link is UNAVAILABLE with every
  connection INVALID (FACTS.md "IMEX: the domain view"). Nothing is read from the files.
* Mutual TLS (FACTS.md "IMEX: authentication and encryption"), with
  ``IMEX_ENABLE_AUTH_ENCRYPTION=1``, ``IMEX_AUTH_ENCRYPTION_MODE=SSL_TLS`` and
  ``IMEX_AUTH_SOURCE=FILE`` (other modes and sources are refused at start): every peer
  link is TLS with a certificate on both ends, checked against the configured CA files
  (``IMEX_SERVER_*`` for incoming links, ``IMEX_CLIENT_*`` for outgoing ones). The
  dialler checks the name it dialled (the nodes-file entry) or
  ``IMEX_SECURITY_TARGET_OVERRIDE``; the listener checks the node the dialler says it
  is, by that node's entry (or the override). NVIDIA documents the check as the
  certificate's CN and leaves the SAN open, so the stand-in takes the stricter reading:
  the CN **and** a DNS SAN must both equal the name. Python's ``ssl`` ignores the CN
  whenever a SAN is present, so this is explicit code (``check_peer_name``), with
  ``check_hostname`` off. A link that fails authentication is not CONNECTED: it shows
  ``AUTHENTICATING`` (``A`` in the legend) and is retried like any other; its node is
  ``UNAVAILABLE`` with ``INVALID`` connections. SIGUSR1 (when acted on) reloads the
  key, certificate and CA files before redialling; a reload that fails keeps the old
  credentials (logged). What IMEX does to live incoming links on reload is not
  documented; the stricter reading here: an incoming link whose peer certificate no
  longer verifies against the reloaded CAs is closed, the others stay.
* ``IMEX_CMD_PORT`` (when ``IMEX_CMD_ENABLED=1``) serves the ``nvidia-imex-ctl`` stand-in
  (:mod:`tests.sandbox.imex_ctl`) with one JSON request and one JSON reply per connection.
* ``--version`` prints ``IMEX version is: <version>`` and exits, as ``nvidia-imex
  --version`` does (seen printed by nvidia-imex 570.148.08; FACTS.md has no more).
* ``DAEMONIZE=1`` forks after the checks; the parent exits 0 only once the child listens
  (systemd ``Type=forking``), writing ``--pid-file`` when given.

For tests, ``--state-file PATH`` keeps a JSON file with the state, node id, peers (name,
resolved address, status) and counters: ``starts`` (kept across restarts with the same
file), ``signals_received``, ``signals_acted``, ``signals_ignored``, a ``signal_log`` and
``attempts_by_ip`` (outgoing connection attempts per target address). ``--attempt-log
PATH`` appends one JSON line per outgoing attempt and per lost link (:class:`AttemptLog`),
so a benchmark can time the first CONNECTED to an address and count attempts to a dead one.
``--ready-delay`` and ``--stuck-state`` let tests hold the daemon out of READY.

For test code, :func:`write_standin_files` writes a config.cfg + nodes file pair and
:class:`StandinProcess` starts the daemon (optionally inside a ``tests.sandbox.netns`` node)
and asks it things (``-q``, ``-N -j``, state file, signals). ``tests/sandbox/bin/nvidia-imex``
and ``nvidia-imex-ctl`` are the console wrappers a guest agent's ``imex_command`` /
``imex_ctl`` can point at. This file uses only the standard library and runs as a lone
script too (copied into a guest image as ``nvidia-imex``); where uvloop is importable (the
tests' venv) it runs on uvloop's loop, whose loop and transports are C (``_new_loop``).

Concurrency: one asyncio loop; each outgoing link is one task that dials, greets and
then waits for the link's end; signal handlers only set flags or restart tasks from the
loop. No thread per peer: names in ``/etc/hosts`` resolve on the loop; only a DNS lookup
uses the default executor's thread. A link's lines are handled in the loop's read callback
(``LineLink``, an asyncio Protocol), not by a task woken per line, and incoming links
have no task at all. One keepalive timer pings every link and drops the silent ones,
instead of a sleep and a read deadline per link (which were half an idle stand-in's CPU).
The state file is written at most once per turn of the loop (issue 27: what a change
costs the stand-in should be what it costs a C++ daemon, not an interpreter's tasks
and serialisations). Bad input on any socket closes
that connection with a log line and never stops the daemon.
"""

# ruff: noqa: E402  (the SIGUSR1 guard below must run before the slower imports)
from __future__ import annotations

import signal
import time

# SIGUSR1's default action kills the process. A supervisor may signal the daemon moments
# after starting it, before the event loop's handler exists; count such early signals
# instead of dying (they change nothing: no connection exists yet, all resolve fresh).
_EARLY_USR1: list[float] = []
if __name__ == "__main__":
    signal.signal(signal.SIGUSR1, lambda *_: _EARLY_USR1.append(time.time()))

import argparse
import asyncio
import contextlib
import errno
import functools
import hashlib
import ipaddress
import json
import logging
import os
import socket
import ssl
import subprocess
import sys
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

log = logging.getLogger("sandbox.imex")

STATES = (
    "INITIALIZING",
    "STARTING_AUTH_SERVER",
    "WAITING_FOR_PEERS",
    "WAITING_FOR_RECOVERY",
    "INIT_GPU",
    "READY",
    "SHUTTING_DOWN",
    "UNAVAILABLE",
)
DEFAULT_VERSION = "580.82.07"
NO_MATCH_MESSAGE = (
    "No matching network interface found for any IP addresses in the node configuration file"
)
USR1_WINDOW_S = 5.0
RETRY_FIRST_S = 0.5
RETRY_MAX_S = 3.0
PING_INTERVAL_S = 0.5
PEER_TIMEOUT_S = 3.0
CONNECT_TIMEOUT_S = 2.0
SIGNAL_LOG_MAX = 200

JsonDict = dict[str, Any]


class ImexStandinError(Exception):
    """The stand-in cannot start (bad config, unreadable nodes file, no local match)."""


class ConfigFileError(ImexStandinError):
    """config.cfg is unreadable or holds a bad value."""


class NoLocalMatchError(ImexStandinError):
    """No nodes-file entry resolves to a local address."""


# --------------------------------------------------------------------------- config


@dataclass(frozen=True)
class ImexConfig:
    """The config.cfg keys the stand-in honours (others are accepted and ignored)."""

    server_port: int = 50000
    node_config_file: Path = Path("/etc/nvidia-imex/nodes_config.cfg")
    bind_interface_ip: str = ""
    cmd_enabled: bool = True
    cmd_port: int = 50005
    cmd_bind_interface_ip: str = ""
    log_file_name: str = ""
    daemonize: bool = False
    raw: tuple[tuple[str, str], ...] = ()
    #: IMEX_ENABLE_AUTH_ENCRYPTION=1: mutual TLS on every peer link (see TlsFiles).
    tls: TlsFiles | None = None

    @property
    def cmd_address(self) -> str:
        """Where the command port listens: the configured IP or loopback."""
        return self.cmd_bind_interface_ip or "127.0.0.1"


def _int(key: str, value: str, lo: int = 0, hi: int = 65535) -> int:
    try:
        n = int(value)
    except ValueError:
        raise ConfigFileError(f"{key}={value!r}: not an integer") from None
    if not lo <= n <= hi:
        raise ConfigFileError(f"{key}={value!r}: out of range {lo}..{hi}")
    return n


def _bool(key: str, value: str) -> bool:
    if value not in ("0", "1"):
        raise ConfigFileError(f"{key}={value!r}: expected 0 or 1")
    return value == "1"


def _ip_or_empty(key: str, value: str) -> str:
    if not value:
        return ""
    try:
        return str(ipaddress.ip_address(value))
    except ValueError:
        raise ConfigFileError(f"{key}={value!r}: not an IP address") from None


def parse_config(text: str, *, base: Path | None = None) -> ImexConfig:
    """Pure: parse config.cfg text (``KEY=VALUE`` lines, ``#`` comments)."""
    values: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = line.partition("=")
        if not sep:
            raise ConfigFileError(f"line {n}: {line!r} is not KEY=VALUE")
        values[key.strip()] = value.strip()
    kw: dict[str, Any] = {"raw": tuple(values.items())}
    if "SERVER_PORT" in values:
        kw["server_port"] = _int("SERVER_PORT", values["SERVER_PORT"], 1)
    if values.get("IMEX_NODE_CONFIG_FILE"):
        p = Path(values["IMEX_NODE_CONFIG_FILE"])
        kw["node_config_file"] = p if p.is_absolute() or base is None else base / p
    if "BIND_INTERFACE_IP" in values:
        kw["bind_interface_ip"] = _ip_or_empty("BIND_INTERFACE_IP", values["BIND_INTERFACE_IP"])
    if "IMEX_CMD_ENABLED" in values:
        kw["cmd_enabled"] = _bool("IMEX_CMD_ENABLED", values["IMEX_CMD_ENABLED"])
    if "IMEX_CMD_PORT" in values:
        kw["cmd_port"] = _int("IMEX_CMD_PORT", values["IMEX_CMD_PORT"], 1)
    if "IMEX_CMD_BIND_INTERFACE_IP" in values:
        kw["cmd_bind_interface_ip"] = _ip_or_empty(
            "IMEX_CMD_BIND_INTERFACE_IP", values["IMEX_CMD_BIND_INTERFACE_IP"])
    if "LOG_FILE_NAME" in values:
        kw["log_file_name"] = values["LOG_FILE_NAME"]
    if "DAEMONIZE" in values:
        kw["daemonize"] = _bool("DAEMONIZE", values["DAEMONIZE"])
    if _bool("IMEX_ENABLE_AUTH_ENCRYPTION", values.get("IMEX_ENABLE_AUTH_ENCRYPTION", "0")):
        kw["tls"] = TlsFiles.from_values(values)
    return ImexConfig(**kw)


def load_config(path: Path) -> ImexConfig:
    try:
        text = path.read_text()
    except OSError as e:
        raise ConfigFileError(f"cannot read config {path}: {e}") from e
    try:
        return parse_config(text)
    except ConfigFileError as e:
        raise ConfigFileError(f"{path}: {e}") from e


def render_config(
    *,
    server_port: int = 50000,
    node_config_file: str | Path,
    cmd_port: int = 50005,
    bind_interface_ip: str = "",
    cmd_bind_interface_ip: str = "",
    log_file_name: str | Path = "",
    daemonize: bool = False,
) -> str:
    """config.cfg text for tests, in the shape of IMEX's shipped file."""
    return (
        f"SERVER_PORT={server_port}\n"
        f"IMEX_NODE_CONFIG_FILE={node_config_file}\n"
        f"BIND_INTERFACE_IP={bind_interface_ip}\n"
        "IMEX_CMD_ENABLED=1\n"
        f"IMEX_CMD_PORT={cmd_port}\n"
        f"IMEX_CMD_BIND_INTERFACE_IP={cmd_bind_interface_ip}\n"
        "IMEX_WAIT_FOR_QUORUM=NONE\n"
        "IMEX_NODE_DISCONNECTED_GRACE_TIME=-1\n"
        f"LOG_FILE_NAME={log_file_name}\n"
        f"DAEMONIZE={1 if daemonize else 0}\n"
        "IMEX_ENABLE_AUTH_ENCRYPTION=0\n"
    )


def read_nodes(path: Path) -> list[str]:
    """Nodes file entries in order; blank lines and ``#`` comments do not count as nodes."""
    try:
        text = path.read_text()
    except OSError as e:
        raise ImexStandinError(f"cannot read node configuration file {path}: {e}") from e
    entries = [ln.strip() for ln in text.splitlines()]
    return [e for e in entries if e and not e.startswith("#")]


def nodes_hash(entries: Sequence[str]) -> str:
    return hashlib.sha256("\n".join(entries).encode()).hexdigest()[:16]


def local_addresses() -> set[str]:
    """Addresses on this network namespace's interfaces (``ip -j addr``)."""
    try:
        out = subprocess.run(["ip", "-j", "addr", "show"], capture_output=True, check=True,
                             text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise ImexStandinError(f"cannot list local addresses: {e}") from e
    addrs: set[str] = set()
    for link in json.loads(out or "[]"):
        for info in link.get("addr_info", []):
            if info.get("local"):
                addrs.add(str(ipaddress.ip_address(info["local"].split("%")[0])))
    return addrs


def resolve_all(host: str) -> list[str]:
    """Every address the system resolver gives for ``host`` (empty when it fails)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        log.info("cannot resolve %s: %s", host, e)
        return []
    out: list[str] = []
    for info in infos:
        ip = str(info[4][0]).split("%")[0]
        if ip not in out:
            out.append(ip)
    return out


class HostsFile:
    """``/etc/hosts`` as glibc's ``files`` source answers getaddrinfo: every address of
    every line naming the host (canonical name or alias, any case), in file order.

    Why not getaddrinfo for these: asyncio runs it in a thread per lookup, and a SIGUSR1
    re-resolves every peer, so each change cost 17 thread hand-offs and 17 parses of
    the same file per member; a C++ daemon resolves without an interpreter's thread
    pool. Parsed again only when the file changed (inode, size, mtime, ctime). A name
    the file does not hold is None: the caller asks the system resolver (DNS), as
    ``hosts: files dns`` does. IP literals are themselves, without a lookup.
    """

    def __init__(self, path: Path = Path("/etc/hosts")) -> None:
        self.path = path
        self._key: tuple[int, ...] | None = None
        self._names: dict[str, list[str]] = {}
        #: host -> its canonical text when it is an IP literal, else None
        self._literals: dict[str, str | None] = {}
        self.parses = 0

    def lookup(self, host: str) -> list[str] | None:
        literal = self._literals.get(host)
        if literal is None and host not in self._literals:
            with contextlib.suppress(ValueError):
                literal = str(ipaddress.ip_address(host))
            self._literals[host] = literal  # the node map's few names: parsed once each
        if literal is not None:
            return [literal]
        try:
            st = os.stat(self.path)
        except OSError:
            return None
        key = (st.st_ino, st.st_dev, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
        if key != self._key:
            try:
                text = self.path.read_text(errors="replace")
            except OSError:
                return None
            self._names = parse_hosts(text)
            self._key = key
            self.parses += 1
        found = self._names.get(host.lower().rstrip("."))
        return list(found) if found else None


def parse_hosts(text: str) -> dict[str, list[str]]:
    """name (lower case) -> its addresses in file order (pure)."""
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        try:
            ip = str(ipaddress.ip_address(fields[0].split("%")[0]))
        except ValueError:
            continue
        for name in fields[1:]:
            addrs = out.setdefault(name.lower().rstrip("."), [])
            if ip not in addrs:
                addrs.append(ip)
    return out


def find_own_node(
    entries: Sequence[str],
    resolve: Callable[[str], list[str]],
    local: set[str],
    bind_ip: str = "",
) -> tuple[int, str]:
    """Pure given its inputs: (node id, own address) or :class:`NoLocalMatchError`."""
    wanted = {bind_ip} if bind_ip else local
    for i, entry in enumerate(entries):
        for ip in resolve(entry):
            if ip in wanted:
                return i, ip
    raise NoLocalMatchError(NO_MATCH_MESSAGE)


# --------------------------------------------------------------------------- TLS


_TLS_FILE_KEYS = ("IMEX_SERVER_KEY", "IMEX_SERVER_CERT", "IMEX_SERVER_CERT_AUTH",
                  "IMEX_CLIENT_KEY", "IMEX_CLIENT_CERT", "IMEX_CLIENT_CERT_AUTH")


@dataclass(frozen=True)
class TlsFiles:
    """The auth keys of config.cfg (SSL_TLS from FILEs: the one mode the stand-in has)."""

    server_key: Path
    server_cert: Path
    server_ca: Path
    client_key: Path
    client_cert: Path
    client_ca: Path
    target_override: str = ""

    @classmethod
    def from_values(cls, values: dict[str, str]) -> TlsFiles:
        mode = values.get("IMEX_AUTH_ENCRYPTION_MODE", "")
        if mode != "SSL_TLS":
            raise ConfigFileError(f"IMEX_AUTH_ENCRYPTION_MODE={mode!r}: the stand-in "
                                  "implements SSL_TLS only")
        source = values.get("IMEX_AUTH_SOURCE", "")
        if source != "FILE":
            raise ConfigFileError(f"IMEX_AUTH_SOURCE={source!r}: the stand-in implements "
                                  "FILE only")
        missing = [k for k in _TLS_FILE_KEYS if not values.get(k)]
        if missing:
            raise ConfigFileError(f"IMEX_ENABLE_AUTH_ENCRYPTION=1 needs {', '.join(missing)}")
        p = [Path(values[k]) for k in _TLS_FILE_KEYS]
        return cls(*p, target_override=values.get("IMEX_SECURITY_TARGET_OVERRIDE", ""))


class AuthError(Exception):
    """A peer failed authentication (handshake or name check)."""


def server_context(files: TlsFiles) -> ssl.SSLContext:
    """Incoming links: our certificate, and a client certificate required from the CA file."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(files.server_cert, files.server_key)
    ctx.load_verify_locations(cafile=files.server_ca)
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def client_context(files: TlsFiles) -> ssl.SSLContext:
    """Outgoing links: our certificate; the server's verified against the CA file.

    ``check_hostname`` is off because ``ssl`` would ignore the CN when a SAN exists;
    ``check_peer_name`` checks both after the handshake.
    """
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.load_cert_chain(files.client_cert, files.client_key)
    ctx.load_verify_locations(cafile=files.client_ca)
    return ctx


def peer_names(cert: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(CNs, DNS SANs) of a verified peer certificate as ``getpeercert()`` gives it."""
    cns = [v for rdn in cert.get("subject", ()) for k, v in rdn if k == "commonName"]
    sans = [v for k, v in cert.get("subjectAltName", ()) if k == "DNS"]
    return cns, sans


def check_peer_name(cert: dict[str, Any] | None, expected: str) -> None:
    """The stricter reading: every CN is ``expected`` and ``expected`` is a DNS SAN."""
    if not cert:
        raise AuthError("no peer certificate")
    cns, sans = peer_names(cert)
    if cns != [expected] or expected not in sans:
        raise AuthError(f"peer certificate names CN={cns} SAN={sans}, expected {expected}")


def _peer_cert(transport: asyncio.BaseTransport) -> dict[str, Any] | None:
    obj = transport.get_extra_info("ssl_object")
    if obj is None:
        return None
    cert = obj.getpeercert()
    return cert if isinstance(cert, dict) else None


def _still_trusted(transport: asyncio.BaseTransport, ca_file: Path) -> bool:
    """Whether an incoming link's peer certificate verifies against ``ca_file`` now."""
    obj = transport.get_extra_info("ssl_object")
    if obj is None:
        return True
    der = obj.getpeercert(binary_form=True)
    if not der:
        return False
    # The ssl module has no "verify this certificate" call; the openssl CLI does it.
    with contextlib.suppress(OSError):
        import tempfile

        with tempfile.NamedTemporaryFile("w", suffix=".pem") as f:
            f.write(ssl.DER_cert_to_PEM_cert(der))
            f.flush()
            done = subprocess.run(["openssl", "verify", "-CAfile", str(ca_file), f.name],
                                  capture_output=True, timeout=10, check=False)
            return done.returncode == 0
    return True


# --------------------------------------------------------------------------- daemon


@dataclass
class Options:
    config_path: Path
    config: ImexConfig
    state_file: Path | None = None
    pid_file: Path | None = None
    ready_delay: float = 0.0
    stuck_state: str | None = None
    usr1_window: float = USR1_WINDOW_S
    version: str = DEFAULT_VERSION
    attempt_log: Path | None = None


# --------------------------------------------------------------------------- links
# One end of a peer link as an asyncio Protocol (issue 27). Why not asyncio streams: a
# stream wakes a task for every line it reads, and a ``wait_for`` around a read starts
# one more. A node of 18 exchanges 68 keepalive lines a second and, on each SIGUSR1,
# opens and greets 17 links each way; with streams that machinery was most of a
# stand-in's CPU, which the real daemon (C++, one event loop) does not spend. Here a
# line is handled in the loop's read callback: the handshake's one line through
# ``next_line`` (a future, its deadline a timer), every later line through ``on_line``,
# called directly. It lives in this file because the stand-in runs as one lone script.

#: the longest line a link accepts (a pong carries a node's 17-link view: ~2 KB)
MAX_LINE = 64 * 1024


class LineLink(asyncio.Protocol):
    """Newline-framed bytes over one connection.

    Until ``on_line`` is set, complete lines queue for ``next_line``; once it is set,
    each line is passed to it as it arrives (the queued ones first). ``closed`` is a
    future that the end of the connection resolves with why: the transport's error,
    the error ``fail`` was given, or ``ConnectionError("connection closed")`` for an
    orderly close.
    """

    def __init__(self, on_made: Callable[[LineLink], None] | None = None,
                 on_lost: Callable[[LineLink, BaseException], None] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.closed: asyncio.Future[BaseException] = self.loop.create_future()
        self.on_line: Callable[[LineLink, bytes], None] | None = None
        self._on_made = on_made
        self._on_lost = on_lost
        self._buf = b""
        self._lines: deque[bytes] = deque()
        self._waiter: asyncio.Future[bytes] | None = None
        self._failure: BaseException | None = None

    # ---- asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike
        self.transport = cast(asyncio.Transport, transport)
        if self._on_made is not None:
            self._on_made(self)

    def data_received(self, data: bytes) -> None:
        buf = self._buf + data if self._buf else data
        start = 0
        while (end := buf.find(b"\n", start)) >= 0:
            line = buf[start:end + 1]
            start = end + 1
            if self.on_line is not None and not self._lines:
                self.on_line(self, line)
            else:
                self._lines.append(line)
                self._wake()
            if self.closed.done() or self._failure is not None:
                return
        self._buf = buf[start:]
        if len(self._buf) > MAX_LINE:
            self.fail(ValueError("line too long or unterminated"))

    def eof_received(self) -> bool | None:
        return None  # close our side too: a peer that stops sending is gone

    def connection_lost(self, exc: BaseException | None) -> None:
        why = self._failure or exc or ConnectionError("connection closed")
        if not self.closed.done():
            self.closed.set_result(why)
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_exception(why)
        if self._on_lost is not None:
            self._on_lost(self, why)

    # ---- use
    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(data)

    def start(self, on_line: Callable[[LineLink, bytes], None]) -> None:
        """Hand every line from now on, and any already queued, to ``on_line``."""
        self.on_line = on_line
        while self._lines and not self.closed.done():
            on_line(self, self._lines.popleft())

    async def next_line(self, timeout: float) -> bytes:
        """The next queued line, waiting at most ``timeout`` s (``TimeoutError``)."""
        if self._lines:
            return self._lines.popleft()
        if self.closed.done():
            raise self.closed.result()
        waiter = self._waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None
        return self._lines.popleft()

    def fail(self, why: BaseException) -> None:
        """End the link now, with ``why`` as the reason ``closed`` gives."""
        if self._failure is None:
            self._failure = why
        if self.transport is not None:
            self.transport.abort()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(b"")

    @staticmethod
    def _expire(waiter: asyncio.Future[bytes]) -> None:
        if not waiter.done():
            waiter.set_exception(TimeoutError())


@dataclass
class PeerLink:
    """One outgoing connection this daemon holds (or tries to): the row ``-N -j`` prints.

    Words (FACTS.md "IMEX: the domain view"): CONNECTED and INVALID are IMEX's documented
    JSON words; NEVER_CONNECTED and DISCONNECTED are the legend's names in capitals with
    underscores, an assumption, since the JSON word for them is undocumented.
    """

    index: int
    host: str
    status: str = "NEVER_CONNECTED"
    changed: int = field(default_factory=lambda: int(time.time()))
    ip: str | None = None
    remote: JsonDict | None = None
    last_error: str = ""
    task: asyncio.Task[None] | None = None
    connects: int = 0
    attempts: int = 0
    #: the connection while it is up, for the keepalive ticker (``ImexStandin._keepalive``)
    link: LineLink | None = None
    #: loop time the peer was last heard on this link
    heard: float = 0.0
    #: called when what ``-N -j`` shows of this link changes (``ImexStandin``'s pong memo)
    on_change: Callable[[], None] | None = None

    def set_status(self, status: str) -> None:
        if status != self.status:
            self.status = status
            self.changed = int(time.time())
            if self.on_change is not None:
                self.on_change()

    def set_ip(self, ip: str) -> None:
        if ip != self.ip:
            self.ip = ip
            if self.on_change is not None:
                self.on_change()

    def set_lost(self) -> None:
        """Not connected now: DISCONNECTED once it has been connected, else NEVER_CONNECTED."""
        self.set_status("DISCONNECTED" if self.connects else "NEVER_CONNECTED")


#: The keepalive's two constant lines (34 a second each way on a node of 18), sent and
#: recognised as bytes: a C++ daemon spends next to nothing on a keepalive, and the
#: stand-in's idle CPU is the noise its per-change figure is measured against.
PING_LINE = b'{"type":"ping"}\n'
PONG_LINE = b'{"type":"pong"}\n'


async def _read_json_line(reader: asyncio.StreamReader, timeout: float) -> JsonDict:
    """One line with a deadline: a handshake's. A link's steady traffic has none of its
    own; the keepalive ticker drops a silent link instead (``ImexStandin._keepalive``)."""
    # wait_for, not asyncio.timeout: on Python 3.11.2 a timeout in a task that once
    # swallowed a cancel (3.11's wait_for can) comes out as CancelledError, which ends
    # the link for good instead of retrying it
    return _parse_json_line(await asyncio.wait_for(reader.readline(), timeout))


def _parse_json_line(line: bytes) -> JsonDict:
    if line == PING_LINE:
        return {"type": "ping"}
    if line == PONG_LINE:
        return {"type": "pong"}
    if not line:
        raise ConnectionError("connection closed")
    if not line.endswith(b"\n"):
        raise ValueError("line too long or unterminated")
    obj = json.loads(line)
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    return obj


#: ``nvidia-imex-ctl -N``'s legend for a connection's state (FACTS.md)
TABLE_MARKS = {"CONNECTED": "C", "DISCONNECTED": "D", "NEVER_CONNECTED": "N", "INVALID": "I",
               "MISMATCH": "!M!", "AUTHENTICATING": "A", "RECOVERING": "R"}


def render_table(domain: JsonDict) -> str:
    """``nvidia-imex-ctl -N`` as text: the ``table`` command, which the C ctl prints."""
    lines = [f"Domain State: {domain.get('status')}"]
    for nid, node in domain.get("nodes", {}).items():
        lines.append(f"Node #{nid} - {node.get('host')} - {node.get('status')} "
                     f"- Version: {node.get('version')}")
        conns = node.get("connections", {})
        if conns:
            lines.append("    " + " ".join(f"{k}:{TABLE_MARKS.get(v.get('status'), '?')}"
                                           for k, v in conns.items()))
    return "\n".join(lines)


def _write_json_line(writer: asyncio.StreamWriter, obj: JsonDict) -> None:
    writer.write(json.dumps(obj, separators=(",", ":")).encode() + b"\n")


class AttemptLog:
    """Outgoing connection attempts, counted per target address and, with a path, logged.

    One JSON line per event, appended with one ``write`` on an ``O_APPEND`` descriptor (a
    reader never sees half a line): ``{"ev": "attempt", "t": start, "te": end, "peer": i,
    "host": name, "ip": address or null, "outcome": ..., "error": text}`` where outcome is
    ``connected``, ``mismatch``, ``no_address`` (resolution failed), ``refused``,
    ``timeout``, ``unreachable``, ``error`` or ``auth_failed`` (mutual TLS refused the peer);
    ``{"ev": "lost", ...}`` when a CONNECTED
    link breaks; ``{"ev": "listening", ...}`` once the daemon accepts peers. Times are
    ``time.time()`` (the same clock as the API's audit log).
    """

    def __init__(self, path: Path | None) -> None:
        self.by_ip: dict[str, int] = {}
        self._fd: int | None = None
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC,
                               0o644)

    def attempt(self, ln: PeerLink, ip: str | None, outcome: str, t: float,
                error: str = "") -> None:
        ln.attempts += 1
        if ip is not None:
            self.by_ip[ip] = self.by_ip.get(ip, 0) + 1
        self._write({"ev": "attempt", "t": t, "te": time.time(), "peer": ln.index,
                     "host": ln.host, "ip": ip, "outcome": outcome, "error": error})

    def listening(self, ip: str, port: int) -> None:
        """The daemon accepts peers from now on (``{"ev": "listening", "ip", "port"}``)."""
        self._write({"ev": "listening", "t": time.time(), "ip": ip, "port": port})

    def lost(self, ln: PeerLink, error: str) -> None:
        self._write({"ev": "lost", "t": time.time(), "peer": ln.index, "host": ln.host,
                     "ip": ln.ip, "error": error})

    def _write(self, event: JsonDict) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.write(self._fd, json.dumps(event, separators=(",", ":")).encode() + b"\n")


@dataclass
class _Incoming:
    """What the daemon keeps of one incoming link."""

    #: loop time the dialler was last heard (its hello, then its pings)
    heard: float
    peer: str
    greeted: bool = False
    #: the view this link last carried (a pong repeats a view by reference, not bytes)
    sent: bytes | None = None


def _outcome(exc: BaseException) -> str:
    """The attempt-log outcome of a failed dial."""
    if isinstance(exc, ConnectionRefusedError):
        return "refused"
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, OSError) and exc.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
        return "unreachable"
    return "error"


class ImexStandin:
    """The daemon: one instance per process (see the module docstring)."""

    def __init__(self, opts: Options, entries: list[str], node_id: int, own_ip: str) -> None:
        self.opts = opts
        self.cfg = opts.config
        self.entries = entries
        self.node_id = node_id
        self.own_ip = own_ip
        self.map_hash = nodes_hash(entries)
        self.state = "INITIALIZING"
        self.links = {i: PeerLink(i, e, on_change=self._view_changed)
                      for i, e in enumerate(entries) if i != node_id}
        self.signals_received = 0
        self.signals_acted = 0
        self._state_due = False
        #: the pong that carries ``own_view`` (None: encode it again; ``own_view_line``)
        self._view_line: bytes | None = None
        #: the handshake line, the same for every link (sent 34 times a SIGUSR1 on a
        #: node of 18): encoded once
        self._hello = (json.dumps(
            {"type": "hello", "node_id": node_id, "map_hash": self.map_hash,
             "version": opts.version}, separators=(",", ":")) + "\n").encode()
        self.signals_ignored = 0
        self.signal_log: list[JsonDict] = []
        #: the event loop's package, "uvloop" or "asyncio" (the state file; the bench notes)
        self.event_loop = ""
        self.last_acted: float | None = None
        self.starts = self._previous_starts() + 1
        #: this process's start, before its first resolution (the soak's invariant 3)
        self.started_at = time.time()
        for t in _EARLY_USR1:
            self.signals_received += 1
            self.signals_ignored += 1
            self.signal_log.append({"t": t, "acted": False, "early": True})
        self.attempt_log = AttemptLog(opts.attempt_log)
        self.hosts = HostsFile()
        self._stop = asyncio.Event()
        self._servers: list[asyncio.base_events.Server] = []
        #: incoming links, and what each has heard and sent
        self._incoming: dict[LineLink, _Incoming] = {}
        self._ticker: asyncio.Task[None] | None = None
        #: mutual TLS (None: plain TCP); replaced as a whole on an acted-on SIGUSR1
        self.server_ctx: ssl.SSLContext | None = None
        self.client_ctx: ssl.SSLContext | None = None
        self.tls_reloads = 0
        self.auth_refusals: list[JsonDict] = []
        if self.cfg.tls is not None:
            self.server_ctx = server_context(self.cfg.tls)
            self.client_ctx = client_context(self.cfg.tls)

    # ---- views
    def own_view(self) -> JsonDict:
        """This node's entry of ``-N -j``: its state and the links it holds right now."""
        return {
            "status": self.state,
            "host": self.own_ip,
            "hostName": self.entries[self.node_id],
            "connections": {
                str(i): {"host": ln.ip or ln.host, "status": ln.status, "changed": ln.changed}
                for i, ln in sorted(self.links.items())
            },
            "version": self.opts.version,
        }

    def own_view_line(self) -> bytes:
        """The pong that carries ``own_view``, encoded once per change of what it says
        (the same bytes object while nothing changed: a link compares by identity).
        Every peer pings every 0.5 s; encoding the 17-link view for each pong was most of
        an idle stand-in's CPU, which a C++ daemon's keepalive does not spend. A change
        drops the memo (``_view_changed``) rather than each pong comparing a key: that
        key, built over 17 links, was still 14 % of a stand-in's CPU (2026-12-06)."""
        if self._view_line is None:
            self._view_line = (json.dumps({"type": "pong", "status": self.own_view()},
                                          separators=(",", ":")) + "\n").encode()
        return self._view_line

    def _view_changed(self) -> None:
        self._view_line = None

    def domain_view(self) -> JsonDict:
        """``-N -j``: our own entry, and each peer's own entry as relayed over our link to
        it; a peer we hold no link to is UNAVAILABLE with every connection INVALID."""
        nodes: dict[str, JsonDict] = {str(self.node_id): self.own_view()}
        for i, ln in self.links.items():
            if ln.status == "CONNECTED" and ln.remote is not None:
                nodes[str(i)] = ln.remote
            else:
                nodes[str(i)] = {
                    "status": "UNAVAILABLE", "host": ln.ip or ln.host, "hostName": ln.host,
                    "connections": {str(j): {"host": e, "status": "INVALID", "changed": 0}
                                    for j, e in enumerate(self.entries) if j != i},
                    "version": ""}
        nodes = dict(sorted(nodes.items(), key=lambda kv: int(kv[0])))
        if self.state != "READY":
            domain = "DOWN"
        elif all(ln.status == "CONNECTED" for ln in self.links.values()):
            domain = "UP"
        else:
            domain = "DEGRADED"
        return {"nodes": nodes, "timestamp": int(time.time()), "status": domain}

    def state_doc(self) -> JsonDict:
        return {
            "pid": os.getpid(),
            "state": self.state,
            "node_id": self.node_id,
            "own_ip": self.own_ip,
            "map_hash": self.map_hash,
            "nodes": self.entries,
            "starts": self.starts,
            "started": self.started_at,
            "signals_received": self.signals_received,
            "signals_acted": self.signals_acted,
            "signals_ignored": self.signals_ignored,
            "signal_log": self.signal_log,
            "peers": {
                str(i): {"host": ln.host, "ip": ln.ip, "status": ln.status,
                         "connects": ln.connects, "attempts": ln.attempts,
                         "last_error": ln.last_error}
                for i, ln in sorted(self.links.items())
            },
            "attempts_by_ip": dict(sorted(self.attempt_log.by_ip.items())),
            "running": self.state != "SHUTTING_DOWN",
            "tls": self.cfg.tls is not None,
            "tls_reloads": self.tls_reloads,
            "event_loop": self.event_loop,
            "auth_refusals": self.auth_refusals,
            "updated": time.time(),
        }

    def _previous_starts(self) -> int:
        if self.opts.state_file is None:
            return 0
        try:
            return int(json.loads(self.opts.state_file.read_text()).get("starts", 0))
        except (OSError, ValueError, AttributeError, TypeError):
            return 0

    def write_state(self) -> None:
        """The state file, once per turn of the event loop however many changes the turn
        made (a SIGUSR1 changes 17 links twice each; real IMEX writes no such file, so
        the stand-in should not spend a serialisation per change on it).

        Never later than the next turn: whatever a ctl query has seen (it is answered on
        a later turn) is in the file already, and tests rely on that order. Writing at
        most every 0.2 s instead (792ee9d) broke it: a test read a count that was one
        connect behind what the ctl had just shown, and waited for a number the daemon
        had passed. It saved no measurable CPU either."""
        if self.opts.state_file is None:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            self._write_state_now()
            return
        if not self._state_due:
            self._state_due = True
            loop.call_soon(self._write_state_now)

    def _write_state_now(self) -> None:
        self._state_due = False
        if self.opts.state_file is None:
            return
        tmp = self.opts.state_file.with_name(self.opts.state_file.name + ".tmp")
        try:
            # one line: an indented dump is json's pure-Python encoder
            tmp.write_text(json.dumps(self.state_doc(), sort_keys=True))
            os.replace(tmp, self.opts.state_file)
        except OSError as e:
            log.warning("cannot write state file %s: %s", self.opts.state_file, e)

    def set_state(self, state: str) -> None:
        if state != self.state:
            log.info("state %s -> %s", self.state, state)
            self.state = state
            self._view_changed()
            self.write_state()

    # ---- signals
    def on_usr1(self) -> None:
        now = time.monotonic()
        self.signals_received += 1
        acted = self.last_acted is None or now - self.last_acted >= self.opts.usr1_window
        self.signal_log.append({"t": time.time(), "acted": acted})
        del self.signal_log[:-SIGNAL_LOG_MAX]
        if acted:
            self.last_acted = now
            self.signals_acted += 1
            log.info("SIGUSR1: restarting all outgoing connections (re-resolving names)")
            self._reload_tls()
            for ln in self.links.values():
                self._restart_link(ln)
        else:
            self.signals_ignored += 1
            log.info("SIGUSR1 ignored: less than %.0f s since the last one acted on",
                     self.opts.usr1_window)
        self.write_state()

    def _reload_tls(self) -> None:
        """Load the key, certificate and CA files again (SIGUSR1); keep the old on failure."""
        files = self.cfg.tls
        if files is None:
            return
        try:
            server, client = server_context(files), client_context(files)
        except (OSError, ssl.SSLError) as e:
            log.error("SIGUSR1: cannot reload the TLS credentials (%s); keeping the old ones", e)
            return
        self.server_ctx, self.client_ctx = server, client
        self.tls_reloads += 1
        log.info("SIGUSR1: TLS credentials reloaded")
        for link in list(self._incoming):
            if link.transport is not None and not _still_trusted(link.transport,
                                                                 files.server_ca):
                log.info("incoming link no longer trusted after the reload: closing it")
                link.close()

    def _refused(self, direction: str, who: str, why: str) -> None:
        self.auth_refusals.append({"t": time.time(), "dir": direction, "peer": who,
                                   "why": why})
        del self.auth_refusals[:-SIGNAL_LOG_MAX]

    def expected_name(self, node: int) -> str:
        """The name a peer's certificate must carry (override, else its nodes-file entry)."""
        files = self.cfg.tls
        if files is not None and files.target_override:
            return files.target_override
        return self.entries[node]

    def on_hup(self) -> None:
        log.info("SIGHUP: state=%s node=%d peers=%s", self.state, self.node_id,
                 {i: ln.status for i, ln in self.links.items()})

    # ---- peer links
    def _restart_link(self, ln: PeerLink) -> None:
        if ln.task is not None:
            ln.task.cancel()
            ln.remote = None
            ln.set_lost()
        ln.task = asyncio.get_running_loop().create_task(self._peer_loop(ln),
                                                         name=f"peer-{ln.index}")

    async def _peer_loop(self, ln: PeerLink) -> None:
        loop = asyncio.get_running_loop()
        delay = RETRY_FIRST_S
        port = self.cfg.server_port
        while True:
            link: LineLink | None = None
            logged = False  # this attempt's outcome is in the attempt log already
            try:
                t_try = time.time()
                addrs = self.hosts.lookup(ln.host)
                if addrs is None:  # not in /etc/hosts: the resolver (DNS), in a thread
                    try:
                        # in the default executor, as the standard loop's getaddrinfo
                        # does; uvloop's runs in libuv's pool, which its close waits on
                        # (a lookup stuck on a silent DNS server held SIGTERM up)
                        infos = await loop.run_in_executor(None, functools.partial(
                            socket.getaddrinfo, ln.host, port, type=socket.SOCK_STREAM))
                    except OSError as e:  # socket.gaierror: the name does not resolve now
                        self.attempt_log.attempt(ln, None, "no_address", t_try, str(e))
                        logged = True
                        raise
                    addrs = list(dict.fromkeys(str(i[4][0]) for i in infos))
                if addrs and addrs[0] != ln.ip:
                    log.info("peer %d %s resolves to %s", ln.index, ln.host, ", ".join(addrs))
                logged = True  # _dial logs each failed address; a success is logged below
                link, ip = await self._dial(ln, addrs, port)
                ln.set_ip(ip)
                t_try = time.time()
                try:
                    if self.client_ctx is not None:
                        # TCP is up: from here on a failure is the peer failing authentication
                        ln.set_status("AUTHENTICATING")
                        try:
                            assert link.transport is not None
                            tls = await asyncio.wait_for(loop.start_tls(
                                link.transport, link, self.client_ctx,
                                server_hostname=self.expected_name(ln.index)),
                                CONNECT_TIMEOUT_S)
                        except (ssl.SSLError, OSError, TimeoutError, ConnectionError) as e:
                            raise AuthError(f"TLS handshake: {e or type(e).__name__}") from e
                        if tls is None:
                            raise AuthError("TLS handshake: the link closed")
                        link.transport = tls
                        check_peer_name(_peer_cert(tls), self.expected_name(ln.index))
                    link.write(self._hello)
                    hello = _parse_json_line(await link.next_line(PEER_TIMEOUT_S))
                    if hello.get("node_id") != ln.index:
                        raise ValueError(f"peer at {ip} says it is node "
                                         f"{hello.get('node_id')}, expected {ln.index}")
                except AuthError as e:
                    self.attempt_log.attempt(ln, ip, "auth_failed", t_try, str(e))
                    raise
                except (OSError, ValueError, TimeoutError, ConnectionError) as e:
                    self.attempt_log.attempt(ln, ip, _outcome(e), t_try, str(e))
                    raise
                ln.connects += 1
                if hello.get("map_hash") != self.map_hash:
                    log.warning("peer %d (%s): node map mismatch, communication disabled",
                                ln.index, ln.host)
                    ln.set_status("MISMATCH")
                else:
                    log.info("peer %d (%s at %s) connected", ln.index, ln.host, ip)
                    ln.set_status("CONNECTED")
                self.attempt_log.attempt(ln, ip, ln.status.lower(), t_try)
                ln.last_error = ""
                self.write_state()
                delay = RETRY_FIRST_S
                logged = False
                ln.link, ln.heard = link, loop.time()
                link.start(functools.partial(self._pong, ln))
                link.write(PING_LINE)  # the first ping now; the ticker sends the next ones
                try:
                    # the pongs are read by _pong meanwhile; a silence the keepalive
                    # caught ends the link with the TimeoutError it failed it with
                    raise await link.closed
                except (OSError, ValueError, TimeoutError, ConnectionError) as e:
                    self.attempt_log.lost(ln, str(e) or type(e).__name__)
                    logged = True
                    raise
                finally:
                    if ln.link is link:
                        ln.link = None
            except asyncio.CancelledError:
                raise
            except (AuthError, ssl.SSLError) as e:
                # reachable, but not who it must be: never CONNECTED, shown as A
                msg = f"authentication failed: {e}"
                if msg != ln.last_error:
                    log.warning("peer %d (%s): %s; retrying", ln.index, ln.host, msg)
                    self._refused("out", f"{ln.host} at {ln.ip}", str(e))
                ln.last_error = msg
                ln.remote = None
                ln.set_status("AUTHENTICATING")
                self.write_state()
            except (OSError, ValueError, TimeoutError, ConnectionError, IndexError) as e:
                msg = str(e) or type(e).__name__
                if not logged:
                    self.attempt_log.attempt(ln, ln.ip, _outcome(e), time.time(), msg)
                if ln.status == "CONNECTED" or msg != ln.last_error:
                    log.info("peer %d (%s): %s; retrying", ln.index, ln.host, msg)
                ln.last_error = msg
                ln.remote = None
                ln.set_lost()
                self.write_state()
            finally:
                if link is not None:
                    link.close()
            await asyncio.sleep(delay)
            delay = min(delay * 2, RETRY_MAX_S)

    def _pong(self, ln: PeerLink, link: LineLink, line: bytes) -> None:
        """A line on an outgoing link after its handshake: the peer's pong (called from
        the link's read callback: no task per line)."""
        if link is not ln.link:
            return  # a link being replaced
        try:
            pong = _parse_json_line(line)
        except ValueError as e:
            link.fail(e)
            return
        ln.heard = link.loop.time()
        view = pong.get("status")
        if isinstance(view, dict):
            ln.remote = view

    async def _dial(self, ln: PeerLink, addrs: list[str], port: int
                    ) -> tuple[LineLink, str]:
        """Connect to the first of ``addrs`` that answers, in order; each failure logged."""
        if not addrs:
            self.attempt_log.attempt(ln, None, "no_address", time.time(), "no address")
            raise IndexError("the resolver returned no address")
        loop = asyncio.get_running_loop()
        own_v6 = ":" in self.own_ip  # resolver output and our own address: no parse needed
        last: BaseException | None = None
        for ip in addrs:
            ln.set_ip(ip)
            local = (self.own_ip, 0) if (":" in ip) == own_v6 else None
            t_try = time.time()
            try:
                _, link = await asyncio.wait_for(
                    loop.create_connection(LineLink, ip, port, local_addr=local),
                    CONNECT_TIMEOUT_S)
            except (OSError, TimeoutError) as e:
                self.attempt_log.attempt(ln, ip, _outcome(e), t_try, str(e) or type(e).__name__)
                last = e
                continue
            return link, ip
        assert last is not None
        raise last

    def _incoming_made(self, link: LineLink) -> None:
        """An incoming link: its peer's hello is due within ``PEER_TIMEOUT_S``."""
        assert link.transport is not None
        self._incoming[link] = _Incoming(link.loop.time(),
                                         str(link.transport.get_extra_info("peername")))
        link.start(self._incoming_line)
        link.loop.call_later(PEER_TIMEOUT_S, self._hello_due, link)

    def _hello_due(self, link: LineLink) -> None:
        inc = self._incoming.get(link)
        if inc is not None and not inc.greeted:
            link.fail(TimeoutError("no hello"))

    def _incoming_line(self, link: LineLink, line: bytes) -> None:
        """A line on an incoming link: the dialler's hello, then its pings (called from
        the link's read callback: no task per line)."""
        inc = self._incoming.get(link)
        if inc is None:
            return
        try:
            msg = _parse_json_line(line)
            inc.heard = link.loop.time()
            if not inc.greeted:
                self._greet(link, inc, msg)
            elif msg.get("type") == "ping":
                view = self.own_view_line()
                # the view only when it changed: the dialler keeps the last one it got
                link.write(view if view is not inc.sent else PONG_LINE)
                inc.sent = view
        except AuthError as e:
            log.warning("incoming connection refused: %s", e)
            link.fail(e)
        except ValueError as e:
            link.fail(e)

    def _greet(self, link: LineLink, inc: _Incoming, hello: JsonDict) -> None:
        if hello.get("type") != "hello":
            raise ValueError("expected hello")
        if self.server_ctx is not None:
            node = hello.get("node_id")
            if not isinstance(node, int) or not 0 <= node < len(self.entries) or \
                    node == self.node_id:
                raise AuthError(f"incoming hello names node {node!r}")
            try:
                assert link.transport is not None
                check_peer_name(_peer_cert(link.transport), self.expected_name(node))
            except AuthError as e:
                self._refused("in", f"node {node} from {inc.peer}", str(e))
                raise
        if hello.get("map_hash") != self.map_hash:
            log.warning("incoming node %s: node map mismatch", hello.get("node_id"))
        link.write(self._hello)
        inc.greeted = True

    def _incoming_lost(self, link: LineLink, why: BaseException) -> None:
        inc = self._incoming.pop(link, None)
        if inc is not None and not inc.greeted and isinstance(why, ssl.SSLError):
            self._refused("in", inc.peer, f"TLS handshake: {why}")
            log.warning("incoming connection refused: TLS handshake with %s: %s", inc.peer, why)
        else:
            log.debug("incoming connection ended: %s", why)

    # ---- command port
    async def _serve_cmd(self, reader: asyncio.StreamReader,
                         writer: asyncio.StreamWriter) -> None:
        try:
            req = await _read_json_line(reader, 5)
            cmd = req.get("cmd")
            if cmd == "state":
                reply: JsonDict = {"state": self.state}
            elif cmd == "nodes":
                reply = self.domain_view()
            elif cmd == "stats":
                reply = self.state_doc()
            elif cmd == "table":  # ``nvidia-imex-ctl -N`` without -j
                reply = {"table": render_table(self.domain_view())}
            else:
                reply = {"error": f"unknown command {cmd!r}"}
            _write_json_line(writer, reply)
            await writer.drain()
        except (OSError, ValueError, TimeoutError, ConnectionError) as e:
            log.info("command connection: %s", e)
        finally:
            writer.close()

    # ---- lifecycle
    def _listen_context(self) -> ssl.SSLContext | None:
        """The listener's context: it hands every handshake the current credentials.

        asyncio fixes a server's context at start, so the reloadable one is swapped in
        per connection from the SNI callback (OpenSSL calls it for every ClientHello).
        """
        if self.server_ctx is None or self.cfg.tls is None:
            return None
        base = server_context(self.cfg.tls)

        def pick(obj: ssl.SSLObject, _name: str | None, _ctx: ssl.SSLContext) -> None:
            if self.server_ctx is not None:
                obj.context = self.server_ctx

        base.sni_callback = pick  # type: ignore[assignment]
        return base

    async def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._servers.append(await loop.create_server(
            lambda: LineLink(self._incoming_made, self._incoming_lost),
            self.own_ip, self.cfg.server_port, reuse_address=True, ssl=self._listen_context(),
            ssl_handshake_timeout=PEER_TIMEOUT_S if self.server_ctx else None))
        if self.cfg.cmd_enabled:
            self._servers.append(await asyncio.start_server(
                self._serve_cmd, self.cfg.cmd_address, self.cfg.cmd_port, limit=MAX_LINE,
                reuse_address=True))
        self.attempt_log.listening(self.own_ip, self.cfg.server_port)
        log.info("node %d (%s) listening on %s:%d; %d peers", self.node_id,
                 self.entries[self.node_id], self.own_ip, self.cfg.server_port, len(self.links))
        self.set_state("WAITING_FOR_PEERS")
        self._ticker = loop.create_task(self._keepalive(), name="keepalive")
        for ln in self.links.values():
            self._restart_link(ln)

    async def _keepalive(self) -> None:
        """Every ``PING_INTERVAL_S``, one pass over every link: ping each outgoing link,
        and drop a link whose peer has been silent too long (``PEER_TIMEOUT_S`` for an
        outgoing one, whose pongs stopped; four times that for an incoming one, whose
        pings stopped). The dropped outgoing link is retried as after a lost pong.

        One timer for all links, not a sleep and a read deadline per link: on a node of
        18 that was 68 timers and 34 waiting tasks a second, most of an idle stand-in's
        CPU, which a C++ daemon's keepalive does not spend (issue 27)."""
        loop = asyncio.get_running_loop()
        last = loop.time()
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            now = loop.time()
            # a pass that comes late (this process was stopped, or starved of CPU) has
            # not yet let the links read what arrived meanwhile: it judges no silence
            judge, last = now - last < 2 * PING_INTERVAL_S, now
            for ln in self.links.values():
                link = ln.link
                if link is None:
                    continue
                if judge and now - ln.heard > PEER_TIMEOUT_S:
                    link.fail(TimeoutError())
                else:
                    link.write(PING_LINE)
            if judge:
                for link, inc in list(self._incoming.items()):
                    if now - inc.heard > PEER_TIMEOUT_S * 4:
                        link.fail(TimeoutError("no ping"))

    async def run(self, started: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        self.event_loop = type(loop).__module__.partition(".")[0]
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGQUIT):
            loop.add_signal_handler(sig, self._stop.set)
        loop.add_signal_handler(signal.SIGUSR1, self.on_usr1)
        loop.add_signal_handler(signal.SIGHUP, self.on_hup)
        self.write_state()
        await self.start()
        if started is not None:
            started()
        ready = loop.create_task(self._become_ready())
        try:
            await self._stop.wait()
        finally:
            ready.cancel()
            await self.shutdown()

    async def _become_ready(self) -> None:
        if self.opts.stuck_state:
            self.set_state(self.opts.stuck_state)
            return
        if self.opts.ready_delay > 0:
            await asyncio.sleep(self.opts.ready_delay)
        self.set_state("READY")

    async def shutdown(self) -> None:
        self.set_state("SHUTTING_DOWN")
        if self._ticker is not None:
            self._ticker.cancel()
        tasks = [ln.task for ln in self.links.values() if ln.task is not None]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for srv in self._servers:
            srv.close()
        for link in list(self._incoming):
            link.close()
        for srv in self._servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(srv.wait_closed(), 2)
        log.info("stopped")
        self.write_state()



# --------------------------------------------------------------------------- test harness

BIN_DIR = Path(__file__).resolve().parent / "bin"
REPO_ROOT = Path(__file__).resolve().parents[2]


class NodeLike(Protocol):
    """What :class:`StandinProcess` needs of a ``tests.sandbox.netns.Node``."""

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]: ...

    def run(self, argv: Sequence[str], *, check: bool = True, timeout: float = 30,
            **kwargs: Any) -> subprocess.CompletedProcess[str]: ...


def write_standin_files(
    directory: Path,
    entries: Sequence[str],
    *,
    server_port: int = 50000,
    cmd_port: int = 50005,
    bind_ip: str = "",
    cmd_ip: str = "",
    daemonize: bool = False,
    log_file: bool = True,
) -> Path:
    """Write ``nodes_config.cfg`` and ``config.cfg`` (log ``imex.log``) into ``directory``.

    Returns the config path, which is what ``nvidia-imex -c`` and ``nvidia-imex-ctl -c`` take.
    """
    directory.mkdir(parents=True, exist_ok=True)
    nodes = directory / "nodes_config.cfg"
    nodes.write_text("".join(e + "\n" for e in entries))
    cfg = directory / "config.cfg"
    cfg.write_text(render_config(
        server_port=server_port, node_config_file=nodes, cmd_port=cmd_port,
        bind_interface_ip=bind_ip, cmd_bind_interface_ip=cmd_ip,
        log_file_name=directory / "imex.log" if log_file else "", daemonize=daemonize))
    return cfg


@functools.cache
def precompile() -> None:
    """Write this module's bytecode cache now, once per process. A stand-in starts again
    on every own-address move, and compiling these 1,700 lines took about 25 of its
    100 CPU-ms under ``PYTHONDONTWRITEBYTECODE=1``; a real daemon starts from its binary."""
    import py_compile

    py_compile.compile(__file__, doraise=True)


def _child_env() -> dict[str, str]:
    pp = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": f"{REPO_ROOT}:{pp}" if pp else str(REPO_ROOT)}


def _build_native(env: dict[str, str]) -> None:
    """Bring the C daemon (``bin/.build/nvidia-imex``) up to date here, once, before a
    child starts: left to each child's wrapper, 18 stand-ins started together on a fresh
    clone each ran gcc, and on 2 cores the first wrote its pid after ``pid()``'s 15 s
    (make bench's ``standins`` part, session 34). A subprocess, not an import: this file
    is also the guest image's ``/usr/bin/nvidia-imex``, which has no tests package."""
    binary = BIN_DIR / ".build" / "nvidia-imex"
    source = Path(__file__).with_name("imex_standin.c")
    if binary.exists() and binary.stat().st_mtime_ns > source.stat().st_mtime_ns:
        return
    done = subprocess.run([sys.executable, "-m", "tests.sandbox.ctl_build"], cwd=REPO_ROOT,
                          env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise ImexStandinError(f"building the C stand-in failed: {done.stderr.strip()}")


@dataclass
class StandinProcess:
    """A running stand-in daemon (optionally inside a netns node) and how to ask it things.

    ``StandinProcess.start(cfg, node=fabric.nodes[0])``; ``.query_state()`` is ``-q``,
    ``.domain()`` is ``-N -j`` (both through the ctl stand-in, inside the node), ``.state()``
    is the state file (counters, resolved peer addresses).
    """

    config: Path
    state_file: Path
    proc: subprocess.Popen[Any]
    node: NodeLike | None = None

    @classmethod
    def start(cls, config: Path, *, node: NodeLike | None = None,
              state_file: Path | None = None, args: Sequence[str] = (),
              impl: str | None = None) -> StandinProcess:
        """``impl``: "python" or "c" (bin/nvidia-imex's IMEX_STANDIN_IMPL); None: as this
        process's environment says (the Python daemon when it says nothing)."""
        precompile()
        state = state_file or config.parent / "state.json"
        argv = [str(BIN_DIR / "nvidia-imex"), "-c", str(config), "--state-file", str(state),
                *args]
        env = _child_env()
        if impl is not None:
            env["IMEX_STANDIN_IMPL"] = impl
        if env.get("IMEX_STANDIN_IMPL") == "c":
            _build_native(env)
        kw: dict[str, Any] = {"cwd": REPO_ROOT, "env": env, "stderr": subprocess.DEVNULL}
        proc = node.popen(argv, **kw) if node is not None else subprocess.Popen(argv, **kw)
        return cls(config, state, proc, node)

    def state(self) -> JsonDict:
        """The state file ({} before the daemon wrote it)."""
        try:
            doc = json.loads(self.state_file.read_text())
        except (OSError, ValueError):
            return {}
        return doc if isinstance(doc, dict) else {}

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        argv = [str(BIN_DIR / "nvidia-imex-ctl"), "-c", str(self.config), *args]
        if self.node is not None:
            return self.node.run(argv, check=False, cwd=REPO_ROOT, env=_child_env())
        return subprocess.run(argv, capture_output=True, text=True, cwd=REPO_ROOT,
                              env=_child_env(), timeout=30, check=False)

    def query_state(self) -> str | None:
        """``nvidia-imex-ctl -q``: the state line, None when the daemon is unreachable."""
        out = self.ctl("-q")
        return out.stdout.strip() if out.returncode == 0 else None

    def domain(self) -> JsonDict:
        """``nvidia-imex-ctl -N -j`` as a dict ({} when unreachable)."""
        out = self.ctl("-N", "-j")
        if out.returncode != 0:
            return {}
        doc = json.loads(out.stdout)
        return doc if isinstance(doc, dict) else {}

    def pid(self, timeout: float = 15.0) -> int:
        """The daemon's own pid (from the state file: wrappers and DAEMONIZE fork)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pid = self.state().get("pid")
            if isinstance(pid, int):
                return pid
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise ImexStandinError(f"stand-in with {self.config} never wrote its pid")

    def signal(self, sig: int) -> None:
        os.kill(self.pid(), sig)

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM and wait; SIGKILL after ``timeout``. Returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                return self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait(timeout)

# --------------------------------------------------------------------------- entry point


def _setup_logging(cfg: ImexConfig, verbose: bool) -> None:
    handler: logging.Handler
    if cfg.log_file_name:
        handler = logging.FileHandler(cfg.log_file_name)
    else:
        handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter(
        "%(asctime)s imex-standin[%(process)d] %(levelname)s %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)


def prepare(opts: Options) -> tuple[list[str], int, str]:
    """The start-up checks IMEX does before it serves anything (raises on failure)."""
    entries = read_nodes(opts.config.node_config_file)
    if not entries:
        raise ImexStandinError(
            f"node configuration file {opts.config.node_config_file} holds no nodes")
    node_id, own_ip = find_own_node(entries, resolve_all, local_addresses(),
                                    opts.config.bind_interface_ip)
    return entries, node_id, own_ip


def _new_loop() -> asyncio.AbstractEventLoop:
    """uvloop's loop where it is importable (the tests' venv), else the standard one (a
    guest image's bare python3, or ``-I -S``). Same behaviour either way; uvloop's loop
    and transports are C, as a C++ daemon's are: on a node of 18 a SIGUSR1 round cost
    10.2 CPU-ms on it against 13.8 on the standard loop, and the keepalive 2.2 CPU-ms a
    second against 3.9 (``python -m tests.bench standins``, 2026-12-06)."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
    return loop


def _run(opts: Options, entries: list[str], node_id: int, own_ip: str,
         started: Callable[[], None] | None) -> int:
    async def amain() -> None:
        daemon = ImexStandin(opts, entries, node_id, own_ip)
        await daemon.run(started)

    # asyncio.run() would then wait for the resolver threads, and one blocked in
    # getaddrinfo (DNS unreachable, a name missing from /etc/hosts mid-rewrite) held
    # SIGTERM up for 10 s and more; real IMEX exits at once. So: cancel what is left,
    # close the loop without joining its executor, and __main__ exits with os._exit.
    loop = _new_loop()
    asyncio.set_event_loop(loop)
    try:
        loop.run_until_complete(amain())
    finally:
        left = asyncio.all_tasks(loop)
        for task in left:
            task.cancel()
        if left:
            loop.run_until_complete(asyncio.gather(*left, return_exceptions=True))
        loop.run_until_complete(loop.shutdown_asyncgens())
        asyncio.set_event_loop(None)
        loop.close()
    return 0


def _daemonize(opts: Options, go: Callable[[Callable[[], None]], int]) -> int:
    """Fork like a ``Type=forking`` service: the parent exits once the child listens."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid > 0:
        os.close(wfd)
        with os.fdopen(rfd, "rb") as r:
            msg = r.read()
        if msg.startswith(b"OK"):
            return 0
        sys.stderr.write(msg.decode(errors="replace") or "nvidia-imex stand-in failed\n")
        return 1
    # child
    os.close(rfd)
    os.setsid()
    if os.fork() > 0:
        os._exit(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    if opts.config.log_file_name:
        os.dup2(devnull, 1)
        os.dup2(devnull, 2)

    def started() -> None:
        if opts.pid_file is not None:
            opts.pid_file.write_text(f"{os.getpid()}\n")
        os.write(wfd, b"OK\n")
        os.close(wfd)

    try:
        rc = go(started)
    except BaseException as e:  # report to the waiting parent, then exit
        with contextlib.suppress(OSError):
            os.write(wfd, f"nvidia-imex stand-in: {e}\n".encode())
        os._exit(1)
    os._exit(rc)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nvidia-imex (stand-in)",
                                description="IMEX daemon stand-in for tests")
    p.add_argument("-c", "--config", type=Path, default=Path("/etc/nvidia-imex/config.cfg"))
    p.add_argument("--state-file", type=Path)
    p.add_argument("--pid-file", type=Path)
    p.add_argument("--ready-delay", type=float, default=0.0,
                   help="seconds in WAITING_FOR_PEERS before READY")
    p.add_argument("--stuck-state", choices=STATES,
                   help="never reach READY; stay in this state")
    p.add_argument("--usr1-window", type=float, default=USR1_WINDOW_S,
                   help="SIGUSR1 rate limit in seconds (IMEX: 5)")
    p.add_argument("--version-string", default=DEFAULT_VERSION)
    p.add_argument("--attempt-log", type=Path,
                   help="append one JSON line per outgoing connection attempt (benchmarks)")
    p.add_argument("-v", "--verbose", action="store_true")
    p.add_argument("--version", action="store_true",
                   help='print "IMEX version is: X" as nvidia-imex --version does, and exit')
    args = p.parse_args(argv)
    if args.version:
        print(f"IMEX version is: {args.version_string}")
        return 0
    try:
        cfg = load_config(args.config)
    except ConfigFileError as e:
        print(f"nvidia-imex: {e}", file=sys.stderr)
        return 1
    opts = Options(config_path=args.config, config=cfg, state_file=args.state_file,
                   pid_file=args.pid_file, ready_delay=args.ready_delay,
                   stuck_state=args.stuck_state, usr1_window=args.usr1_window,
                   version=args.version_string, attempt_log=args.attempt_log)
    _setup_logging(cfg, args.verbose)
    try:
        entries, node_id, own_ip = prepare(opts)
    except ImexStandinError as e:
        log.error("%s", e)
        if cfg.log_file_name:
            print(f"nvidia-imex: {e}", file=sys.stderr)
        return 1

    def go(started: Callable[[], None] | None) -> int:
        try:
            return _run(opts, entries, node_id, own_ip, started)
        except OSError as e:
            raise ImexStandinError(f"cannot listen: {e}") from e

    if cfg.daemonize:
        return _daemonize(opts, go)
    if opts.pid_file is not None:
        opts.pid_file.write_text(f"{os.getpid()}\n")
    try:
        return go(None)
    except ImexStandinError as e:
        log.error("%s", e)
        return 1


if __name__ == "__main__":
    code = main()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # no interpreter exit: it would join a resolver thread still blocked


__all__ = [
    "NO_MATCH_MESSAGE",
    "STATES",
    "AttemptLog",
    "ConfigFileError",
    "ImexConfig",
    "ImexStandin",
    "ImexStandinError",
    "NoLocalMatchError",
    "Options",
    "StandinProcess",
    "find_own_node",
    "load_config",
    "nodes_hash",
    "parse_config",
    "read_nodes",
    "render_config",
    "write_standin_files",
]
