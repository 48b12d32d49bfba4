"""A stand-in for ``nvidia-imex-ctl``, talking to :mod:`tests.sandbox.imex_standin`.

Behaves as FACTS.md describes the real tool, for the options the guest agent and the tests
use:

* ``-q``: the local daemon's state on one line (``READY``, ``WAITING_FOR_PEERS``, ...).
* ``-N -j``: the domain as JSON, in the real tool's shape:
  ``{"nodes": {"0": {"status": "READY", "host": ..., "connections": {"1": {"host": ...,
  "status": "CONNECTED", "changed": ...}}, "version": ...}}, "timestamp": ...,
  "status": "UP"}``; domain ``UP`` (own node READY, every peer CONNECTED), ``DEGRADED``,
  ``DOWN`` (own node not READY). ``-N`` without ``-j`` prints a table where a node-map
  mismatch shows as ``!M!``.
* ``-c CONFIG`` reads ``IMEX_CMD_PORT``/``IMEX_CMD_BIND_INTERFACE_IP`` from the daemon's
  config.cfg (default ``/etc/nvidia-imex/config.cfg``); ``-i IP PORT`` names the daemon.
* A daemon that cannot be reached: a message on stderr and exit status 1, nothing on stdout.

Standard library only and independent of the daemon's module, so this one file can be
copied into a guest image as ``nvidia-imex-ctl`` (as ``imex_standin.py`` can as
``nvidia-imex``).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

DEFAULT_CONFIG = Path("/etc/nvidia-imex/config.cfg")
DEFAULT_CMD_PORT = 50005


class CtlError(Exception):
    """The daemon could not be asked (unreachable, bad reply, unreadable config)."""


def cmd_target(config_text: str) -> tuple[str, int]:
    """Pure: the command address from config.cfg (``IMEX_CMD_BIND_INTERFACE_IP``/``_PORT``)."""
    values = {}
    for line in config_text.splitlines():
        key, sep, value = line.strip().partition("=")
        if sep and not key.startswith("#"):
            values[key.strip()] = value.strip()
    port_text = values.get("IMEX_CMD_PORT") or str(DEFAULT_CMD_PORT)
    if not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise CtlError(f"IMEX_CMD_PORT={port_text!r}: not a port number")
    return values.get("IMEX_CMD_BIND_INTERFACE_IP") or "127.0.0.1", int(port_text)


def request(ip: str, port: int, cmd: str, timeout: float = 3.0) -> dict[str, Any]:
    """One command round trip to the stand-in's command port."""
    try:
        with socket.create_connection((ip, port), timeout=timeout) as s:
            s.sendall(json.dumps({"cmd": cmd}).encode() + b"\n")
            buf = b""
            while not buf.endswith(b"\n"):
                chunk = s.recv(65536)
                if not chunk:
                    break
                buf += chunk
    except OSError as e:
        raise CtlError(f"cannot connect to the IMEX daemon at {ip}:{port}: {e}") from e
    try:
        reply = json.loads(buf)
    except ValueError as e:
        raise CtlError(f"bad reply from the IMEX daemon at {ip}:{port}: {e}") from e
    if not isinstance(reply, dict):
        raise CtlError(f"bad reply from the IMEX daemon at {ip}:{port}: not an object")
    if "error" in reply:
        raise CtlError(f"IMEX daemon: {reply['error']}")
    return reply


def render_table(domain: dict[str, Any]) -> str:
    lines = [f"Domain State: {domain.get('status')}"]
    for nid, node in domain.get("nodes", {}).items():
        lines.append(f"Node #{nid} - {node.get('host')} - {node.get('status')} "
                     f"- Version: {node.get('version')}")
        conns = node.get("connections", {})
        if conns:
            marks = {"CONNECTED": "C", "DISCONNECTED": "D", "NEVER_CONNECTED": "N",
                     "INVALID": "I", "MISMATCH": "!M!", "AUTHENTICATING": "A",
                     "RECOVERING": "R"}
            lines.append("    " + " ".join(f"{k}:{marks.get(v.get('status'), '?')}"
                                           for k, v in conns.items()))
    return "\n".join(lines)


def _target(args: argparse.Namespace) -> tuple[str, int]:
    if args.ip is not None:
        ip, port = args.ip
        return ip, int(port)
    cfg_path: Path = args.config or DEFAULT_CONFIG
    if args.config is None and not cfg_path.exists():
        return "127.0.0.1", DEFAULT_CMD_PORT
    try:
        text = cfg_path.read_text()
    except OSError as e:
        raise CtlError(f"cannot read {cfg_path}: {e}") from e
    return cmd_target(text)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nvidia-imex-ctl (stand-in)")
    p.add_argument("-q", action="store_true", help="print the local state on one line")
    p.add_argument("-N", action="store_true", help="domain status of all nodes")
    p.add_argument("-j", action="store_true", help="JSON output (with -N)")
    p.add_argument("-c", dest="config", type=Path, help="daemon config.cfg")
    p.add_argument("-i", dest="ip", nargs=2, metavar=("IP", "PORT"),
                   help="daemon command address")
    args = p.parse_args(argv)
    if not (args.q or args.N):
        p.error("one of -q or -N is required")
    if args.ip is not None and not args.ip[1].isdigit():
        p.error(f"-i: port {args.ip[1]!r} is not a number")
    try:
        ip, port = _target(args)
        if args.q:
            print(request(ip, port, "state")["state"])
        else:
            domain = request(ip, port, "nodes")
            print(json.dumps(domain) if args.j else render_table(domain))
    except (CtlError, KeyError) as e:
        print(f"nvidia-imex-ctl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
