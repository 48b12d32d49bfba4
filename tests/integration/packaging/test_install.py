"""The guest installs alone: ``pip install '.[guest]'`` into a clean venv.

The VM image must not carry FastAPI, uvicorn or a Kubernetes client, and
``import guest_agent`` (and the daemon's modules) must work with only the
guest extra. Uses the package index configured for pip on this machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

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


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    wheels = tmp_path_factory.mktemp("wheels")
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(wheels), str(REPO)],
        check=True,
        timeout=300,
    )
    (built,) = wheels.glob("imex_ensemble-*.whl")
    return built


#: Every module of every package the wheel ships, imported one by one in the venv. A
#: ``__main__`` runs its command when imported, so it is run as ``python -m`` instead.
IMPORT_ALL = """
import importlib, json, pkgutil, sys
done, failed = [], {}
for root in sys.argv[1:]:
    pkg = importlib.import_module(root)
    names = [root] + [m.name for m in pkgutil.walk_packages(pkg.__path__, root + ".")]
    for name in names:
        if name.rsplit(".", 1)[-1] == "__main__":
            continue
        try:
            importlib.import_module(name)
            done.append(name)
        except Exception as exc:
            failed[name] = repr(exc)
print(json.dumps({"imported": done, "failed": failed}))
"""


def test_the_wheel_imports_every_module_of_every_package_it_ships(wheel: Path,
                                                                  tmp_path: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        shipped = {n.split("/")[0] for n in zf.namelist()
                   if n.endswith(".py") and "/" in n and ".dist-info" not in n}
        modules = {n[:-3].replace("/", ".") for n in zf.namelist() if n.endswith(".py")}
    assert shipped == {"imex_shared", "guest_agent", "host_agent"}
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", f"{wheel}[guest,host]"],
                   check=True, timeout=900)
    out = subprocess.run([str(py), "-c", IMPORT_ALL, *sorted(shipped)], check=True,
                         capture_output=True, text=True, cwd=tmp_path, timeout=300)
    result = json.loads(out.stdout)
    assert result["failed"] == {}
    expected = {m.removesuffix(".__init__") for m in modules if not m.endswith("__main__")}
    assert set(result["imported"]) == expected
    # the one __main__: the TLS keeper's child command, as the keeper runs it
    child = subprocess.run([str(py), "-m", "guest_agent.tls", "inspect", "--tls-dir",
                            str(tmp_path / "tls")], capture_output=True, text=True,
                           cwd=tmp_path, timeout=60)
    assert json.loads(child.stdout)["ok"] is True, child.stderr


def test_guest_extra_installs_without_host_dependencies(wheel: Path, tmp_path: Path) -> None:
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
        "mods = [m.name for m in pkgutil.walk_packages(guest_agent.__path__, 'guest_agent.')"
        " if not m.name.endswith('__main__')];"
        "[importlib.import_module(m) for m in mods];"
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
