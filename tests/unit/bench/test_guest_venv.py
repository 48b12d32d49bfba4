"""The bench's guest-only venv: its requirement list and cache naming (pure parts)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.guest_venv import guest_requirements, venv_dir


def test_requirements_are_the_guest_extra_and_nothing_of_the_host(tmp_path: Path) -> None:
    reqs = guest_requirements()
    names = {r.split(">")[0].split("=")[0].split("[")[0].strip().lower() for r in reqs}
    assert {"dnspython", "pyroute2", "watchfiles", "tenacity"} <= names
    assert not names & {"fastapi", "uvicorn", "lightkube", "httpx", "prometheus-client"}


def test_bad_pyproject_is_named(tmp_path: Path) -> None:
    p = tmp_path / "pyproject.toml"
    p.write_text('[project]\nname = "x"\n[project.optional-dependencies]\nguest = []\n')
    with pytest.raises(ValueError, match="guest is empty"):
        guest_requirements(p)


def test_venv_name_follows_the_requirement_set(tmp_path: Path) -> None:
    a = venv_dir(["dnspython>=2.6", "tenacity>=8.2"], tmp_path)
    assert a == venv_dir(["tenacity>=8.2", "dnspython>=2.6"], tmp_path)  # order-free
    assert a != venv_dir(["dnspython>=2.7", "tenacity>=8.2"], tmp_path)
    assert a.parent == tmp_path
