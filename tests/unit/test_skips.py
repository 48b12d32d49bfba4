"""The skip policy (tests/skips.py): in CI a skip the allowlist does not allow fails the run.

The end-to-end checks run a real pytest in a subprocess on a scratch test file, with
the policy loaded as a plugin (``-p tests.skips``) and an allowlist of their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import skips

REPO = Path(__file__).resolve().parents[2]

SCRATCH = '''
import pytest

def test_runs():
    assert True is not False

def test_skips_without_a_tool():
    pytest.skip("frobnicate is not installed")

@pytest.mark.xfail(reason="known to fail", strict=False)
def test_xfails():
    assert 1 == 2
'''


def run(tmp_path: Path, allowlist: str, ci: bool,
        scratch: str = SCRATCH) -> tuple[int, str, dict[str, object]]:
    (tmp_path / "test_scratch.py").write_text(scratch)
    allowed = tmp_path / "allowed.toml"
    allowed.write_text(allowlist)
    env = {**os.environ, "PYTHONPATH": str(REPO), "IMEX_TIER": "scratch",
           "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1",  # no hypothesis, schemathesis: seconds each
           "IMEX_ALLOWED_SKIPS": str(allowed), "IMEX_TIER_SUMMARY_DIR": str(tmp_path / "out")}
    env.pop("CI", None)
    env.pop("IMEX_TIER_LABEL", None)  # the summary is read from scratch.json below
    if ci:
        env["CI"] = "true"
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "-p", "tests.skips", "-o", "addopts=", "--rootdir", str(tmp_path),
                           str(tmp_path / "test_scratch.py")],
                          capture_output=True, text=True, env=env, cwd=tmp_path, timeout=120)
    summary = json.loads((tmp_path / "out" / "scratch.json").read_text())
    return proc.returncode, proc.stdout, summary


ALLOW_BOTH = '''
[[skip]]
test = "*test_scratch.py::test_skips_without_a_tool"
reason = "frobnicate is not installed"
ci = true
why = "a test of the policy"

[[skip]]
test = "*test_scratch.py::test_xfails"
reason = "known to fail"
ci = true
why = "a test of the policy"
'''


def test_in_ci_a_skip_nobody_allowed_fails_the_run(tmp_path: Path) -> None:
    code, out, summary = run(tmp_path, "", ci=True)
    assert code == 1, out
    assert "skips not allowed in CI" in out
    assert "test_skips_without_a_tool: frobnicate is not installed" in out
    assert "test_xfails: xfail: known to fail" in out
    assert summary["counts"] == {"passed": 1, "failed": 0, "skipped": 1, "xfailed": 1,
                                 "xpassed": 0, "error": 0, "deselected": 0}


FAILING = '''
import pytest

@pytest.fixture
def leaks():
    yield
    raise RuntimeError("a namespace was left behind")

def test_passes_but_its_teardown_fails(leaks):
    assert True is not False

def test_fails():
    assert 1 == 2
'''


def test_the_summary_names_each_failure_and_its_phase(tmp_path: Path) -> None:
    """CI prints the summary's failures at the end of its log: an error in a teardown is
    named there, not only counted."""
    code, out, summary = run(tmp_path, "", ci=True, scratch=FAILING)
    assert code == 1, out
    assert sorted((f["test"].split("::")[1], f["when"])
                  for f in summary["failures"]) == [  # type: ignore[attr-defined]
        ("test_fails", "call"), ("test_passes_but_its_teardown_fails", "teardown")]


def test_two_runs_of_one_tier_with_labels_keep_both_counts(tmp_path: Path) -> None:
    """CI runs vmtest-matrix twice at once (the arm64 and the trixie smoke): each run's
    counts land in a file of its own, named by its label."""
    out = tmp_path / "out"
    for label, counts in (("arm64", {"passed": 1}), ("trixie", {"passed": 2})):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("IMEX_TIER_SUMMARY_DIR", str(out))
            mp.setenv("IMEX_TIER_LABEL", label)
            skips.write_summary("vmtest-matrix", counts, [], [], [])
    docs = {p.name: json.loads(p.read_text()) for p in out.glob("*.json")}
    assert {name: (d["tier"], d["counts"]) for name, d in docs.items()} == {
        "vmtest-matrix-arm64.json": ("vmtest-matrix arm64", {"passed": 1}),
        "vmtest-matrix-trixie.json": ("vmtest-matrix trixie", {"passed": 2})}


def test_in_ci_allowed_skips_pass_and_outside_ci_nothing_fails(tmp_path: Path) -> None:
    code, out, summary = run(tmp_path, ALLOW_BOTH, ci=True)
    assert code == 0, out
    assert summary["refused"] == []
    code, out, _ = run(tmp_path, "", ci=False)
    assert code == 0, out
    assert "not in tests/allowed_skips.toml" in out  # listed, not failed


def test_an_entry_for_another_reason_or_not_for_ci_does_not_allow(tmp_path: Path) -> None:
    other_reason = ALLOW_BOTH.replace('reason = "frobnicate is not installed"',
                                      'reason = "needs root"')
    code, out, _ = run(tmp_path, other_reason, ci=True)
    assert code == 1 and "test_skips_without_a_tool" in out
    not_for_ci = ALLOW_BOTH.replace("ci = true", "ci = false")
    code, out, _ = run(tmp_path, not_for_ci, ci=True)
    assert code == 1 and "test_xfails" in out


def test_the_checked_in_allowlist_parses_and_never_allows_not_root_in_ci() -> None:
    allowed = skips.load()
    assert allowed, "the allowlist is empty: nothing to document"
    for entry in allowed:
        assert entry.why.strip(), entry
        if "root" in entry.reason:
            assert not entry.ci, entry


def test_a_malformed_entry_is_an_error_naming_it(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[[skip]]\ntest = "x"\nreason = "y"\n')
    with pytest.raises(ValueError, match="skip entry 1 needs test, reason and why"):
        skips.load(bad)
