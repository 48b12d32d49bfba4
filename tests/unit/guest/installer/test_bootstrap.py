"""The guest installer's decisions, without a network: interpreter choice, wheelhouse
layout, wheel fit, the one-line refusals; and that it still parses on an old python3."""

from __future__ import annotations

import ast
import sys
import tomllib
from pathlib import Path

import pytest

from guest_agent.installer import bootstrap as b

REPO = Path(__file__).resolve().parents[4]
SOURCE = (REPO / "guest_agent" / "installer" / "bootstrap.py").read_text()

# a real http.server directory listing (Python 3.11), trimmed
LISTING = """<!DOCTYPE HTML>
<html lang="en"><head><title>Directory listing for /</title></head><body><ul>
<li><a href="linux-amd64-py3.11/">linux-amd64-py3.11/</a></li>
<li><a href="linux-amd64-py3.13/">linux-amd64-py3.13/</a></li>
<li><a href="linux-arm64-py3.12/">linux-arm64-py3.12/</a></li>
<li><a href="README.txt">README.txt</a></li>
</ul></body></html>
"""


def interp(version: tuple[int, int], path: str | None = None, venv: bool = True) -> b.Interpreter:
    return b.Interpreter(path or f"/usr/bin/python{b.vtext(version)}", version, venv)


# --- runs on the guest's python3, whatever its version ------------------------------


def test_the_installer_parses_as_python_3_8_and_uses_only_the_standard_library() -> None:
    tree = ast.parse(SOURCE, feature_version=(3, 8))
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.module != "__future__", "annotations import needs 3.7+ and hides 3.8 bugs"
            imported.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Import):
            imported.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.NamedExpr):
            pytest.fail("walrus")
    assert imported <= sys.stdlib_module_names, imported - sys.stdlib_module_names
    # annotations are evaluated at definition time on 3.8: no builtin generics in them
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
            assert node.value.id not in ("list", "dict", "tuple", "set"), ast.unparse(node)
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
            assert not isinstance(node.right, ast.Constant), "X | None needs 3.10"


def test_the_floor_is_pyprojects_requires_python() -> None:
    doc = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert doc["project"]["requires-python"] == f">={b.vtext(b.PYTHON_FLOOR)}"
    assert b.PYTHON_FLOOR == (3, 11)  # tomllib (the guest config is TOML) is 3.11+


# --- which interpreter --------------------------------------------------------------


def test_newest_served_interpreter_that_meets_the_floor_wins() -> None:
    found = [interp((3, 14)), interp((3, 13)), interp((3, 12)), interp((3, 9))]
    served = [(3, 11), (3, 12), (3, 13)]
    assert b.choose(found, served, (3, 11), "w", "h").version == (3, 13)
    assert b.choose(found, [(3, 12)], (3, 11), "w", "h").version == (3, 12)
    assert b.choose(found, None, (3, 11), "w", "h").version == (3, 14)  # an index serves any


def test_below_the_floor_is_one_line_naming_interpreter_version_and_floor() -> None:
    found = [interp((3, 9), "/usr/bin/python3"), interp((3, 6), "/usr/libexec/platform-python")]
    rhel = b.os_hint('NAME="Red Hat Enterprise Linux"\nID="rhel"\nID_LIKE="fedora"\n')
    with pytest.raises(b.SetupError) as e:
        b.choose(found, [(3, 11)], (3, 11), "the wheelhouse", rhel)
    msg = str(e.value)
    assert "\n" not in msg
    assert "python3.9 (/usr/bin/python3)" in msg and "below the floor 3.11" in msg
    assert "python3.11 or python3.12 from AppStream" in msg
    debian = b.os_hint('ID=debian\nVERSION_ID="11"\n')
    assert "AppStream" not in debian and "python3.11" in debian


def test_only_an_unserved_python_names_what_the_wheelhouse_serves() -> None:
    with pytest.raises(b.SetupError) as e:
        b.choose([interp((3, 14))], [(3, 11), (3, 12), (3, 13)], (3, 11), "the wheelhouse W", "h")
    msg = str(e.value)
    assert "python3.14 (/usr/bin/python3.14)" in msg
    assert "the wheelhouse W serves python3.11, python3.12, python3.13" in msg


def test_an_interpreter_without_venv_is_not_used() -> None:
    found = [interp((3, 13), venv=False), interp((3, 11))]
    assert b.choose(found, None, (3, 11), "w", "h").version == (3, 11)
    with pytest.raises(b.SetupError, match="has no venv module"):
        b.choose([interp((3, 13), venv=False)], None, (3, 11), "w", "h")
    with pytest.raises(b.SetupError, match="no python3 on PATH"):
        b.choose([], None, (3, 11), "w", "h")


def test_interpreters_on_path_are_found_once_each_with_their_version(tmp_path: Path) -> None:
    bin1, bin2 = tmp_path / "usr-local-bin", tmp_path / "usr-bin"
    bin1.mkdir()
    bin2.mkdir()
    for d, name, out in ((bin2, "python3.12", "3.12 True"), (bin1, "python3.13", "3.13 True"),
                         (bin2, "python3.9", "3.9 False"), (bin2, "python3-config", "x")):
        (d / name).write_text(f"#!/bin/sh\necho '{out}'\n")
        (d / name).chmod(0o755)
    (bin2 / "python3").symlink_to(bin2 / "python3.12")  # same interpreter, found once
    (bin2 / "python3.10").write_text("#!/bin/sh\necho '3.10 True'\n")  # not executable
    (bin2 / "python3.8").write_text("#!/bin/sh\nexit 3\n")
    (bin2 / "python3.8").chmod(0o755)  # fails its probe: skipped
    found = b.find_interpreters(f"{bin1}:{tmp_path / 'missing'}:{bin2}")
    assert [(Path(i.path).name, i.version, i.venv) for i in found] == [
        ("python3.13", (3, 13), True), ("python3", (3, 12), True), ("python3.9", (3, 9), False)]


# --- the wheelhouse -----------------------------------------------------------------


def test_root_listing_names_each_platform_and_python() -> None:
    targets = b.served_targets(b.links(LISTING))
    assert targets == {"amd64": [(3, 11), (3, 13)], "arm64": [(3, 12)]}
    assert b.served_targets(b.links('<a href="/w/linux-arm64-py3.13/">x</a>')) == {
        "arm64": [(3, 13)]}
    assert b.served_targets(b.links('<a href="watchfiles-1.0-py3-none-any.whl">w</a>')) == {}


@pytest.mark.parametrize(("wheel", "machine", "version", "fits"), [
    ("watchfiles-1.3.0-cp310-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
     "aarch64", (3, 13), True),
    ("watchfiles-1.3.0-cp310-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
     "x86_64", (3, 13), False),
    ("watchfiles-1.3.0-cp313-cp313-manylinux_2_17_x86_64.whl", "x86_64", (3, 13), True),
    ("watchfiles-1.3.0-cp313-cp313-manylinux_2_17_x86_64.whl", "x86_64", (3, 12), False),
    ("cryptography-50.0.2-cp311-abi3-manylinux_2_34_aarch64.whl", "aarch64", (3, 11), True),
    ("cryptography-50.0.2-cp311-abi3-manylinux_2_34_aarch64.whl", "aarch64", (3, 10), False),
    ("dnspython-2.9.2-py3-none-any.whl", "aarch64", (3, 11), True),
    ("pyroute2-0.9.7-py2.py3-none-any.whl", "x86_64", (3, 13), True),
    ("watchfiles-1.3.0-cp313-cp313-win_amd64.whl", "x86_64", (3, 13), False),
    ("watchfiles-1.3.0-cp313-cp313-musllinux_1_1_x86_64.whl", "x86_64", (3, 13), False),
    ("not-a-wheel.tar.gz", "x86_64", (3, 13), False),
])
def test_wheel_fits_cpu_and_python(wheel: str, machine: str, version: tuple[int, int],
                                   fits: bool) -> None:
    assert b.wheel_fits(wheel, machine, version) is fits


def test_distributions_present_only_for_another_platform_are_named() -> None:
    files = ["watchfiles-1.3.0-cp310-abi3-manylinux_2_17_x86_64.whl",
             "dnspython-2.9.2-py3-none-any.whl",
             "cffi-2.1.1-cp311-cp311-manylinux_2_17_x86_64.whl",
             "cffi-2.1.1-cp311-cp311-manylinux_2_17_aarch64.whl"]
    assert b.foreign_only(files, "aarch64", (3, 11)) == {
        "watchfiles": ["watchfiles-1.3.0-cp310-abi3-manylinux_2_17_x86_64.whl"]}
    assert b.foreign_only(files, "x86_64", (3, 11)) == {}


def test_newest_pip_wheel_is_picked_and_prereleases_are_not() -> None:
    names = ["pip-9.0.1-py2.py3-none-any.whl", "pip-24.0-py3-none-any.whl",
             "pip-26.3-py3-none-any.whl", "pip-27.0b1-py3-none-any.whl", "pipx-9-py3-none-any.whl",
             "pip-26.3.tar.gz"]
    assert b.newest_pip(names) == "pip-26.3-py3-none-any.whl"
    assert b.newest_pip(["dnspython-2.9.2-py3-none-any.whl"]) is None


def test_pips_missing_distribution_is_read_from_its_output() -> None:
    out = ("Looking in links: http://10.0.0.1/w/linux-arm64-py3.11/\n"
           "ERROR: Could not find a version that satisfies the requirement watchfiles>=0.21 "
           "(from imex-ensemble[guest]) (from versions: none)\n"
           "ERROR: No matching distribution found for watchfiles>=0.21\n")
    assert b.missing_distribution(out) == "watchfiles"
    assert b.missing_distribution("ERROR: something else\n") is None


def test_plain_http_locations_are_trusted_https_are_not() -> None:
    # found by the VM tier: a guest's pip refused http://10.77.0.1:8000/ as "not a trusted
    # or secure host" and the runcmd failed
    assert b.trusted_host("http://10.77.0.1:8000/w/") == ["--trusted-host", "10.77.0.1:8000"]
    assert b.trusted_host("http://user@mirror.lan/simple/") == ["--trusted-host", "mirror.lan"]
    assert b.trusted_host("https://mirror.lan/simple/") == []
    assert b.trusted_host("file:///srv/wheels/") == []


def test_the_import_check_covers_every_stage_the_daemon_imports_lazily() -> None:
    # pip runs with --no-compile; this import is what compiles (and proves) the daemon
    funcs = [f for name in ("commands.py", "agent.py")
             for f in ast.walk(ast.parse((REPO / "guest_agent" / name).read_text()))
             if isinstance(f, ast.FunctionDef | ast.AsyncFunctionDef)]
    lazy: set[str] = set()
    for fn in funcs:
        for node in ast.walk(fn):
            if not isinstance(node, ast.ImportFrom) or not (node.module or "").startswith(
                    "guest_agent"):
                continue
            for alias in node.names:  # `from guest_agent.net import netwatch` names a module
                name = f"{node.module}.{alias.name}"
                is_module = (REPO / (name.replace(".", "/") + ".py")).is_file()
                lazy.add(name if is_module else node.module or "")
    checked = {m.strip() for m in b.AGENT_IMPORTS.removeprefix("import ").split(",")}
    assert {"guest_agent.agent", "guest_agent.peers.discovery_io", "guest_agent.net.netwatch",
            "guest_agent.files.filewatch"} <= lazy
    assert lazy <= checked, lazy - checked
    for mod in checked:
        assert (REPO / (mod.replace(".", "/") + ".py")).is_file(), mod
