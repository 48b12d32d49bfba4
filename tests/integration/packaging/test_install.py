"""The guest installs alone: ``pip install '.[guest]'`` into a clean venv.

The VM image must not carry FastAPI, uvicorn or a Kubernetes client, and
``import guest_agent`` (and the daemon's modules) must work with only the
guest extra. Uses the package index configured for pip on this machine.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).parents[3]
HOST_ONLY = {
    "fastapi",
    "uvicorn",
    "lightkube",
    "lightkube-models",
    "kubernetes",
    "prometheus-client",
    "starlette",
    "pydantic",
}


def test_guest_extra_installs_without_host_dependencies(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        check=True,
        timeout=300,
    )
    (wheel,) = wheels.glob("imex_ensemble-*.whl")
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", f"{wheel}[guest]"], check=True, timeout=600
    )
    freeze = subprocess.run(
        [str(py), "-m", "pip", "list", "--format=freeze"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    installed = {line.split("==")[0].lower().replace("_", "-") for line in freeze.split()}
    assert {"imex-ensemble", "dnspython", "watchfiles", "pyroute2", "tenacity"} <= installed
    assert not installed & HOST_ONLY, installed & HOST_ONLY
    probe = (
        "import importlib, pkgutil, guest_agent;"
        "mods = [m.name for m in pkgutil.iter_modules(guest_agent.__path__)];"
        "[importlib.import_module('guest_agent.' + m) for m in mods];"
        "import importlib.resources as r;"
        "assert r.files('guest_agent').joinpath('py.typed').is_file();"
        "print(len(mods))"
    )
    out = subprocess.run(
        [str(py), "-c", probe], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    assert int(out.stdout) >= 6
    for script in ("imex-guest-agent", "imex-host-agent"):
        assert (venv / "bin" / script).exists()
    help_out = subprocess.run(
        [str(venv / "bin" / "imex-guest-agent"), "--help"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert "render" in help_out.stdout
