"""The installed distribution's version, ``--version``, and the skew policy both agents apply.

The version is the one pip recorded for ``imex-ensemble`` (pyproject.toml's, the one
source), read only when asked: ``--version`` looks it up when given, so no other
invocation pays for ``importlib.metadata``.

The skew policy (docs/install.md "Upgrades"): the host agent is upgraded first, and a
guest up to ``GUEST_LAG`` minor releases older than its host agent is supported. A
newer guest against an older host agent is tolerated for reports only (the registry
ignores report fields it does not know; a 0.1 registry refuses them, and the guest
drops them). :func:`version_doc` is the registry's ``GET /version``; the guest judges
it with :func:`host_verdict`.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, Final

DISTRIBUTION: Final = "imex-ensemble"
#: the registry's API version (its paths start with /v1)
API: Final = "v1"
#: how many minor releases a guest may lag behind its host agent
GUEST_LAG: Final = 1

_VERSION = re.compile(r"^(0|[1-9][0-9]{0,5})\.(0|[1-9][0-9]{0,5})(\.(0|[1-9][0-9]{0,5}))?"
                      r"([-.+a-zA-Z0-9]{0,40})$")


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


Series = tuple[int, int]


def series(version: object) -> Series | None:
    """``(major, minor)`` of ``0.2.0``, ``0.2``, ``0.2.0rc1`` or ``0.2.0+local``; None
    for anything else (``0+unknown``, a source tree, included)."""
    if not isinstance(version, str):
        return None
    match = _VERSION.match(version.strip())
    if match is None:
        return None
    return int(match.group(1)), int(match.group(2))


def series_text(s: Series) -> str:
    return f"{s[0]}.{s[1]}"


def guest_range(version: str) -> tuple[str, str]:
    """The guest release series a host agent of ``version`` supports: ``(min, max)``."""
    major, minor = series(version) or (0, 0)
    return series_text((major, max(0, minor - GUEST_LAG))), series_text((major, minor))


def version_doc(version: str) -> dict[str, str]:
    """``GET /version``: ``{"version", "api", "min_guest", "max_guest"}``."""
    low, high = guest_range(version)
    return {"version": version, "api": API, "min_guest": low, "max_guest": high}


#: what a guest makes of its host agent's ``/version`` (:func:`host_verdict`)
SUPPORTED: Final = "supported"
#: the host agent is older than the guest by at most GUEST_LAG minors, or predates
#: /version (0.1): reports work (unknown fields dropped), new features may not
OLDER_HOST: Final = "older_host"
#: more than GUEST_LAG minors apart, or another major: refused (reports still go)
TOO_OLD: Final = "host_too_old"
GUEST_TOO_OLD: Final = "guest_too_old"
#: the answer is not a /version document
BAD: Final = "bad_answer"
_UPGRADE = "upgrade the host agent first (docs/install.md \"Upgrades\")"


def host_verdict(doc: object, guest_version: str) -> tuple[str, str]:
    """``(verdict, message)`` for a host agent's ``/version`` answer; ``doc`` None: the
    host answered 404 (it predates ``/version``: a 0.1 host agent)."""
    mine = series(guest_version)
    if doc is None:
        return OLDER_HOST, (
            f"the host agent predates GET /version (0.1): this guest ({guest_version}) is "
            f"newer, which is tolerated for reports only; {_UPGRADE}")
    if not isinstance(doc, dict) or not isinstance(doc.get("version"), str):
        return BAD, f"refusing the host agent's /version answer: not a version document: " \
            f"{str(doc)[:120]!r}"
    host = str(doc["version"])[:64]
    low, high = series(doc.get("min_guest")), series(doc.get("max_guest"))
    if low is None or high is None or low > high:
        return BAD, (f"refusing the host agent's /version answer: min_guest "
                     f"{doc.get('min_guest')!r} / max_guest {doc.get('max_guest')!r} are not "
                     "a MAJOR.MINOR range")
    if doc.get("api") != API:
        return BAD, (f"refusing host agent {host}: it serves registry API "
                     f"{doc.get('api')!r}, this guest speaks {API}")
    if mine is None:  # a source tree: nothing to compare
        return SUPPORTED, f"host agent {host} (this guest's version is unknown)"
    if mine > high:
        if mine[0] != high[0] or mine[1] - high[1] > GUEST_LAG:
            return TOO_OLD, (
                f"host agent {host} is too old for this guest ({guest_version}): it supports "
                f"guests {series_text(low)} to {series_text(high)}, more than {GUEST_LAG} "
                f"minor release(s) behind; reports still go, new features do not; {_UPGRADE}")
        return OLDER_HOST, (
            f"host agent {host} is older than this guest ({guest_version}; it supports "
            f"guests up to {series_text(high)}): tolerated for reports only; {_UPGRADE}")
    if mine < low:
        return GUEST_TOO_OLD, (
            f"this guest ({guest_version}) is older than host agent {host} supports "
            f"(guests {series_text(low)} to {series_text(high)}): upgrade the guest agent")
    return SUPPORTED, f"host agent {host} supports this guest ({guest_version})"
