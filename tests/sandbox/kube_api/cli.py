"""`python -m tests.sandbox kube-api`: the API double as a standalone process.

TEST STAND-IN, never product code. Listens on `--listen HOST:PORT` (plain
HTTP; port 0 picks a free one), writes a kubeconfig (bearer token, the
`sandbox` context, namespace `default`) to `--kubeconfig-out` that lightkube
and kubectl accept, optionally stores the objects of `--seed FILE` (YAML
documents, status included, as controllers would have written them), prints
one line `kube-api ready url=<url> kubeconfig=<path>` on stdout when it
accepts requests, and stops cleanly on SIGTERM or SIGINT (watches ended,
connections closed, exit status 0).
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path

import yaml

from .errors import ApiError
from .server import KubeApiServer

log = logging.getLogger("kube-api")


def parse_listen(text: str) -> tuple[str, int]:
    """"HOST:PORT" or "[V6]:PORT" -> (host, port)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host:
        raise argparse.ArgumentTypeError(f"--listen wants HOST:PORT, got {text!r}")
    host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    try:
        number = int(port)
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--listen: port {port!r} is not a number") from e
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"--listen: port {number} out of range")
    return host, number


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--listen", type=parse_listen, default=("127.0.0.1", 0),
                        metavar="HOST:PORT", help="address to serve on (default 127.0.0.1:0)")
    parser.add_argument("--kubeconfig-out", type=Path, required=True, metavar="PATH",
                        help="where to write a kubeconfig for this server")
    parser.add_argument("--token", default=None, help="bearer token (default: random)")
    parser.add_argument("--namespace", default="default",
                        help="namespace of the kubeconfig's context (default: default)")
    parser.add_argument("--bookmark-interval", type=float, default=1.0, metavar="SECONDS",
                        help="BOOKMARK period on watches that allow them (default 1)")
    parser.add_argument("--history-limit", type=int, default=100_000, metavar="EVENTS",
                        help="watch history kept before compaction (default 100000)")
    parser.add_argument("--seed", type=Path, action="append", default=[], metavar="FILE",
                        help="YAML file of objects to store at start (repeatable)")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")


async def serve(args: argparse.Namespace) -> int:
    host, port = args.listen
    server = KubeApiServer(host, port, token=args.token,
                           bookmark_interval=args.bookmark_interval,
                           history_limit=args.history_limit)
    for path in args.seed:
        try:
            docs = [d for d in yaml.safe_load_all(path.read_text()) if d]
        except (OSError, yaml.YAMLError) as e:
            print(f"kube-api: cannot read --seed {path}: {e}", file=sys.stderr)
            return 2
        for doc in docs:
            try:
                server.put(doc)
            except (ApiError, ValueError, KeyError, TypeError) as e:
                print(f"kube-api: --seed {path}: {doc.get('kind')} "
                      f"{(doc.get('metadata') or {}).get('name')}: {e}", file=sys.stderr)
                return 2
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await server.start()
    except OSError as e:
        print(f"kube-api: cannot listen on {host}:{port}: {e}", file=sys.stderr)
        return 1
    try:
        server.write_kubeconfig(args.kubeconfig_out, args.namespace)
        print(f"kube-api ready url={server.url} kubeconfig={args.kubeconfig_out}", flush=True)
        await stop.wait()
        log.info("stopping")
    finally:
        await server.stop()
    return 0


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    return asyncio.run(serve(args))
