"""Building this tree prints no setuptools warning, and the wheel holds what the guest needs.

A newcomer's first ``make demo`` installs the tree (editable) and used to print setuptools
warning blocks, repeated: the deprecated ``project.license`` table, "Package would be
ignored" for ``guest_agent.data``, and "Editable installation" (the meta path finder's
notice; a root ``package-dir`` makes the editable install a plain ``.pth`` entry
instead). The builds here run offline with the venv's setuptools
(``--no-build-isolation``; pyproject's test extra requires the setuptools that
``[build-system]`` does) and verbose, so every line the backend prints reaches the
check. The control case builds the same tree with the old declarations and must show
all three: the detector is not blind.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
#: what ``warnings`` prints ("path.py:82: SetuptoolsDeprecationWarning: ..."; pip relays
#: them as BuildBackendWarning), InformationOnly included, and setuptools' "!!" banners
WARNING = re.compile(r"\.py:\d+: \w*(Warning|InformationOnly): |^\s*!!\s*$")
OLD_LICENSE = 'license = { text = "Apache-2.0" }'


def copy_tree(dst: Path, legacy: bool = False) -> Path:
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(REPO / name, dst / name)
    for pkg in ("imex_shared", "guest_agent", "host_agent"):
        shutil.copytree(REPO / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__"))
    if legacy:  # what the tree declared before issue 14
        text = (dst / "pyproject.toml").read_text()
        text = text.replace('license = "Apache-2.0"', OLD_LICENSE)
        # every package named then, the data directory left out
        text = re.sub(r'packages = \[[^]]*\]', 'packages = ["imex_shared", "guest_agent", '
                      '"host_agent"]', text, count=1)
        text = text.replace('guest_agent = ["py.typed"]', 'guest_agent = ["py.typed", "data/*"]')
        text = text.replace('"guest_agent.data" = ["*.service"]\n', "")
        text = text.replace('package-dir = { "" = "." }\n', "")
        (dst / "pyproject.toml").write_text(text)
    return dst


def pip_build(args: list[str], cwd: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "-v", "--disable-pip-version-check", *args],
        capture_output=True, text=True, timeout=300, cwd=cwd, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout + proc.stderr


EDITABLE = """
import sys, warnings
warnings.simplefilter("always")
from setuptools import build_meta
print(build_meta.build_editable(sys.argv[1]))
"""


def build_editable(src: Path, out: Path) -> str:
    out.mkdir()
    proc = subprocess.run([sys.executable, "-c", EDITABLE, str(out)], cwd=src,
                          capture_output=True, text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(out.glob("*.editable-*.whl")), proc.stdout
    return proc.stdout + proc.stderr


def backend_warnings(output: str) -> list[str]:
    return [ln for ln in output.splitlines() if WARNING.search(ln)]


def test_build_system_requires_a_setuptools_with_spdx_license_support() -> None:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert doc["build-system"]["requires"] == ["setuptools>=77"]
    assert doc["project"]["license"] == "Apache-2.0"  # PEP 639: an SPDX expression
    assert "setuptools>=77" in doc["project"]["optional-dependencies"]["test"]


@pytest.mark.parametrize("legacy", [False, True], ids=["this tree", "old declarations"])
def test_wheel_and_editable_builds_print_no_setuptools_warning(tmp_path: Path,
                                                               legacy: bool) -> None:
    (tmp_path / "src").mkdir()
    src = copy_tree(tmp_path / "src", legacy)
    out = pip_build(["wheel", "--no-deps", "--no-build-isolation", "-w", str(tmp_path / "w"),
                     str(src)], tmp_path)
    # what make's venv bootstrap (pip install -e) asks the backend for: an editable wheel.
    # Through the PEP 660 hook directly: installing it would replace this venv's own copy.
    editable = build_editable(src, tmp_path / "editable")
    found = backend_warnings(out + editable)
    if legacy:
        text = "\n".join(found)
        assert "`project.license` as a TOML table is deprecated" in text
        assert "Package 'guest_agent.data' is absent from the `packages` configuration" in text
        assert "Editable installation." in text
        return
    assert found == []
    (wheel,) = (tmp_path / "w").glob("imex_ensemble-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        meta = zf.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert {"guest_agent/data/imex-guest-agent.service", "guest_agent/py.typed",
            "guest_agent/installer/bootstrap.py", "host_agent/py.typed"} <= names
    assert "License-Expression: Apache-2.0" in meta
    # the license text itself (PEP 639's default license-files picks LICENSE up)
    assert "License-File: LICENSE" in meta
    (text,) = [n for n in names if n.endswith(".dist-info/licenses/LICENSE")]
    with zipfile.ZipFile(wheel) as zf:
        assert zf.read(text) == (REPO / "LICENSE").read_bytes()
    assert not any(n.startswith(("tests/", "tools/")) for n in names)
