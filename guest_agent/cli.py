"""``imex-guest-agent``: run | once | status | preflight | wait | members | render | cloudinit.

Subcommands import their modules lazily so ``render`` works with the bare
standard library (no dnspython, pyroute2 or watchfiles needed to preview a
file). Every error is one line on stderr naming what is wrong, exit 2 for
bad input and config, 1 for runtime failures, 3 when ``once`` could learn
nothing or ``wait`` timed out, 4 when ``wait`` does not apply (docs/guest-agent.md has
the table). ``run``, ``once``, ``status``, ``preflight``, ``wait`` and ``members`` are
``guest_agent.commands.main``.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from guest_agent.config import DEFAULT_CONFIG_PATH, ConfigError, Settings, load_settings
from imex_shared.hostsfile import merge_hosts
from imex_shared.model import EnsembleId, ModelError, members_from_json, pins_of
from imex_shared.render import render_nodes_config
from imex_shared.version import VersionAction

EXIT_BAD_INPUT = 2


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> int:
    print(f"imex-guest-agent: error: {message}", file=sys.stderr)
    return code


def cmd_render(args: argparse.Namespace, settings: Settings) -> int:
    """Print the nodes file or the whole merged hosts file; touch nothing."""
    try:
        raw = json.loads(Path(args.members).read_text(encoding="utf-8"))
    except OSError as exc:
        return _fail(f"--members {args.members}: {exc.strerror}")
    except json.JSONDecodeError as exc:
        return _fail(f"--members {args.members}: not valid JSON: {exc}")
    try:
        members = members_from_json(raw, settings.max_members)
    except ModelError as exc:
        return _fail(f"--members {args.members}: {exc}")
    ens = EnsembleId(settings.namespace, settings.ensemble)
    pins = pins_of(members)
    if args.what == "nodes_config":
        out = render_nodes_config(ens, settings.max_members, settings.mode, pins)
    else:
        source = args.hosts_input or settings.hosts_file
        try:
            existing = Path(source).read_bytes()
        except FileNotFoundError:
            existing = b""
        except OSError as exc:
            return _fail(f"--hosts-input {source}: {exc.strerror}")
        out = merge_hosts(existing, ens, settings.max_members, pins)
    sys.stdout.buffer.write(out)
    sys.stdout.flush()
    return 0


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not 0 < value <= 86400 * 7:
        raise argparse.ArgumentTypeError(f"{text!r} is not between 0 and a week")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="imex-guest-agent",
        description="Keeps an IMEX ensemble's nodes_config and /etc/hosts true inside a VM.",
    )
    parser.add_argument("--version", action=VersionAction)
    parser.add_argument("--config", default=DEFAULT_CONFIG_PATH, help="TOML config file")
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--config", default=argparse.SUPPRESS, help="TOML config file")
    common.add_argument("--json", action="store_true", help="JSON output / logs")

    sub.add_parser("run", parents=[common], help="run the daemon")
    sub.add_parser("once", parents=[common], help="one discover-and-apply pass")
    status = sub.add_parser("status", parents=[common], help="show the agent's status")
    status.add_argument("--prometheus", action="store_true",
                        help="as Prometheus text (imex_build_info{version} and counters), "
                        "for node_exporter's textfile collector")
    sub.add_parser("preflight", parents=[common],
                   help="check the driver, IMEX, channels, fabric, registry and DNS")
    wait = sub.add_parser("wait", parents=[common],
                          help="wait until IMEX (local) or the domain is ready (exit 0)")
    wait.add_argument("--for", dest="target", required=True, choices=("local", "domain"))
    wait.add_argument("--timeout", type=_positive, default=1200.0, metavar="SECONDS",
                      help="give up after this long, exit 3 (default 1200)")
    wait.add_argument("--min-members", type=int, default=None, metavar="N",
                      help="domain: members that must be published (default: "
                      "expected_members, else max_members)")
    wait.add_argument("--interval", type=_positive, default=1.0, metavar="SECONDS",
                      help=argparse.SUPPRESS)
    members = sub.add_parser("members", parents=[common],
                             help="print the live members of this VM's clique")
    members.add_argument("--format", choices=("hostfile", "json", "names"),
                         default="hostfile")
    members.add_argument("--addresses", action="store_true",
                         help="IP addresses instead of slot names")
    members.add_argument("--slots", type=int, default=1, help="hostfile slots= (default 1)")
    render = sub.add_parser("render", parents=[common], help="print a file without writing it")
    render.add_argument("--members", required=True, help='JSON list of {"index": 0, "ip": "..."}')
    render.add_argument("--what", required=True, choices=("nodes_config", "hosts"))
    render.add_argument("--hosts-input", help="hosts file to merge into (default: hosts_file)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["cloudinit"]:
        # The user-data generator has its own flags and needs no agent config.
        from guest_agent.installer.cli import main as cloudinit_main

        return cloudinit_main(argv[1:])
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        settings = load_settings(args.config)
    except ConfigError as exc:
        return _fail(str(exc))
    if args.command == "render":
        return cmd_render(args, settings)
    # The daemon's modules need the [guest] extra; import them only here. The
    # daemon is the only pyroute2 user in its process, so it may skip pyroute2's
    # eager package init (rtnl_import.py: about 4 MB of RSS).
    if args.command in ("run", "once"):
        from guest_agent.net import rtnl_import

        rtnl_import.enable_lean()
    from guest_agent import commands

    return commands.main(args, settings)


if __name__ == "__main__":
    sys.exit(main())
