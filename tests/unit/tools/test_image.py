"""``make image``'s decisions without podman: names, cache keys, limits, the Containerfile.

The build itself (podman, mmdebstrap, the run against the real apiserver) is
tests/realk8s/test_image.py.
"""

from __future__ import annotations

import re
import resource
from pathlib import Path

import pytest

from tools import image, image_base
from tools.image_base import ImageError

REPO = Path(__file__).resolve().parents[3]


def test_the_native_platform_gets_the_plain_tag_a_foreign_one_its_arch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(image.platform_mod, "machine", lambda: "x86_64")
    assert image.native_platform() == "linux/amd64"
    assert image.image_ref("linux/amd64", "1.2.3") == "localhost/imex-host-agent:1.2.3"
    assert image.image_ref("linux/arm64", "1.2.3") == "localhost/imex-host-agent:1.2.3-arm64"
    with pytest.raises(ImageError, match="PLATFORM='linux/arm': expected one of"):
        image.check_platform("linux/arm")


def test_the_version_is_pyprojects() -> None:
    text = (REPO / "pyproject.toml").read_text()
    assert re.search(rf'^version = "{re.escape(image.project_version())}"$', text, re.M)


def test_the_base_pins_its_suite_and_its_key_follows_what_goes_into_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("IMEX_IMAGE_MIRROR", raising=False)
    key = image_base.base_key("amd64")
    assert key == image_base.base_key("amd64")  # stable
    assert len({key, image_base.base_key("arm64"), image_base.base_key("amd64", "trixie"),
                image_base.base_key("amd64", packages=("python3",))}) == 4
    monkeypatch.setenv("IMEX_IMAGE_MIRROR", "http://mirror.invalid/debian")
    assert image_base.base_key("amd64") != key
    argv = image_base.mmdebstrap_argv("arm64", Path("/x/rootfs.tar"))
    assert argv[-3:] == ["bookworm", "/x/rootfs.tar", "http://mirror.invalid/debian"]
    assert "--variant=essential" in argv and "--arch=arm64" in argv
    assert "--include=python3,python3-venv,libstdc++6" in argv
    assert image_base.SUITE_PYTHON[image_base.SUITE] == "3.11"


def test_ulimits_stay_within_this_process_hard_limits() -> None:
    flags = image_base.ulimits()
    values = dict(f.split("=") for f in flags[1::2])
    for name, res in (("nofile", resource.RLIMIT_NOFILE), ("nproc", resource.RLIMIT_NPROC)):
        soft, hard = values[name].split(":")
        assert soft == hard
        limit = resource.getrlimit(res)[1]
        assert limit == resource.RLIM_INFINITY or int(hard) <= limit
    assert int(values["nproc"].split(":")[0]) <= image_base.NPROC_CAP


def test_the_dependency_cache_key_follows_constraints(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    key = image.deps_key("linux-amd64-py3.11")
    assert key != image.deps_key("linux-arm64-py3.11")
    pinned = tmp_path / "constraints.txt"
    pinned.write_text(image.CONSTRAINTS.read_text() + "extra-pin==1\n")
    monkeypatch.setattr(image, "CONSTRAINTS", pinned)
    assert image.deps_key("linux-amd64-py3.11") != key


def test_the_containerfile_builds_from_the_wheelhouse_alone() -> None:
    """Nothing of the building machine but the wheelhouse reaches a layer (no pip
    configuration, no CA, no sources), and pip may not reach an index."""
    text = (REPO / "Containerfile").read_text()
    copies = [ln.split()[1:] for ln in text.splitlines() if ln.startswith("COPY")]
    assert copies == [["wheelhouse", "/wheelhouse"],
                      ["--from=build", "/opt/imex-host-agent", "/opt/imex-host-agent"]]
    install = text[text.index("pip\" install"):text.index("'imex-ensemble[host]'")]
    assert "--no-index" in install and "--isolated" in install
    assert "--only-binary=:all:" in install
    assert not re.search(r"index-url|trusted-host|pip\.conf|REQUESTS_CA|SSL_CERT", text)
    assert re.search(r"^USER 65532:65532$", text, re.M)
