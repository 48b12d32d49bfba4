"""`python -m tests.sandbox <command> ...`: the sandbox's command-line entry.

A small dispatcher: each command lives in its own module exposing
`configure(parser: argparse.ArgumentParser) -> None` and
`main(args: argparse.Namespace) -> int`, registered in `COMMANDS` below
(name -> (module, one-line help)). Only the chosen command's module is
imported, so one stand-in's dependencies never burden another's command.
To add a command (e.g. `demo`), add one line to `COMMANDS`.
"""

from __future__ import annotations

import argparse
import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "kube-api": ("tests.sandbox.kube_api.cli",
                 "run the Kubernetes API double on its own and write a kubeconfig"),
    "demo": ("tests.sandbox.demo",
             "a 4-VM ensemble end to end: boot, crash, restore, timed; then teardown"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    top = argparse.ArgumentParser(
        prog="python -m tests.sandbox",
        description="Local stand-ins for what this machine lacks (test code only).",
        epilog="commands:\n" + "\n".join(f"  {n:<12} {h}" for n, (_, h) in COMMANDS.items()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    top.add_argument("command", choices=sorted(COMMANDS), help="what to run")
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        top.parse_args(argv[:1] or ["--help"])
        return 2
    name = argv[0]
    module = importlib.import_module(COMMANDS[name][0])
    parser = argparse.ArgumentParser(prog=f"python -m tests.sandbox {name}",
                                     description=COMMANDS[name][1])
    module.configure(parser)
    result: int = module.main(parser.parse_args(argv[1:]))
    return result


if __name__ == "__main__":
    sys.exit(main())
