"""``make wheelhouse``: one directory of wheels per guest platform and Python.

Why per platform: a guest installs with ``pip --no-index --find-links``, so every wheel it
needs must already be there, built for *its* CPU and *its* Python. ``pip wheel`` on an x86
workstation yields an x86_64 ``watchfiles`` (compiled), which an arm64 (Grace) guest cannot
install. So each target gets ``<out>/linux-<arch>-py<ver>/`` holding this tree's wheel,
every wheel of the ``guest`` extra's closure for that target (binary wheels published for
it, never built here: ``pip download --only-binary=:all: --platform ...``), the pip wheel
the guest bootstraps from (stock images have no pip), and nothing else. The guest's
installer appends its own ``linux-<arch>-py<ver>/`` to the ``find-links`` root, so one URL
serves a mixed-architecture ensemble (guest_agent/installer/bootstrap.py).

Two facts shape the download:

* pip expands ``--platform manylinux2014_x86_64`` only to the older legacy tags, so a
  wheel tagged only ``manylinux_2_28`` would be ineligible. Every tag is passed, from the
  oldest glibc up to the oldest target glibc (RHEL 9: 2.34; Debian 12 has 2.36), so any
  wheel picked runs on every target.
* pip evaluates environment markers against the interpreter running it, not the target
  (``--python-version`` only filters wheel tags). The closure is therefore recomputed here
  from each wheel's own ``Requires-Dist`` with the target's markers: a wheel only the build
  host's Python needs is dropped, and a requirement only the target needs is fetched.

Each directory is built in a temporary sibling and renamed into place once complete. Needs
the package index (pip's own configuration); the tree's wheel is built with build
isolation unless ``--no-build-isolation`` (offline, with the venv's setuptools).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from email.parser import HeaderParser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import NormalizedName, canonicalize_name, parse_wheel_filename

from guest_agent.installer.bootstrap import PYTHON_FLOOR

REPO = Path(__file__).resolve().parents[1]
DISTRIBUTION = "imex-ensemble"
EXTRA = "guest"
PLATFORMS = ("linux/amd64", "linux/arm64")
#: every CPython the guest package is tested or expected on (docs/install.md, support matrix)
PYTHONS = ("3.11", "3.12", "3.13")
#: the oldest glibc among the target guests (RHEL 9: 2.34; Debian 12: 2.36)
OLDEST_TARGET_GLIBC = 34
_MACHINE = {"linux/amd64": "x86_64", "linux/arm64": "aarch64"}
#: the first glibc minor with manylinux wheels per machine (manylinux1 / manylinux2014)
_FIRST_GLIBC = {"x86_64": 5, "aarch64": 17}
_LEGACY = {"x86_64": {5: "manylinux1", 12: "manylinux2010", 17: "manylinux2014"},
           "aarch64": {17: "manylinux2014"}}


class WheelhouseError(Exception):
    """A target cannot be served; the message names the distribution and the target."""


@dataclass(frozen=True, slots=True)
class Target:
    """One guest platform and CPython minor version."""

    platform: str  # linux/amd64 | linux/arm64
    python: str  # 3.11 ...

    @property
    def machine(self) -> str:
        return _MACHINE[self.platform]

    @property
    def dirname(self) -> str:
        """``linux-amd64-py3.13``: what the guest's installer appends to the root URL."""
        return f"{self.platform.replace('/', '-')}-py{self.python}"

    @property
    def version(self) -> tuple[int, int]:
        major, minor = self.python.split(".")
        return int(major), int(minor)

    def platform_tags(self) -> list[str]:
        """Every manylinux tag a target glibc runs, newest first, each spelled out for pip."""
        m = self.machine
        out: list[str] = []
        for minor in range(OLDEST_TARGET_GLIBC, _FIRST_GLIBC[m] - 1, -1):
            out.append(f"manylinux_2_{minor}_{m}")
            legacy = _LEGACY[m].get(minor)
            if legacy:
                out.append(f"{legacy}_{m}")
        return out

    def supported(self) -> set[Tag]:
        """The wheel tags this target installs (CPython, its ABI, abi3, pure Python)."""
        plats = self.platform_tags()
        return set(cpython_tags(self.version, platforms=plats)) | set(
            compatible_tags(self.version, f"cp{self.version[0]}{self.version[1]}", plats))

    def environment(self, extra: str = "") -> dict[str, str]:
        """PEP 508 marker values on the target (not on the machine running this)."""
        return {
            "python_version": self.python, "python_full_version": f"{self.python}.0",
            "implementation_name": "cpython", "platform_python_implementation": "CPython",
            "implementation_version": f"{self.python}.0", "platform_machine": self.machine,
            "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
            "platform_release": "", "platform_version": "", "extra": extra,
        }


def parse_targets(platforms: Sequence[str], pythons: Sequence[str]) -> list[Target]:
    """Targets for the ``PLATFORM`` and ``PYTHON`` selections (empty: all)."""
    plats = list(platforms) or list(PLATFORMS)
    pys = list(pythons) or [p for p in PYTHONS if tuple(map(int, p.split("."))) >= PYTHON_FLOOR]
    for p in plats:
        if p not in PLATFORMS:
            raise WheelhouseError(f"PLATFORM={p!r}: expected one of {', '.join(PLATFORMS)}")
    floor = ".".join(map(str, PYTHON_FLOOR))
    for v in pys:
        if v not in PYTHONS:
            raise WheelhouseError(f"PYTHON={v!r}: expected one of {', '.join(PYTHONS)} "
                                  f"(the guest floor is {floor})")
    return [Target(p, v) for p in plats for v in pys]


def split_list(values: Iterable[str]) -> list[str]:
    """``["linux/amd64,linux/arm64", "x"]`` -> each item once, in order (commas or spaces)."""
    out: list[str] = []
    for v in values:
        for item in v.replace(",", " ").split():
            if item not in out:
                out.append(item)
    return out


# ---------------------------------------------------------------------------
# The closure, computed for the target from the wheels' own metadata (pure).


@dataclass(frozen=True, slots=True)
class WheelInfo:
    name: NormalizedName
    filename: str
    requires: tuple[str, ...]


def wheel_info(path: Path) -> WheelInfo:
    name, _, _, _ = parse_wheel_filename(path.name)
    with zipfile.ZipFile(path) as zf:
        meta = next((n for n in zf.namelist()
                     if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if meta is None:
            raise WheelhouseError(f"{path.name}: no .dist-info/METADATA")
        headers = HeaderParser().parsestr(zf.read(meta).decode("utf-8"))
    return WheelInfo(name, path.name, tuple(headers.get_all("Requires-Dist") or ()))


def closure(roots: Sequence[str], wheels: dict[NormalizedName, WheelInfo],
            target: Target) -> tuple[set[NormalizedName], list[Requirement]]:
    """The distributions ``roots`` need on ``target``, and the requirements no wheel meets.

    Markers are evaluated with the target's environment and each requirement's extras, so
    a dependency the target never installs is not in the result."""
    needed: set[NormalizedName] = set()
    missing: list[Requirement] = []
    todo = [(Requirement(r), "") for r in roots]
    seen: set[tuple[str, str]] = set()
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate(target.environment(extra)):
            continue
        name = canonicalize_name(req.name)
        key = (str(req), extra)
        if key in seen:
            continue
        seen.add(key)
        req.marker = None  # evaluated for the target: what is missing is needed there
        info = wheels.get(name)
        version = str(parse_wheel_filename(info.filename)[1]) if info else ""
        if info is None or (req.specifier and not req.specifier.contains(version,
                                                                         prereleases=True)):
            missing.append(req)
            continue
        needed.add(name)
        for dep in info.requires:
            for ex in ("", *sorted(req.extras)):
                todo.append((Requirement(dep), ex))
    return needed, missing


def incompatible(wheel_names: Iterable[str], target: Target) -> list[str]:
    """The wheel files in the list that ``target`` cannot install (wrong CPU or Python)."""
    ok = target.supported()
    return [w for w in wheel_names if not (parse_wheel_filename(w)[3] & ok)]


# ---------------------------------------------------------------------------
# I/O.


def guest_requirement() -> str:
    return f"{DISTRIBUTION}[{EXTRA}]"


def _pip(args: list[str], what: str, timeout: float = 900) -> str:
    argv = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    if proc.returncode != 0:
        lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.strip()]
        errors = [ln for ln in lines if ln.startswith("ERROR")] or lines[-8:]
        raise WheelhouseError(f"{what}: " + " / ".join(errors))
    return proc.stdout


def build_project_wheel(out: Path, isolation: bool = True) -> Path:
    """This tree's wheel, built from a copy (the work tree stays clean)."""
    with tempfile.TemporaryDirectory(prefix="imex-wheelhouse-src-") as d:
        src = Path(d)
        for name in ("pyproject.toml", "README.md", "LICENSE"):
            shutil.copy(REPO / name, src / name)
        for pkg in ("imex_shared", "guest_agent", "host_agent"):
            shutil.copytree(REPO / pkg, src / pkg, ignore=shutil.ignore_patterns("__pycache__"))
        flags = [] if isolation else ["--no-build-isolation"]
        _pip(["wheel", "-q", "--no-deps", *flags, "-w", str(out), str(src)],
             "building this tree's wheel", 600)
    wheels = sorted(out.glob("imex_ensemble-*.whl"))
    if not wheels:
        raise WheelhouseError(f"pip built no imex_ensemble wheel into {out}")
    return wheels[-1]


def _download(target: Target, dest: Path, reqs: list[str], no_deps: bool) -> None:
    plat_args = [a for t in target.platform_tags() for a in ("--platform", t)]
    _pip(["download", "-q", "--only-binary=:all:", *plat_args,
          "--python-version", target.python, "--implementation", "cp",
          *(["--no-deps"] if no_deps else []), "--dest", str(dest), *reqs],
         f"{target.dirname}: pip download {' '.join(reqs)}")


def build_target(target: Target, project_wheel: Path, out_root: Path) -> Path:
    """``out_root/<target.dirname>/``: the project wheel, its closure, pip; nothing else."""
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.dirname}-", dir=out_root))
    try:
        shutil.copy(project_wheel, tmp / project_wheel.name)
        _download(target, tmp, [f"{tmp / project_wheel.name}[{EXTRA}]"], no_deps=False)
        _download(target, tmp, ["pip"], no_deps=True)
        roots = [guest_requirement()]
        for _ in range(10):  # fetch what only the target's markers ask for
            wheels = {wheel_info(p).name: wheel_info(p) for p in tmp.glob("*.whl")}
            needed, missing = closure(roots, wheels, target)
            if not missing:
                break
            _download(target, tmp, [str(r) for r in missing], no_deps=True)
        else:
            raise WheelhouseError(f"{target.dirname}: still missing {missing}")
        keep = needed | {canonicalize_name("pip")}
        for name, info in wheels.items():
            if name not in keep:
                (tmp / info.filename).unlink()
        bad = incompatible([p.name for p in tmp.glob("*.whl")], target)
        if bad:
            raise WheelhouseError(f"{target.dirname}: pip picked wheels this target cannot "
                                  f"install: {', '.join(bad)}")
        for stray in tmp.iterdir():
            if stray.suffix != ".whl":
                raise WheelhouseError(f"{target.dirname}: pip left a non-wheel {stray.name} "
                                      "(an sdist? every dependency must publish a wheel)")
        final = out_root / target.dirname
        old = out_root / f".{target.dirname}.old"
        if final.exists():
            final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
        return final
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.iterdir() if p.is_file())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="make wheelhouse", description=__doc__.split("\n")[0])
    p.add_argument("--platform", action="append", default=[],
                   help="linux/amd64 and/or linux/arm64 (default: both)")
    p.add_argument("--python", action="append", default=[],
                   help="3.11, 3.12 and/or 3.13 (default: all the guest floor allows)")
    p.add_argument("--out", type=Path, default=REPO / "dist" / "wheelhouse")
    p.add_argument("--no-build-isolation", action="store_true",
                   help="build this tree's wheel with the running venv's setuptools (offline)")
    args = p.parse_args(argv)
    try:
        targets = parse_targets(split_list(args.platform), split_list(args.python))
        with tempfile.TemporaryDirectory(prefix="imex-wheelhouse-") as d:
            wheel = build_project_wheel(Path(d), isolation=not args.no_build_isolation)
            for t in targets:
                final = build_target(t, wheel, args.out)
                names = sorted(x.name for x in final.glob("*.whl"))
                print(f"wheelhouse: {final}/ {len(names)} wheels, "
                      f"{dir_size(final) / 1e6:.1f} MB", flush=True)
    except WheelhouseError as e:
        print(f"make wheelhouse: error: {e}", file=sys.stderr)
        return 2
    print(f"wheelhouse: serve {args.out}/ over HTTP (a directory listing) and pass "
          f"--install find-links:<its URL> to imex-guest-agent cloudinit", flush=True)
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    raise SystemExit(main())
