"""``make image``: the host agent's image, built with podman from a wheelhouse, offline.

    python -m tools.image [--platform linux/arm64] [--python-image IMAGE]
    python -m tools.image --context DIR [--platform P]... [--python 3.11]

The first form builds ``localhost/imex-host-agent:<version>`` (``<version>-<arch>`` for
a platform other than this machine's) from the Containerfile, runs its ``--version``,
and prints its size, packages and files (all of it in ``dist/image/<tag>.json``).
Without ``--python-image`` the base is Debian's python3, made here
(tools/image_base.py); with it, that image (pulled when missing: the official
``python:3.11-slim-bookworm`` where a registry is reachable).

The second form only writes a build context, ``DIR/wheelhouse/linux-<arch>-py<X.Y>/`` per
platform, for a ``podman build`` of your own (docs/install.md step 1).

The build needs no network (``podman build --network=none --pull=never``): the context
holds this tree's wheel (built offline with the venv's setuptools) and every wheel of the
``host`` extra for the target platform and Python, at the versions constraints.txt pins
(what the tests ran), fetched on this machine with pip's own configuration by
tools/wheelhouse.py. Those dependency wheels are cached under the image cache, keyed by
the target, the extra's requirements and constraints.txt, so a warm build downloads
nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import platform as platform_mod
import shutil
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

from tools.image_base import (
    ARCHES,
    SUITE,
    SUITE_PYTHON,
    ImageError,
    cache_root,
    ensure_base,
    foreign_arch,
    handler_gone,
    image_exists,
    locked,
    podman,
    run,
    ulimits,
)

REPO: Final = Path(__file__).resolve().parents[1]
CONTAINERFILE: Final = REPO / "Containerfile"
CONSTRAINTS: Final = REPO / "constraints.txt"
IMAGE: Final = "localhost/imex-host-agent"
#: the tagged build stage (the layer cache of the next build)
BUILD_STAGE: Final = "localhost/imex-host-agent-build"
#: the label the Containerfile puts on every layer of both stages
LABEL: Final = "io.imex-ensemble.image"
EXTRA: Final = "host"
REPORT_DIR: Final = REPO / "dist" / "image"

#: run inside the image by its venv's python: what it holds, as JSON
INVENTORY = r"""
import importlib.metadata as md, json, os, sys
pkgs = []
with open("/var/lib/dpkg/status", encoding="utf-8") as f:
    for block in f.read().split("\n\n"):
        fields = dict(l.split(": ", 1) for l in block.splitlines() if ": " in l and l[0] != " ")
        if fields.get("Status", "").endswith(" installed"):
            pkgs.append(f"{fields['Package']} {fields['Version']}")
dists = sorted(f"{d.metadata['Name']} {d.version}" for d in md.distributions())
trees = {}
for top in sorted(os.listdir("/")):
    if top in ("proc", "sys", "dev") or os.path.islink("/" + top):
        continue  # merged /usr: /bin, /lib are links into /usr
    n = size = 0
    for dirpath, dirs, files in os.walk("/" + top):
        for name in files:
            n += 1
            size += os.lstat(os.path.join(dirpath, name)).st_size
    trees["/" + top] = [n, size]
venv = "/opt/imex-host-agent"
lic = [os.path.join(d, n) for d, _, fs in os.walk(venv) for n in fs
       if n == "LICENSE" and "imex_ensemble" in d]
print(json.dumps({"python": sys.version.split()[0], "debian_packages": sorted(pkgs),
                  "python_distributions": dists, "trees": trees, "license_files": lic}))
"""


@dataclass
class Built:
    """One ``make image`` result and what it took."""

    ref: str
    platform: str
    base: str
    seconds: dict[str, float] = field(default_factory=dict)
    version_line: str = ""
    size: int = 0
    inventory: dict[str, Any] = field(default_factory=dict)


def project_version() -> str:
    return str(tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"])


def native_platform() -> str:
    machine = platform_mod.machine()
    return {"x86_64": "linux/amd64", "aarch64": "linux/arm64"}.get(machine, machine)


def image_ref(plat: str, version: str | None = None) -> str:
    """``localhost/imex-host-agent:<version>``, ``-<arch>`` added for a foreign platform."""
    version = version or project_version()
    return f"{IMAGE}:{version}" if plat == native_platform() else \
        f"{IMAGE}:{version}-{ARCHES[plat]}"


def check_platform(plat: str) -> str:
    if plat not in ARCHES:
        raise ImageError(f"PLATFORM={plat!r}: expected one of {', '.join(ARCHES)}")
    return plat


# ---------------------------------------------------------------------------
# The wheelhouse in the build context.


def deps_key(dirname: str) -> str:
    """Pure apart from reading pyproject and constraints: the dependency cache key."""
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    parts = {"target": dirname, "extra": EXTRA, "deps": doc.get("dependencies", []),
             "extra_deps": doc["optional-dependencies"][EXTRA],
             "constraints": hashlib.sha256(CONSTRAINTS.read_bytes()).hexdigest(), "v": 1}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:16]


def dependency_wheels(target: Any, project_wheel: Path) -> Path:
    """The cached wheels ``target`` needs besides this tree's (fetched when missing)."""
    from tools import wheelhouse as wh

    root = cache_root()
    name = f"wheels-{target.dirname}-{deps_key(target.dirname)}"
    final = root / name
    with locked(root, name):
        if final.is_dir():
            return final
        with tempfile.TemporaryDirectory(prefix=".wheels-", dir=root) as d:
            try:
                built = wh.build_target(target, project_wheel, Path(d), extra=EXTRA,
                                        constraints=CONSTRAINTS)
            except wh.WheelhouseError as e:
                raise ImageError(f"the {target.dirname} wheelhouse: {e}") from e
            (built / project_wheel.name).unlink()
            os.replace(built, final)
    return final


def write_context(context: Path, platforms: Sequence[str], python: str) -> list[Path]:
    """``context/wheelhouse/<target>/`` for each platform: this tree's wheel (built now,
    offline) and the cached dependency wheels. Returns the directories."""
    from tools import wheelhouse as wh

    out: list[Path] = []
    with tempfile.TemporaryDirectory(prefix="imex-image-wheel-") as d:
        try:
            wheel = wh.build_project_wheel(Path(d), isolation=False)
        except wh.WheelhouseError as e:
            raise ImageError(f"building this tree's wheel: {e}") from e
        for plat in platforms:
            target = wh.Target(plat, python)
            deps = dependency_wheels(target, wheel)
            dest = context / "wheelhouse" / target.dirname
            shutil.rmtree(dest, ignore_errors=True)
            dest.mkdir(parents=True)
            for whl in [*deps.glob("*.whl"), wheel]:
                shutil.copy(whl, dest / whl.name)
            out.append(dest)
    return out


# ---------------------------------------------------------------------------
# Build, check, inventory.


def base_python(ref: str, plat: str) -> str:
    """``X.Y`` of the base image's python3 (what its wheelhouse is built for)."""
    proc = run(podman("run", "--rm", "--pull=never", "--network=none", "--platform", plat,
                      *ulimits(), "--entrypoint", "python3", ref, "-c",
                      'import sys; print("%d.%d" % sys.version_info[:2])'),
               f"python3 in {ref}", 300)
    return proc.stdout.strip()


def pick_base(plat: str, python_image: str | None) -> tuple[str, str]:
    """(base image, its Python X.Y): the local Debian base, or ``python_image`` (pulled
    for ``plat`` when not in podman's store)."""
    if python_image is None:
        return ensure_base(ARCHES[plat]), SUITE_PYTHON[SUITE]
    if not image_exists(python_image):
        run(podman("pull", "--platform", plat, python_image),
            f"podman pull {python_image} (no registry reachable? leave PYTHON_IMAGE unset "
            "for the local Debian base)", 1800)
    return python_image, base_python(python_image, plat)


def prune() -> None:
    """Remove the dangling images of earlier builds (a retagged image, an old build
    stage, their layers): only those carrying the Containerfile's label."""
    run(podman("image", "prune", "--force", "--filter", f"label={LABEL}"),
        "podman image prune", 300)


@contextlib.contextmanager
def _context_dir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="imex-image-context-"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def build(plat: str, python_image: str | None = None) -> Built:
    """Build, check and inventory the image for ``plat``."""
    check_platform(plat)
    version = project_version()
    ref = image_ref(plat, version)
    arch = ARCHES[plat]
    t0 = time.monotonic()
    out = Built(ref, plat, "")
    with foreign_arch(arch), locked(cache_root(), f"build-{ref.rsplit(':', 1)[1]}"):
        out.base, python = pick_base(plat, python_image)
        out.seconds["base"] = time.monotonic() - t0
        with _context_dir() as context:
            t = time.monotonic()
            write_context(context, [plat], python)
            out.seconds["wheelhouse"] = time.monotonic() - t
            t = time.monotonic()
            common = ["--pull=never", "--network=none", "--platform", plat, "--layers",
                      "--force-rm", *ulimits(), "--build-arg", f"PYTHON_IMAGE={out.base}",
                      "--build-arg", f"VERSION={version}", "-f", str(CONTAINERFILE)]
            # the build stage tagged too, so the layer cache a warm build reuses is never
            # dangling, and whatever is dangling of ours afterwards can go
            try:
                run(podman("build", *common, "--target", "build",
                           "--tag", ref.replace(IMAGE, BUILD_STAGE), str(context)),
                    f"podman build --target build ({plat})", 3600)
                run(podman("build", *common, "--tag", ref, str(context)),
                    f"podman build ({plat})", 3600)
            except ImageError as e:
                raise ImageError(f"{e}{handler_gone(arch)}") from e
            out.seconds["podman build"] = time.monotonic() - t
        prune()
        t = time.monotonic()
        line = run(podman("run", "--rm", "--pull=never", "--network=none", "--read-only",
                          "--cap-drop=all", *ulimits(), ref, "--version"),
                   f"{ref} --version", 300).stdout.strip()
        if line != f"imex-host-agent {version}":
            raise ImageError(f"{ref} --version printed {line!r}, not "
                             f"'imex-host-agent {version}'")
        out.version_line = line
        out.seconds["--version"] = time.monotonic() - t
        out.size = int(run(podman("image", "inspect", "--format", "{{.Size}}", ref),
                           "podman image inspect", 60).stdout.strip())
        out.inventory = json.loads(run(podman(
            "run", "--rm", "--pull=never", "--network=none", "--read-only", "--cap-drop=all",
            *ulimits(), "--entrypoint", "/opt/imex-host-agent/bin/python", ref, "-c",
            INVENTORY), f"inventory of {ref}", 300).stdout)
    out.seconds["total"] = time.monotonic() - t0
    return out


def summary(b: Built) -> list[str]:
    inv = b.inventory
    secs = ", ".join(f"{k} {v:.1f}s" for k, v in b.seconds.items())
    trees = inv.get("trees", {})
    files = sum(n for n, _ in trees.values())
    biggest = sorted(trees.items(), key=lambda kv: -kv[1][1])[:4]
    return [
        f"image: {b.ref} ({b.platform}) on {b.base}: {secs}",
        f"image: {b.version_line}; size {b.size / 1e6:.1f} MB; {files} files "
        f"({', '.join(f'{k} {s / 1e6:.1f} MB' for k, (_, s) in biggest)})",
        f"image: Python {inv.get('python')}, {len(inv.get('debian_packages', []))} Debian "
        f"packages, {len(inv.get('python_distributions', []))} Python distributions: "
        + ", ".join(inv.get("python_distributions", [])),
    ]


def write_report(b: Built) -> Path:
    """``dist/image/imex-host-agent-<tag>.json``: the times, the size, every package and
    distribution, the files per top directory."""
    REPORT_DIR.mkdir(parents=True, exist_ok=True)
    report = REPORT_DIR / f"imex-host-agent-{b.ref.rsplit(':', 1)[1]}.json"
    report.write_text(json.dumps({"ref": b.ref, "platform": b.platform, "base": b.base,
                                  "seconds": b.seconds, "size": b.size, **b.inventory},
                                 indent=1) + "\n")
    return report


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.image", description=__doc__.split("\n")[0])
    p.add_argument("--platform", action="append", default=[],
                   help="linux/amd64 or linux/arm64 (default: this machine's); with "
                   "--context, repeatable")
    p.add_argument("--python-image", default=None, metavar="IMAGE",
                   help="base image with python3 (default: Debian's, made here)")
    p.add_argument("--context", type=Path, default=None, metavar="DIR",
                   help="only write a build context (the wheelhouse) into DIR")
    p.add_argument("--python", default=SUITE_PYTHON[SUITE],
                   help="with --context: the base image's Python X.Y (default %(default)s)")
    args = p.parse_args(argv)
    plats = [x for v in args.platform for x in v.replace(",", " ").split()]
    try:
        for plat in plats:
            check_platform(plat)
        if args.context is not None:
            dirs = write_context(args.context, plats or list(ARCHES), args.python)
            for d in dirs:
                print(f"image: {d}/ {len(list(d.glob('*.whl')))} wheels")
            print(f"image: podman build --platform {','.join(plats or ARCHES)} "
                  f"--manifest <registry>/imex-host-agent:{project_version()} "
                  f"-f {CONTAINERFILE.relative_to(REPO)} {args.context}")
            return 0
        if len(plats) > 1:
            raise ImageError("build one platform at a time (or write a --context for a "
                             "multi-platform podman build)")
        built = build(plats[0] if plats else native_platform(), args.python_image)
    except ImageError as e:
        print(f"make image: error: {e}", file=sys.stderr)
        return 2
    report = write_report(built)
    for line in summary(built):
        print(line, flush=True)
    print(f"image: packages and files: {report.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    os.umask(0o022)
    raise SystemExit(main())
