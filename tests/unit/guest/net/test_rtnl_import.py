"""rtnl_import: the daemon's lean pyroute2 import, each case in a fresh interpreter
(sys.modules state is the thing under test)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]


#: whether pyroute2 was loaded without its package ``__init__`` (a bare package object has
#: none of the names the ``__init__`` imports)
IS_LEAN = """
def is_lean():
    import sys
    mod = sys.modules.get("pyroute2")
    return mod is not None and not hasattr(mod, "IPRoute")
"""


def run(code: str) -> dict[str, object]:
    """Run ``code`` in a fresh interpreter, with ``is_lean()`` defined; its last JSON line."""
    out = subprocess.run([sys.executable, "-c", IS_LEAN + textwrap.dedent(code)], cwd=REPO,
                         capture_output=True, text=True, timeout=60, check=True)
    result: dict[str, object] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def test_lean_import_skips_the_package_init_and_still_dumps_addresses() -> None:
    r = run("""
        import asyncio, json, sys
        from guest_agent.net import rtnl_import
        rtnl_import.enable_lean()
        from guest_agent.net import netwatch
        addrs = asyncio.run(netwatch.local_addresses())
        print(json.dumps({"lean": is_lean(), "sqlite3": "sqlite3" in sys.modules,
                          "ndb": "pyroute2.ndb.main" in sys.modules,
                          "loopback": "127.0.0.1" in addrs}))
    """)
    assert r == {"lean": True, "sqlite3": False, "ndb": False, "loopback": True}


def test_ordinary_import_without_lean_mode() -> None:
    r = run("""
        import json, sys
        from guest_agent.net import netwatch, rtnl_import
        print(json.dumps({"lean": is_lean(),
                          "ndb": "pyroute2.ndb.main" in sys.modules}))
    """)
    assert r == {"lean": False, "ndb": True}


def test_pyroute2_already_imported_is_not_replaced() -> None:
    r = run("""
        import json
        import pyroute2
        from guest_agent.net import rtnl_import
        rtnl_import.enable_lean()
        AsyncIPRoute, rtnl = rtnl_import.load()
        print(json.dumps({"lean": is_lean(),
                          "same": AsyncIPRoute is pyroute2.AsyncIPRoute}))
    """)
    assert r == {"lean": False, "same": True}


def test_a_failing_lean_import_is_undone_and_falls_back() -> None:
    r = run("""
        import importlib, json
        from guest_agent.net import rtnl_import
        real = importlib.import_module
        def broken(name, *a):
            if name == "pyroute2.iproute.linux":
                raise ImportError("simulated: needs the package init")
            return real(name, *a)
        importlib.import_module = broken
        rtnl_import.enable_lean()
        AsyncIPRoute, rtnl = rtnl_import.load()
        import pyroute2
        print(json.dumps({"lean": is_lean(),
                          "works": AsyncIPRoute is pyroute2.AsyncIPRoute,
                          "ndb": hasattr(pyroute2, "NDB")}))
    """)
    assert r == {"lean": False, "works": True, "ndb": True}
