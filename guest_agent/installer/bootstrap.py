"""The guest's installer: python3 and a wheelhouse (or an index) are all it needs.

cloud-init writes this file's source verbatim into the guest (``write_files``) and the
``runcmd`` runs it with the image's ``python3``: stock Debian and Ubuntu cloud images have
python3 (cloud-init needs it) but neither ensurepip (python3-venv) nor pip. So it:

1. picks the interpreter: the newest ``python3.N`` (or ``python3``) on ``PATH`` that meets
   the floor *and* that the wheelhouse serves; none meets the floor, or none is served:
   one line naming what was found, its version and the floor (or what is served), exit 1;
2. with ``find-links``, appends this guest's ``linux-<arch>-py<ver>/`` to the wheelhouse
   root (``make wheelhouse`` writes one directory per target), so one URL serves arm64 and
   amd64 guests alike; a wheelhouse with nothing for this platform is refused by name;
3. fetches pip's own wheel (from that directory, or the index's ``pip/`` page) and creates
   the venv ``--without-pip``; pip then runs from its wheel (``python pip.whl/pip``), the way
   pip itself is bootstrapped without ensurepip;
4. installs the requirement; pip's output goes to a log file and a failure becomes one line
   naming the missing distribution and the platform.

Any failure removes the venv, so nothing is half-installed, and exits non-zero, so the
runcmd stops before its commit and the setup is redone at the next boot.

It runs on whatever python3 the image has, possibly older than the floor (RHEL 9: 3.9),
to say so. Hence: standard library only, nothing newer than Python 3.8 (no
``from __future__ import annotations``, ``typing`` generics), checked by
tests/unit/guest/installer/test_bootstrap.py and run for real under Debian 11's 3.9 in tests/chroot.
"""

import argparse
import hashlib
import html.parser
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

#: The oldest CPython the guest package supports: its config is TOML, and ``tomllib`` is
#: 3.11+ (docs/install.md, "Python floor"). pyproject.toml's requires-python says the same.
PYTHON_FLOOR = (3, 11)
PREFIX = "imex-ensemble setup"
#: Debian architecture names, as ``make wheelhouse`` names its directories
ARCH_OF_MACHINE = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64"}
_PY_NAME = re.compile(r"^python3(\.[0-9]+)?$")
_TARGET_DIR = re.compile(r"^linux-([a-z0-9]+)-py3\.([0-9]+)/?$")
_WHEEL = re.compile(r"^(?P<name>[^-]+)-(?P<ver>[^-]+)(-[0-9][^-]*)?-(?P<py>[^-]+)-(?P<abi>[^-]+)"
                    r"-(?P<plat>[^-]+)\.whl$")
_NO_MATCH = re.compile(r"No matching distribution found for ([A-Za-z0-9._-]+)")
_RHEL_LIKE = ("rhel", "centos", "fedora", "rocky", "almalinux", "ol")
#: what the daemon imports (its lazily imported stages included, and the TLS ones an
#: ensemble with authEncryption needs, cryptography's compiled module with them): importing
#: them once proves the install whole, each compiled module for this CPU included, and
#: byte-compiles exactly what runs
AGENT_IMPORTS = ("import guest_agent.cli, guest_agent.commands, guest_agent.agent, "
                 "guest_agent.peers.discovery_io, guest_agent.report.report_io, "
                 "guest_agent.net.netwatch, guest_agent.files.filewatch, "
                 "guest_agent.tls.keeper_io, guest_agent.tls.imex_config, "
                 "guest_agent.tls.creds_io, guest_agent.workload.preflight_io, "
                 "guest_agent.workload.barrier_io")


class SetupError(Exception):
    """The one line the console gets."""


class Interpreter(NamedTuple):
    path: str
    version: Tuple[int, int]
    venv: bool


def vtext(v: Sequence[int]) -> str:
    return ".".join(str(x) for x in v)


def find_interpreters(path_env: str) -> List[Interpreter]:
    """Every distinct ``python3``/``python3.N`` on ``path_env``, with its version."""
    seen: Dict[str, Interpreter] = {}
    for d in path_env.split(os.pathsep):
        try:
            names = sorted(os.listdir(d))
        except OSError:
            continue
        for name in names:
            full = os.path.join(d, name)
            if not _PY_NAME.match(name) or not os.access(full, os.X_OK):
                continue
            real = os.path.realpath(full)
            if real in seen or not os.path.isfile(real):
                continue
            probe = ("import sys, importlib.util as u; print('%d.%d' % sys.version_info[:2], "
                     "u.find_spec('venv') is not None)")
            try:
                out = subprocess.run([full, "-c", probe], stdout=subprocess.PIPE,
                                     stderr=subprocess.DEVNULL, universal_newlines=True,
                                     timeout=30, check=True).stdout.split()
                major, minor = out[0].split(".")
                seen[real] = Interpreter(full, (int(major), int(minor)), out[1] == "True")
            except (OSError, subprocess.SubprocessError, ValueError, IndexError):
                continue
    return sorted(seen.values(), key=lambda i: i.version, reverse=True)


def os_hint(os_release: str) -> str:
    """What installs a newer interpreter on this distribution (from /etc/os-release)."""
    ids = set()
    for line in os_release.splitlines():
        key, _, value = line.partition("=")
        if key in ("ID", "ID_LIKE"):
            ids.update(value.strip().strip('"').split())
    if ids & set(_RHEL_LIKE):
        return "install python3.11 or python3.12 from AppStream (dnf install python3.12)"
    return "install python3.11 or newer from your distribution"


def choose(found: Sequence[Interpreter], served: Optional[Sequence[Tuple[int, int]]],
           floor: Tuple[int, int], where: str, hint: str) -> Interpreter:
    """The newest interpreter that meets the floor and that the source serves (None: any)."""
    usable = [i for i in found if i.version >= floor and i.venv]
    if not found:
        raise SetupError(f"no python3 on PATH; the floor is {vtext(floor)}: {hint}")
    if not usable:
        best = found[0]
        if best.version >= floor:
            raise SetupError(f"python{vtext(best.version)} ({best.path}) has no venv module; "
                             "install its standard library package")
        raise SetupError(f"python{vtext(best.version)} ({best.path}) is the newest python3 "
                         f"here, below the floor {vtext(floor)}: {hint}, then boot again")
    if served is None:
        return usable[0]
    ok = [i for i in usable if i.version in served]
    if not ok:
        have = ", ".join(f"python{vtext(i.version)} ({i.path})" for i in usable)
        offer = ", ".join(f"python{vtext(v)}" for v in sorted(served)) or "nothing"
        raise SetupError(f"found {have}; {where} serves {offer} for this platform: rebuild "
                         f"the wheelhouse for this Python or install one it serves")
    return ok[0]


class _Links(html.parser.HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: List[str] = []

    def handle_starttag(self, tag: str, attrs: List[Tuple[str, Optional[str]]]) -> None:
        if tag == "a":
            for k, v in attrs:
                if k == "href" and v:
                    self.hrefs.append(v)


def links(page: str) -> List[str]:
    """The hrefs of an HTML page (a directory listing or a PEP 503 index page)."""
    p = _Links()
    p.feed(page)
    return p.hrefs


def basename(href: str) -> str:
    path = urllib.parse.unquote(urllib.parse.urlsplit(href).path)
    return path.rstrip("/").rsplit("/", 1)[-1] + ("/" if path.endswith("/") else "")


def served_targets(hrefs: Sequence[str]) -> Dict[str, List[Tuple[int, int]]]:
    """``make wheelhouse`` directories in a root listing: arch -> Python versions."""
    out: Dict[str, List[Tuple[int, int]]] = {}
    for h in hrefs:
        m = _TARGET_DIR.match(basename(h))
        if m:
            out.setdefault(m.group(1), []).append((3, int(m.group(2))))
    return out


def wheel_fits(filename: str, machine: str, version: Tuple[int, int]) -> bool:
    """Whether this interpreter (CPU ``machine``, CPython ``version``) can install it."""
    m = _WHEEL.match(filename)
    if not m:
        return False
    plats = m.group("plat").split(".")
    if not any(p == "any" or (p.startswith(("manylinux", "linux_")) and p.endswith("_" + machine))
               for p in plats):
        return False
    cp = f"cp{version[0]}{version[1]}"
    for py in m.group("py").split("."):
        for abi in m.group("abi").split("."):
            if abi == "none" and (py in ("py3", f"py{version[0]}{version[1]}", cp)):
                return True
            if abi == cp and py == cp:
                return True
            if abi == "abi3" and py.startswith("cp3") and int(py[3:] or 0) <= version[1]:
                return True
    return False


def foreign_only(filenames: Sequence[str], machine: str,
                 version: Tuple[int, int]) -> Dict[str, List[str]]:
    """Distributions present only as wheels this interpreter cannot install."""
    by_name: Dict[str, List[str]] = {}
    for f in filenames:
        m = _WHEEL.match(f)
        if m:
            by_name.setdefault(m.group("name").lower().replace("_", "-"), []).append(f)
    return {n: fs for n, fs in by_name.items()
            if not any(wheel_fits(f, machine, version) for f in fs)}


def newest_pip(filenames: Sequence[str]) -> Optional[str]:
    best: Optional[Tuple[Tuple[int, ...], str]] = None
    for f in filenames:
        m = _WHEEL.match(f)
        if not m or m.group("name") != "pip" or m.group("plat") != "any":
            continue
        try:
            key = tuple(int(x) for x in m.group("ver").split("."))
        except ValueError:
            continue  # a pre-release
        if best is None or key > best[0]:
            best = (key, f)
    return best[1] if best else None


def missing_distribution(pip_output: str) -> Optional[str]:
    m = _NO_MATCH.search(pip_output)
    return m.group(1) if m else None


def fetch(url: str, tries: int = 4) -> bytes:
    """GET with a few retries: the final stage runs right after the network came up."""
    last: Exception = SetupError("no attempt")
    for n in range(tries):
        if n:
            time.sleep(2 ** (n - 1))
        try:
            with urllib.request.urlopen(url, timeout=30) as r:
                return r.read()  # type: ignore[no-any-return]
        except (OSError, ValueError) as e:
            last = e
    raise SetupError(f"cannot fetch {url}: {last}")


class Plan(NamedTuple):
    python: Interpreter
    #: pip's wheel; empty: the interpreter's own ensurepip (``wheel:URL`` sources)
    pip_wheel_url: str
    pip_args: List[str]
    where: str


def trusted_host(url: str) -> List[str]:
    """pip ignores plain-HTTP locations on hosts it does not trust (seen in tests/vm)."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme != "http" or not parts.netloc:
        return []
    return ["--trusted-host", parts.netloc.rpartition("@")[2]]


def listing(url: str) -> List[str]:
    """The entries of a directory URL: an HTTP directory listing's links, or, for a
    ``file:`` URL (a wheelhouse copied into the image), the directory itself."""
    parts = urllib.parse.urlsplit(url)
    if parts.scheme == "file":
        path = urllib.parse.unquote(parts.path)
        try:
            return sorted(n + ("/" if os.path.isdir(os.path.join(path, n)) else "")
                          for n in os.listdir(path))
        except OSError as e:
            raise SetupError(f"cannot list {url}: {e}") from None
    return links(fetch(url).decode("utf-8", "replace"))


def plan_find_links(root: str, found: Sequence[Interpreter], floor: Tuple[int, int],
                    machine: str, hint: str) -> Plan:
    """The interpreter and wheelhouse directory for this guest (refusals by name)."""
    arch = ARCH_OF_MACHINE.get(machine, machine)
    root = root if root.endswith("/") else root + "/"
    hrefs = listing(root)
    targets = served_targets(hrefs)
    if targets:
        mine = targets.get(arch, [])
        if not mine:
            other = ", ".join(sorted(f"linux-{a}-py{vtext(v)}" for a, vs in targets.items()
                                     for v in vs))
            raise SetupError(f"the wheelhouse {root} has nothing for linux-{arch} (this "
                             f"guest is {machine}); it serves {other}: run make wheelhouse "
                             f"PLATFORM=linux/{arch}")
        py = choose(found, mine, floor, f"the wheelhouse {root}", hint)
        where = urllib.parse.urljoin(root, f"linux-{arch}-py{vtext(py.version)}/")
        files = [basename(h) for h in listing(where)]
    else:  # a flat wheelhouse (pip wheel -w): whatever it holds must fit this guest
        py = choose(found, None, floor, f"the wheelhouse {root}", hint)
        where, files = root, [basename(h) for h in hrefs]
    wrong = foreign_only([f for f in files if f.endswith(".whl")], machine, py.version)
    if wrong:
        name, fs = sorted(wrong.items())[0]
        raise SetupError(f"the wheelhouse {where} has no wheel of {name} for linux-{arch} "
                         f"python{vtext(py.version)} (only {', '.join(sorted(fs))})")
    pip = newest_pip(files)
    if pip is None:
        raise SetupError(f"the wheelhouse {where} has no pip wheel (pip-*-py3-none-any.whl) "
                         "to bootstrap from: rebuild it with make wheelhouse")
    return Plan(py, urllib.parse.urljoin(where, urllib.parse.quote(pip)),
                ["--no-index", "--find-links", where, *trusted_host(where)], where)


def plan_index(index: str, found: Sequence[Interpreter], floor: Tuple[int, int],
               hint: str) -> Plan:
    index = index if index.endswith("/") else index + "/"
    py = choose(found, None, floor, f"the index {index}", hint)
    page = urllib.parse.urljoin(index, "pip/")
    hrefs = links(fetch(page).decode("utf-8", "replace"))
    by_name = {basename(h): urllib.parse.urljoin(page, h) for h in hrefs}
    pip = newest_pip(list(by_name))
    if pip is None:
        raise SetupError(f"the index {page} lists no pip wheel to bootstrap from")
    return Plan(py, by_name[pip], ["--index-url", index, *trusted_host(index)], index)


def plan_wheel(url: str, found: Sequence[Interpreter], floor: Tuple[int, int],
               hint: str) -> Plan:
    """A single wheel URL: its dependencies come from pip's default index, and pip itself
    can only come from the image (ensurepip), since no wheelhouse or index is named."""
    py = choose(found, None, floor, url, hint)
    probe = subprocess.run([py.path, "-c", "import ensurepip"], stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, timeout=60, check=False)
    if probe.returncode != 0:
        raise SetupError(f"wheel:{url} needs pip from the image, and python{vtext(py.version)}"
                         f" ({py.path}) has no ensurepip (python3-venv): use find-links:URL "
                         "(make wheelhouse) or pip-index:URL, which bring their own pip")
    return Plan(py, "", [], url)


def get_pip(url: str, dest_dir: str) -> str:
    """Download pip's wheel, checking a ``#sha256=`` fragment when the index gives one."""
    base, _, frag = url.partition("#")
    data = fetch(base)
    if frag.startswith("sha256=") and hashlib.sha256(data).hexdigest() != frag[7:]:
        raise SetupError(f"{base}: sha256 mismatch")
    path = os.path.join(dest_dir, basename(base))
    with open(path, "wb") as f:
        f.write(data)
    return path


def install(plan: Plan, venv: str, requirement: str, log_path: str, machine: str) -> None:
    """A fresh venv with ``requirement``; on any failure no venv is left."""
    shutil.rmtree(venv, ignore_errors=True)
    tmp = tempfile.mkdtemp(prefix="imex-setup-")
    try:
        pip = get_pip(plan.pip_wheel_url, tmp) if plan.pip_wheel_url else ""
        with open(log_path, "a") as log:
            log.write(f"\n== {time.strftime('%Y-%m-%dT%H:%M:%S')} {plan.python.path} "
                      f"{plan.where}\n")
            log.flush()
            subprocess.run([plan.python.path, "-m", "venv", *([] if not pip else
                            ["--without-pip"]), venv], check=True,
                           stdout=log, stderr=subprocess.STDOUT, timeout=600)
            run_pip = [os.path.join(pip, "pip")] if pip else ["-m", "pip"]
            # --no-compile: byte-compiling every installed module took most of an arm64
            # TCG guest's 11-minute install; AGENT_IMPORTS below compiles what runs
            argv = [os.path.join(venv, "bin", "python"), *run_pip, "install",
                    "--disable-pip-version-check", "--no-input", "--no-cache-dir",
                    "--no-compile", *plan.pip_args, requirement]
            proc = subprocess.run(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                  universal_newlines=True, timeout=1800, check=False)
            log.write(proc.stdout if proc.stdout.endswith("\n") else proc.stdout + "\n")
        if proc.returncode != 0:
            dist = missing_distribution(proc.stdout)
            arch = ARCH_OF_MACHINE.get(machine, machine)
            if dist:
                raise SetupError(f"{plan.where} has no {dist} for linux-{arch} "
                                 f"python{vtext(plan.python.version)} (pip's log: {log_path})")
            errors = [ln for ln in proc.stdout.splitlines() if ln.startswith("ERROR")]
            raise SetupError(f"pip install {requirement} failed: "
                             f"{errors[-1] if errors else 'exit %d' % proc.returncode} "
                             f"(pip's log: {log_path})")
        # -I: this venv only (not the working directory, not PYTHONPATH)
        check = subprocess.run([os.path.join(venv, "bin", "python"), "-I", "-c", AGENT_IMPORTS],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               universal_newlines=True, timeout=900, check=False)
        if check.returncode != 0:
            last = (check.stdout.strip().splitlines() or ["exit %d" % check.returncode])[-1]
            raise SetupError(f"the installed agent does not start: {last}")
    except BaseException:
        shutil.rmtree(venv, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="install.py", description="install the imex guest agent")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--find-links", metavar="URL", help="wheelhouse root (make wheelhouse)")
    src.add_argument("--index-url", metavar="URL", help="a PEP 503 package index")
    src.add_argument("--wheel", metavar="URL", help="one wheel; dependencies from the index")
    p.add_argument("--requirement", required=True)
    p.add_argument("--venv", required=True)
    p.add_argument("--floor", default=vtext(PYTHON_FLOOR))
    p.add_argument("--log", default="/var/log/imex-guest-agent-install.log")
    args = p.parse_args(argv)
    floor = (int(args.floor.split(".")[0]), int(args.floor.split(".")[1]))
    machine = platform.machine()
    try:
        with open("/etc/os-release") as f:
            hint = os_hint(f.read())
    except OSError:
        hint = os_hint("")
    try:
        found = find_interpreters(os.environ.get("PATH", os.defpath))
        if args.find_links:
            plan = plan_find_links(args.find_links, found, floor, machine, hint)
        elif args.index_url:
            plan = plan_index(args.index_url, found, floor, hint)
        else:
            plan = plan_wheel(args.wheel, found, floor, hint)
        install(plan, args.venv, args.requirement, args.log, machine)
    except (SetupError, OSError, subprocess.SubprocessError) as e:
        print(f"{PREFIX}: error: {' '.join(str(e).split())}", file=sys.stderr, flush=True)
        return 1
    print(f"{PREFIX}: installed {args.requirement} into {args.venv} with "
          f"python{vtext(plan.python.version)} ({plan.python.path}) from {plan.where}",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
