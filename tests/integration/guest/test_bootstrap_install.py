"""The guest installer, run for real: the system python3, a wheelhouse over loopback HTTP.

The installer is written where cloud-init writes it (the generator's bytes, out of the
package: a copy beside guest_agent/http.py would shadow the standard library's ``http``)
and run as cloud-init runs it (``python3 install.py ...``) by
this machine's ``/usr/bin/python3``, with a PATH that holds only the interpreters a test
puts there. The wheelhouse is a ``make wheelhouse`` tree (``linux-<arch>-py<ver>/``)
served by ``http.server`` on 127.0.0.1 with its directory listing; its wheels are this
tree's wheel and the test venv's own distributions repacked (tests/guest_support/wheels.py),
so nothing leaves loopback. The server records every path asked for, so a test can tell
which directory the installer chose.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import http.server
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from guest_agent.installer import bootstrap as b
from guest_agent.installer import guest_files
from tests.guest_support.wheels import guest_wheelhouse


def guest_python() -> Path:
    """The python3 the installer runs as on a guest: the system's when it is the tests'
    own minor version (the repacked wheels, cffi's among them, are built for that one),
    else the base interpreter of the tests' venv (a Debian 13 machine has 3.13 as
    /usr/bin/python3). Either way a plain interpreter with ``venv``, outside any venv."""
    system = Path("/usr/bin/python3")
    want = f"import sys, venv; assert sys.version_info[:2] == {sys.version_info[:2]!r}"
    if system.exists() and subprocess.run([str(system), "-c", want],
                                          capture_output=True).returncode == 0:
        return system
    return Path(sys._base_executable)


SYSTEM_PYTHON = guest_python()


class Server:
    def __init__(self, root: Path) -> None:
        self.paths: list[str] = []
        paths = self.paths

        class Handler(http.server.SimpleHTTPRequestHandler):
            def log_message(self, *_: object) -> None:
                paths.append(self.path)

        self.httpd = http.server.ThreadingHTTPServer(
            ("127.0.0.1", 0), functools.partial(Handler, directory=str(root)))
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@contextlib.contextmanager
def serve(root: Path) -> Iterator[Server]:
    s = Server(root)
    try:
        yield s
    finally:
        s.close()


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return guest_wheelhouse(tmp_path_factory.mktemp("wheels"))


def tree(root: Path, wheels: Path, dirs: dict[str, tuple[str, ...]]) -> Path:
    """A wheelhouse root with one directory per name, each the wheels minus the skipped."""
    for name, skip in dirs.items():
        d = root / name
        d.mkdir(parents=True)
        for w in wheels.iterdir():
            if not w.name.startswith(skip) or not skip:
                shutil.copy(w, d / w.name)
    return root


def only_python(tmp_path: Path, target: Path = SYSTEM_PYTHON, name: str = "python3") -> Path:
    d = tmp_path / "path"
    d.mkdir(exist_ok=True)
    (d / name).symlink_to(target)
    return d


def run(tmp_path: Path, path_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {"PATH": f"{path_dir}", "HOME": str(tmp_path), "LANG": "C.UTF-8"}
    installer = tmp_path / "lib" / "install.py"
    installer.parent.mkdir(exist_ok=True)
    installer.write_text(guest_files.installer_source())
    return subprocess.run(
        [str(SYSTEM_PYTHON), str(installer), *args, "--venv", str(tmp_path / "venv"),
         "--log", str(tmp_path / "install.log")],
        env=env, capture_output=True, text=True, timeout=300, check=False)


REQ = "imex-ensemble[guest]"


def test_installs_from_its_own_platform_directory_without_pip_in_the_image(
        tmp_path: Path, wheels: Path) -> None:
    root = tree(tmp_path / "w", wheels, {"linux-amd64-py3.11": (), "linux-arm64-py3.11": (),
                                        "linux-amd64-py3.13": ()})
    with serve(root) as srv:
        p = run(tmp_path, only_python(tmp_path), "--find-links", srv.url, "--requirement", REQ)
    assert p.returncode == 0, p.stderr
    assert p.stderr == ""
    (line,) = p.stdout.splitlines()
    assert line.startswith("imex-ensemble setup: installed imex-ensemble[guest]")
    assert f"python3.11 ({tmp_path / 'path' / 'python3'})" in line
    assert line.endswith(f"from {srv.url}linux-amd64-py3.11/")
    # no python 3.13 here: its directory is never read; arm64's neither
    assert not any(x.startswith(("/linux-arm64", "/linux-amd64-py3.13")) for x in srv.paths)
    venv = tmp_path / "venv"
    agent = subprocess.run([str(venv / "bin" / "imex-guest-agent"), "--help"],
                           capture_output=True, text=True, timeout=60)
    assert agent.returncode == 0 and "render" in agent.stdout
    # pip ran from its wheel: the venv holds none (the image never had one)
    assert not (venv / "bin" / "pip").exists()
    probe = subprocess.run([str(venv / "bin" / "python"), "-c",
                            "import watchfiles, dns, pyroute2, tenacity, cryptography; "
                            "import importlib.util as u; print(u.find_spec('pip'))"],
                           capture_output=True, text=True, timeout=60)
    assert probe.stdout.strip() == "None", probe.stderr


def test_a_missing_wheel_is_one_line_naming_it_and_nothing_stays_installed(
        tmp_path: Path, wheels: Path) -> None:
    root = tree(tmp_path / "w", wheels, {"linux-amd64-py3.11": ("watchfiles",)})
    (tmp_path / "venv" / "bin").mkdir(parents=True)  # an older install: gone afterwards too
    with serve(root) as srv:
        p = run(tmp_path, only_python(tmp_path), "--find-links", srv.url, "--requirement", REQ)
    assert p.returncode == 1
    (line,) = p.stderr.splitlines()
    assert line == (f"imex-ensemble setup: error: {srv.url}linux-amd64-py3.11/ has no "
                    f"watchfiles for linux-amd64 python3.11 (pip's log: {tmp_path}/install.log)")
    assert not (tmp_path / "venv").exists()
    log = (tmp_path / "install.log").read_text()
    assert "No matching distribution found for watchfiles" in log  # the detail is kept there


def test_below_the_floor_is_refused_before_anything_is_fetched_but_the_listing(
        tmp_path: Path, wheels: Path) -> None:
    fake = tmp_path / "py39"
    fake.write_text("#!/bin/sh\necho '3.9 True'\n")  # what RHEL 9's python3 answers
    fake.chmod(0o755)
    root = tree(tmp_path / "w", wheels, {"linux-amd64-py3.11": ()})
    with serve(root) as srv:
        p = run(tmp_path, only_python(tmp_path, fake), "--find-links", srv.url,
                "--requirement", REQ)
    assert p.returncode == 1 and p.stdout == ""
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"imex-ensemble setup: error: python3.9 ({tmp_path}/path/python3) "
                           "is the newest python3 here, below the floor 3.11: install ")
    assert srv.paths == ["/"]
    assert not (tmp_path / "venv").exists()


def test_a_newer_python_than_the_wheelhouse_serves_names_what_it_serves(
        tmp_path: Path, wheels: Path) -> None:
    fake = tmp_path / "py314"
    fake.write_text("#!/bin/sh\necho '3.14 True'\n")
    fake.chmod(0o755)
    root = tree(tmp_path / "w", wheels, {"linux-amd64-py3.11": (), "linux-amd64-py3.12": ()})
    with serve(root) as srv:
        p = run(tmp_path, only_python(tmp_path, fake, "python3.14"), "--find-links", srv.url,
                "--requirement", REQ)
    (line,) = p.stderr.splitlines()
    assert p.returncode == 1
    assert f"found python3.14 ({tmp_path}/path/python3.14)" in line
    assert f"the wheelhouse {srv.url} serves python3.11, python3.12 for this platform" in line


def test_an_arm64_guest_is_refused_an_amd64_only_wheelhouse(tmp_path: Path,
                                                              wheels: Path) -> None:
    root = tree(tmp_path / "w", wheels, {"linux-amd64-py3.11": (), "linux-amd64-py3.13": ()})
    found = [b.Interpreter("/usr/bin/python3", (3, 11), True)]
    with serve(root) as srv, pytest.raises(b.SetupError) as e:
        b.plan_find_links(srv.url, found, (3, 11), "aarch64", "h")
    assert str(e.value) == (
        f"the wheelhouse {srv.url} has nothing for linux-arm64 (this guest is aarch64); it "
        "serves linux-amd64-py3.11, linux-amd64-py3.13: run make wheelhouse "
        "PLATFORM=linux/arm64")


def test_a_flat_wheelhouse_of_another_cpu_names_the_distribution(tmp_path: Path,
                                                                 wheels: Path) -> None:
    # the old documented way (pip wheel -w wheelhouse on an x86 workstation), seen by arm64
    flat = tmp_path / "flat"
    shutil.copytree(wheels, flat)
    found = [b.Interpreter("/usr/bin/python3", (3, 11), True)]
    with serve(flat) as srv, pytest.raises(b.SetupError) as e:
        b.plan_find_links(srv.url, found, (3, 11), "aarch64", "h")
    msg = str(e.value)
    assert msg.startswith(f"the wheelhouse {srv.url} has no wheel of cffi for linux-arm64 "
                          "python3.11 (only cffi-")
    assert "x86_64" in msg
    # the same flat wheelhouse on its own CPU is fine
    with serve(flat) as srv:
        plan = b.plan_find_links(srv.url, found, (3, 11), "x86_64", "h")
    assert plan.where == srv.url and plan.pip_wheel_url.startswith(f"{srv.url}pip-")


def simple_index(root: Path, wheels: Path, corrupt_pip_hash: bool = False) -> Path:
    """A static PEP 503 index: one page per project, links with sha256 fragments."""
    from packaging.utils import canonicalize_name, parse_wheel_filename

    for w in wheels.glob("*.whl"):
        name = canonicalize_name(parse_wheel_filename(w.name)[0])
        d = root / name
        d.mkdir(parents=True, exist_ok=True)
        shutil.copy(w, d / w.name)
        sha = hashlib.sha256(w.read_bytes()).hexdigest()
        if corrupt_pip_hash and name == "pip":
            sha = "0" * 64
        with open(d / "index.html", "a") as f:
            f.write(f'<a href="{w.name}#sha256={sha}">{w.name}</a>\n')
    return root


def test_an_index_serves_the_pip_wheel_too(tmp_path: Path, wheels: Path) -> None:
    with serve(simple_index(tmp_path / "simple", wheels)) as srv:
        p = run(tmp_path, only_python(tmp_path), "--index-url", srv.url, "--requirement", REQ)
    assert p.returncode == 0, p.stderr
    assert "/pip/" in srv.paths
    assert (tmp_path / "venv" / "bin" / "imex-guest-agent").exists()


def test_a_pip_wheel_that_fails_its_hash_is_refused(tmp_path: Path, wheels: Path) -> None:
    with serve(simple_index(tmp_path / "simple", wheels, corrupt_pip_hash=True)) as srv:
        p = run(tmp_path, only_python(tmp_path), "--index-url", srv.url, "--requirement", REQ)
    assert p.returncode == 1
    (line,) = p.stderr.splitlines()
    assert line.startswith("imex-ensemble setup: error: ") and "sha256 mismatch" in line
    assert not (tmp_path / "venv").exists()


def test_an_unreachable_wheelhouse_is_one_line(tmp_path: Path) -> None:
    with serve(tmp_path) as srv:
        url = srv.url  # a port that just stopped listening
    p = run(tmp_path, only_python(tmp_path), "--find-links", url, "--requirement", REQ)
    assert p.returncode == 1
    (line,) = p.stderr.splitlines()
    assert line.startswith(f"imex-ensemble setup: error: cannot fetch {url}: ")
    assert "refused" in line.lower()


def test_a_single_wheel_needs_ensurepip_in_the_image(tmp_path: Path) -> None:
    fake = tmp_path / "python3.12"
    fake.write_text("#!/bin/sh\n[ \"$2\" = 'import ensurepip' ] && exit 1\necho '3.12 True'\n")
    fake.chmod(0o755)
    found = b.find_interpreters(str(tmp_path))
    with pytest.raises(b.SetupError) as e:
        b.plan_wheel("https://files.internal/x.whl", found, (3, 11), "h")
    assert "has no ensurepip (python3-venv): use find-links:URL" in str(e.value)
    assert os.access(fake, os.X_OK)


def test_an_install_that_does_not_import_is_removed(tmp_path: Path, wheels: Path) -> None:
    """pip succeeded, the daemon would not start: one line, and no venv left."""
    from tests.guest_support.wheels import project_wheel

    root = tree(tmp_path / "w", wheels, {"linux-amd64-py3.11": ("imex_ensemble",)})

    def tear(src: Path) -> None:  # a module the daemon imports only lazily
        with open(src / "guest_agent" / "net" / "netwatch.py", "a") as f:
            f.write("\nraise ImportError('torn module')\n")

    project_wheel(root / "linux-amd64-py3.11", tear)
    with serve(root) as srv:
        p = run(tmp_path, only_python(tmp_path), "--find-links", srv.url, "--requirement", REQ)
    assert p.returncode == 1
    (line,) = p.stderr.splitlines()
    assert line == ("imex-ensemble setup: error: the installed agent does not start: "
                    "ImportError: torn module")
    assert not (tmp_path / "venv").exists()
