"""Offline wheelhouses for tests: this tree's wheel plus wheels repacked from the test venv.

TEST SUPPORT. The installer tests must not reach a package index (tests talk to loopback
only), yet the guest installer needs real wheels: pip's own, and the guest extra's
closure. Every distribution installed in the running venv is turned back into the wheel
it was installed from: its files as ``RECORD`` lists them (bytecode left out, as in a
published wheel), its ``.dist-info``, and the file name from the tags in its ``WHEEL``
file. The result is what ``make wheelhouse`` writes for the machine and CPython running
the tests (``linux-amd64-py3.11`` here), which is exactly what this machine's
``/usr/bin/python3`` installs.
"""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from email.parser import HeaderParser
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[2]


def repack(name: str, out: Path) -> Path:
    """``out/<dist>-<ver>-<tags>.whl`` rebuilt from the installed distribution ``name``."""
    dist = metadata.distribution(name)
    files = [f for f in dist.files or [] if "__pycache__" not in f.parts
             and not str(f).endswith(".pyc") and not f.parts[0].startswith("..")]
    info = next(f for f in files if f.name == "WHEEL")
    wheel_meta = HeaderParser().parsestr(info.read_text() or "")
    tags = sorted(wheel_meta.get_all("Tag") or [])
    pys = ".".join(sorted({t.split("-")[0] for t in tags}))
    abis = ".".join(sorted({t.split("-")[1] for t in tags}))
    plats = ".".join(sorted({t.split("-")[2] for t in tags}))
    stem = f"{dist.metadata['Name'].replace('-', '_')}-{dist.version}"
    path = out / f"{stem}-{pys}-{abis}-{plats}.whl"
    records = []
    record_name = ""
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        for f in files:
            arc = str(f)
            if f.name == "RECORD" and arc.endswith(".dist-info/RECORD"):
                record_name = arc
                continue
            if f.name in ("INSTALLER", "REQUESTED", "direct_url.json"):
                continue
            data = Path(str(f.locate())).read_bytes()
            zf.writestr(arc, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            records.append(f"{arc},sha256={digest.decode()},{len(data)}")
        records.append(f"{record_name},,")
        zf.writestr(record_name, "\n".join(records) + "\n")
    return path


def closure(root: str, extra: str) -> list[str]:
    """Installed distributions ``root[extra]`` needs here (markers of this interpreter)."""
    out: list[str] = []
    todo = [(Requirement(f"{root}[{extra}]"), extra)]
    while todo:
        req, ex = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": ex}):
            continue
        name = canonicalize_name(req.name)
        if name in out:
            continue
        out.append(name)
        for dep in metadata.distribution(name).requires or []:
            for e in ("", *req.extras):
                todo.append((Requirement(dep), e))
    return out


def project_wheel(out: Path, edit: Callable[[Path], None] | None = None) -> Path:
    """This tree's wheel, built offline with the venv's setuptools, from a copy (which
    ``edit`` may change first)."""
    with tempfile.TemporaryDirectory(prefix="imex-test-src-") as d:
        src = Path(d)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(REPO / name, src / name)
        for pkg in ("guest_agent", "host_agent", "imex_shared"):
            shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        if edit is not None:
            edit(src)
        subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                        "--no-build-isolation", "-w", str(out), str(src)],
                       check=True, capture_output=True, timeout=300)
    (wheel,) = out.glob("imex_ensemble-*.whl")
    return wheel


def guest_wheelhouse(out: Path, skip: tuple[str, ...] = ()) -> Path:
    """``out`` with this tree's wheel, the guest extra's closure and pip (minus ``skip``)."""
    out.mkdir(parents=True, exist_ok=True)
    project_wheel(out)
    for name in [*closure("imex-ensemble", "guest"), "pip"]:
        if name != "imex-ensemble" and name not in skip:
            repack(name, out)
    return out
