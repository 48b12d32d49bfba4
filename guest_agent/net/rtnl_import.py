"""pyroute2's rtnetlink client, optionally imported without the package's ``__init__``.

Why: ``import pyroute2`` (and so any ``from pyroute2.x import y``) first runs
``pyroute2/__init__.py``, which imports every netlink family pyroute2 knows:
NDB with sqlite3, IPDB, nl80211, ipset, conntrack, plan9 and more. That is
about 11 MB of RSS in a daemon whose footprint goal is 40 MB, for the one
socket family (rtnetlink) netwatch.py uses. In lean mode a bare ``pyroute2``
package object (its search path, none of its ``__init__``) is registered and
only ``pyroute2.iproute.linux`` and the rtnl constants are imported, which
costs about 4 MB less (docs/benchmarks.md).

Lean mode is asked for only by the daemon (``imex-guest-agent run``/``once``,
see ``cli.main``), before anything has imported pyroute2: a bare package
would break a later ``from pyroute2 import NDB`` in the same process, so every
other process (tests, library use) gets the ordinary import. A lean import
that fails (a pyroute2 whose submodules need the package's initialisation)
is undone and the ordinary import is used, with a debug log line.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import types
from typing import Any

log = logging.getLogger("guest_agent.rtnl_import")  # logger name pinned

_lean = False


def enable_lean() -> None:
    """Ask for the lean import (call before ``guest_agent.net.netwatch`` is imported)."""
    global _lean
    _lean = True


def _ordinary() -> tuple[Any, types.ModuleType]:
    from pyroute2 import AsyncIPRoute
    from pyroute2.netlink import rtnl

    return AsyncIPRoute, rtnl


def _bare() -> tuple[Any, types.ModuleType]:
    spec = importlib.util.find_spec("pyroute2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("pyroute2 is not installed as a package")
    pkg = types.ModuleType("pyroute2")
    pkg.__spec__ = spec
    pkg.__path__ = list(spec.submodule_search_locations)
    pkg.__file__ = spec.origin
    sys.modules["pyroute2"] = pkg
    linux = importlib.import_module("pyroute2.iproute.linux")
    rtnl = importlib.import_module("pyroute2.netlink.rtnl")
    return linux.AsyncIPRoute, rtnl


def load() -> tuple[Any, types.ModuleType]:
    """(``AsyncIPRoute``, the ``pyroute2.netlink.rtnl`` module), lean when asked and possible."""
    if not _lean or "pyroute2" in sys.modules:
        return _ordinary()
    try:
        return _bare()
    except Exception as exc:  # undo the partial import and take the ordinary path
        for name in [m for m in sys.modules if m == "pyroute2" or m.startswith("pyroute2.")]:
            del sys.modules[name]
        log.debug("lean pyroute2 import failed (%s); importing the whole package", exc)
        return _ordinary()

