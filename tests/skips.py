"""Which skips a run may have: tests/allowed_skips.toml, and the check CI makes of it.

A skip turns a missing tool, a missing privilege or a missing file into a pass that
checked nothing. So under ``CI=true`` every skip and every xfail of a pytest run must
match an entry of the allowlist that is allowed in CI (``ci = true``): its test id
pattern (fnmatch) and its reason (a piece of the skip's own reason text, so another
reason for the same test is not let through). Anything else fails the run, whatever
tier it is (the hook is in tests/conftest.py). Outside CI the same skips are listed,
not failed: a developer without root gets the "needs root" skips.

Each run also writes its counts (``test-artifacts/tiers/<tier>.json``), which .ci/run
prints at the end, one line per tier; a tier CI runs more than once (the arm64 and the
trixie smoke are both ``vmtest-matrix``) names each run with ``IMEX_TIER_LABEL``, so that
one run's file never replaces another's (``<tier>-<label>.json``, tier "<tier> <label>").
"""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ALLOWLIST = ROOT / "tests" / "allowed_skips.toml"
SUMMARY_DIR = ROOT / "test-artifacts" / "tiers"


@dataclass(frozen=True)
class Allowed:
    test: str
    reason: str
    ci: bool
    why: str

    def matches(self, nodeid: str, reason: str) -> bool:
        return fnmatch.fnmatchcase(nodeid, self.test) and self.reason in reason


def load(path: Path | None = None) -> list[Allowed]:
    """The allowlist (``IMEX_ALLOWED_SKIPS`` names another one, for the policy's own tests);
    a malformed entry is an error naming it, never a silent allow."""
    if path is None:
        path = Path(os.environ.get("IMEX_ALLOWED_SKIPS", ALLOWLIST))
    doc = tomllib.loads(path.read_text(encoding="utf-8"))
    out = []
    for i, entry in enumerate(doc.get("skip", [])):
        missing = [k for k in ("test", "reason", "why") if not isinstance(entry.get(k), str)]
        if missing or not isinstance(entry.get("ci", False), bool):
            raise ValueError(f"{path.name}: skip entry {i + 1} needs test, reason and why "
                             f"(strings) and ci (true or false); missing or wrong: "
                             f"{missing or ['ci']}")
        out.append(Allowed(entry["test"], entry["reason"], entry.get("ci", False),
                           entry["why"]))
    return out


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() == "true"


def unexpected(skips: list[tuple[str, str]], allowed: list[Allowed],
               ci: bool) -> list[tuple[str, str]]:
    """The (nodeid, reason) of every skip no entry allows (in CI: no ``ci = true`` one)."""
    usable = [a for a in allowed if a.ci or not ci]
    return [(nodeid, reason) for nodeid, reason in skips
            if not any(a.matches(nodeid, reason) for a in usable)]


def write_summary(tier: str, counts: dict[str, int], skips: list[tuple[str, str]],
                  refused: list[tuple[str, str]], failures: list[tuple[str, str]]) -> Path:
    out = Path(os.environ.get("IMEX_TIER_SUMMARY_DIR", SUMMARY_DIR))
    out.mkdir(parents=True, exist_ok=True)
    label = os.environ.get("IMEX_TIER_LABEL", "")
    path = out / (f"{tier}-{label}.json" if label else f"{tier}.json")
    path.write_text(json.dumps({
        "tier": f"{tier} {label}" if label else tier, "counts": counts,
        "skips": [{"test": n, "reason": r} for n, r in skips],
        "refused": [{"test": n, "reason": r} for n, r in refused],
        "failures": [{"test": n, "when": w} for n, w in failures],
    }, indent=1) + "\n", encoding="utf-8")
    return path


# -- the hooks (tests/conftest.py imports them; `-p tests.skips` loads them alone) --------

_REFUSED_KEY = pytest.StashKey[list[tuple[str, str]]]()


def _skip_reason(report: pytest.TestReport) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Under CI=true, fail the run on any skip or xfail the allowlist does not allow."""
    if hasattr(session.config, "workerinput"):
        return  # an xdist worker: the controller has every report
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None or getattr(session.config.option, "collectonly", False):
        return
    stats = reporter.stats
    skips = [(r.nodeid, _skip_reason(r)) for key in ("skipped", "xfailed", "xpassed")
             for r in stats.get(key, []) if isinstance(r, pytest.TestReport)]
    refused = unexpected(skips, load(), in_ci())
    session.config.stash[_REFUSED_KEY] = refused
    counts = {key: len([r for r in stats.get(key, []) if isinstance(r, pytest.TestReport)])
              for key in ("passed", "failed", "skipped", "xfailed", "xpassed", "error")}
    if not getattr(session.config.option, "numprocesses", None):
        counts["deselected"] = len(stats.get("deselected", []))  # xdist's workers deselect
    # which tests failed, and in which phase (an error is a setup or teardown failure):
    # CI's log may be cut, and its last lines must still name them
    failures: list[tuple[str, str]] = [
        (r.nodeid, str(r.when)) for key in ("failed", "error")
        for r in stats.get(key, []) if isinstance(r, pytest.TestReport)]
    tier = os.environ.get("IMEX_TIER")
    if tier:  # a tier run (tests/tiers.py); a pytest run by a test, as in a chroot, writes none
        try:
            write_summary(tier, counts, skips, refused, failures)
        except OSError as e:  # a read-only tree loses the summary, never the verdict
            reporter.write_line(f"tier summary not written: {e}", yellow=True)
    if refused and in_ci() and session.exitstatus in (0, 5):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    refused = terminalreporter.config.stash.get(_REFUSED_KEY, [])
    if not refused:
        return
    verdict = "not allowed in CI" if in_ci() else "not in tests/allowed_skips.toml"
    terminalreporter.section(f"skips {verdict}", red=in_ci(), bold=True)
    for nodeid, reason in refused:
        terminalreporter.line(f"{nodeid}: {reason}")
