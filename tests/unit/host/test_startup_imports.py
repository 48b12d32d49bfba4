"""The agent's start-up order (issue 27): its main module leaves the registry's web stack
unloaded, so FastAPI is imported while the first lists are answered (main.py)."""

from __future__ import annotations

import subprocess
import sys


def test_the_agent_module_loads_without_fastapi_or_pydantic() -> None:
    code = ("import sys, host_agent.cli, host_agent.main; "
            "print(sorted(m for m in ('fastapi', 'pydantic', 'starlette') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=60, check=True).stdout.strip()
    assert out == "[]", f"imported at start-up: {out}"
