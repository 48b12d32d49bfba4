"""Every test in the tree is selected by a tier that CI runs or that a make target names.

A test no tier selects never runs anywhere: it was how a parity check against the real
kube-apiserver sat unrun in tests/integration for a round. This collects the whole tree
once (markers and files, no marker filter) and evaluates each tier of tests/tiers.py
exactly as pytest would (its own ``-m`` expression parser), so a new test file that
falls between the tiers fails here, naming it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from _pytest.mark.expression import Expression

from tests.tiers import TIERS, Tier

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def collected(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    dump = tmp_path_factory.mktemp("tiers") / "items.json"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-p", "tests.tiers", "-o", "addopts=--import-mode=importlib", "tests"],
        cwd=REPO, capture_output=True, text=True, timeout=600,
        env={**os.environ, "IMEX_COLLECT_DUMP": str(dump)})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    items: list[dict[str, Any]] = json.loads(dump.read_text())
    return items


def selects(tier: Tier, item: dict[str, Any]) -> bool:
    path = item["path"]
    if not any(path == p or path.startswith(p.rstrip("/") + "/") for p in tier.paths):
        return False
    if any(path == i or path.startswith(i.rstrip("/") + "/") for i in tier.ignore):
        return False
    markers = set(item["markers"])
    return Expression.compile(tier.markers).evaluate(lambda name: name in markers)


def test_every_collected_test_is_in_a_tier(collected: list[dict[str, Any]]) -> None:
    assert len(collected) > 1000  # the whole tree, not an empty collection
    orphans = [i["id"] for i in collected if not any(selects(t, i) for t in TIERS.values())]
    assert orphans == []


def test_every_test_file_is_collected(collected: list[dict[str, Any]]) -> None:
    """A test file pytest does not collect (a name, a ``collect_ignore``) is in no tier."""
    files = {str(p.relative_to(REPO)) for p in (REPO / "tests").rglob("test_*.py")}
    assert files - {i["path"] for i in collected} == set()


def test_the_tiers_cover_what_their_make_targets_say() -> None:
    """The selections the Makefile and CI share are the ones named here."""
    makefile = (REPO / "Makefile").read_text()
    for name, tier in TIERS.items():
        assert f"-m tests.tiers run {name}" in makefile, name
        assert tier.target == f"make {name}"


def test_the_realk8s_tier_holds_the_parity_checks(collected: list[dict[str, Any]]) -> None:
    """The double-against-real-apiserver parity tests run where the apiserver is."""
    parity = [i for i in collected if "parity" in i["path"]]
    assert parity
    assert all(selects(TIERS["realk8s"], i) for i in parity), [i["id"] for i in parity]
