"""The installed distribution's version, and ``--version`` for both agents' command lines.

The version is the one pip recorded for ``imex-ensemble`` (pyproject.toml's), read only
when asked: ``--version`` looks it up when given, so no other invocation pays for
``importlib.metadata``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any, Final

DISTRIBUTION: Final = "imex-ensemble"


def package_version() -> str:
    """``imex-ensemble``'s installed version; ``0+unknown`` when it is not installed (a
    source tree on ``sys.path``)."""
    import importlib.metadata

    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return "0+unknown"


class VersionAction(argparse.Action):
    """``--version``: print ``<prog> <version>`` on stdout and exit 0."""

    def __init__(self, option_strings: Sequence[str], dest: str = argparse.SUPPRESS,
                 default: Any = argparse.SUPPRESS, help: str | None = None) -> None:
        super().__init__(option_strings, dest, nargs=0, default=default,
                         help=help or "print the version and exit")

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        sys.stdout.write(f"{parser.prog} {package_version()}\n")
        sys.stdout.flush()
        parser.exit(0)
