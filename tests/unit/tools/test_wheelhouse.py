"""``make wheelhouse``'s decisions without an index: targets, tags, the target's closure."""

from __future__ import annotations

import zipfile
from pathlib import Path

import pytest
from packaging.utils import NormalizedName, canonicalize_name

from tools import wheelhouse as wh


def test_default_targets_are_both_platforms_times_every_python_the_floor_allows() -> None:
    targets = wh.parse_targets([], [])
    assert [t.dirname for t in targets] == [
        "linux-amd64-py3.11", "linux-amd64-py3.12", "linux-amd64-py3.13",
        "linux-arm64-py3.11", "linux-arm64-py3.12", "linux-arm64-py3.13"]
    assert [t.dirname for t in wh.parse_targets(["linux/arm64"], ["3.12"])] == [
        "linux-arm64-py3.12"]


@pytest.mark.parametrize(("plats", "pys", "message"), [
    (["linux/arm"], [], "PLATFORM='linux/arm': expected one of linux/amd64, linux/arm64"),
    ([], ["3.9"], "PYTHON='3.9': expected one of 3.11, 3.12, 3.13 (the guest floor is 3.11)"),
    ([], ["3.14"], "PYTHON='3.14'"),
])
def test_bad_selections_name_the_variable(plats: list[str], pys: list[str],
                                          message: str) -> None:
    with pytest.raises(wh.WheelhouseError, match=message.replace("(", r"\(").replace(")", r"\)")):
        wh.parse_targets(plats, pys)


def test_make_variables_split_on_commas_and_spaces() -> None:
    assert wh.split_list(["linux/amd64,linux/arm64", "linux/amd64", " 3.12 3.13"]) == [
        "linux/amd64", "linux/arm64", "3.12", "3.13"]


def test_every_manylinux_tag_up_to_the_oldest_target_glibc_is_spelled_out() -> None:
    # pip expands manylinux2014 only downwards: a manylinux_2_28-only wheel needs its own tag
    arm = wh.Target("linux/arm64", "3.12").platform_tags()
    assert arm[0] == "manylinux_2_34_aarch64" and "manylinux_2_28_aarch64" in arm
    assert arm[-2:] == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]
    assert not any("2_35" in t or "2_36" in t for t in arm)  # RHEL 9 has glibc 2.34
    amd = wh.Target("linux/amd64", "3.12").platform_tags()
    assert {"manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64",
            "manylinux_2_28_x86_64"} <= set(amd)
    assert all(t.endswith("_x86_64") for t in amd)


def test_a_target_installs_its_own_cpu_and_python_only() -> None:
    t = wh.Target("linux/arm64", "3.12")
    names = ["watchfiles-1.3.0-cp310-abi3-manylinux_2_17_aarch64.manylinux2014_aarch64.whl",
             "watchfiles-1.3.0-cp310-abi3-manylinux_2_17_x86_64.whl",
             "cffi-2.1.1-cp313-cp313-manylinux_2_17_aarch64.whl",
             "cffi-2.1.1-cp312-cp312-manylinux_2_28_aarch64.whl",
             "cryptography-50.0.2-cp311-abi3-manylinux_2_36_aarch64.whl",
             "dnspython-2.9.2-py3-none-any.whl"]
    assert wh.incompatible(names, t) == [
        "watchfiles-1.3.0-cp310-abi3-manylinux_2_17_x86_64.whl",
        "cffi-2.1.1-cp313-cp313-manylinux_2_17_aarch64.whl",
        "cryptography-50.0.2-cp311-abi3-manylinux_2_36_aarch64.whl"]


def info(name: str, version: str, *requires: str) -> wh.WheelInfo:
    filename = f"{name.replace('-', '_')}-{version}-py3-none-any.whl"
    return wh.WheelInfo(canonicalize_name(name), filename, requires)


WHEELS: dict[NormalizedName, wh.WheelInfo] = {w.name: w for w in (
    info("imex-ensemble", "0.1.0", 'watchfiles>=0.21; extra == "guest"',
         'fastapi; extra == "host"'),
    info("watchfiles", "1.3.0", "anyio>=3.0.0"),
    info("anyio", "4.16.0", "idna>=2.8", 'typing_extensions>=4.5; python_version < "3.13"',
         'exceptiongroup>=1.0.2; python_version < "3.11"', 'trio>=0.31; extra == "trio"'),
    info("idna", "3.20"),
    info("typing-extensions", "4.16.0"),
)}


def test_closure_follows_the_targets_markers_not_the_build_hosts() -> None:
    roots = ["imex-ensemble[guest]"]
    need311, missing = wh.closure(roots, WHEELS, wh.Target("linux/amd64", "3.11"))
    assert missing == []
    assert need311 == {"imex-ensemble", "watchfiles", "anyio", "idna", "typing-extensions"}
    need313, _ = wh.closure(roots, WHEELS, wh.Target("linux/arm64", "3.13"))
    assert need313 == need311 - {"typing-extensions"}  # only below 3.13


def test_closure_reports_what_no_wheel_meets() -> None:
    wheels = dict(WHEELS)
    del wheels[canonicalize_name("idna")]
    wheels[canonicalize_name("watchfiles")] = info("watchfiles", "0.20", "anyio>=3.0.0")
    _, missing = wh.closure(["imex-ensemble[guest]"], wheels, wh.Target("linux/amd64", "3.12"))
    assert sorted(str(r) for r in missing) == ["watchfiles>=0.21"]  # too old: not followed
    _, missing = wh.closure(["anyio"], wheels, wh.Target("linux/amd64", "3.12"))
    assert [str(r) for r in missing] == ["idna>=2.8"]


def test_wheel_metadata_is_read_from_the_dist_info(tmp_path: Path) -> None:
    path = tmp_path / "anyio-4.16.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr("anyio-4.16.0.dist-info/METADATA",
                    "Metadata-Version: 2.1\nName: anyio\nVersion: 4.16.0\n"
                    "Requires-Dist: idna>=2.8\nRequires-Dist: sniffio>=1.1\n\nbody\n")
        zf.writestr("anyio/__init__.py", "")
    got = wh.wheel_info(path)
    assert got == wh.WheelInfo(canonicalize_name("anyio"), path.name,
                               ("idna>=2.8", "sniffio>=1.1"))
