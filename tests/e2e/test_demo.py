"""`make demo` as a reader runs it: the ImexEnsemble path, end to end (issue 29 part 5).

The demo is run as its own process (`python -m tests.sandbox demo`, what the Makefile
runs) with 3 VMs, and its output is read as a person would: the IMEX column's legend,
`kubectl get imexens` after each step with the CRD's printer columns (through the API
double's Table form) and the numbers each step leaves, the Events of the crash and of
the restore, and exactly one verdict line, last. Nothing may be left behind.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.sandbox.demo_views import IMEX_LEGEND
from tests.sandbox.netns import list_netns

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

REPO = Path(__file__).resolve().parents[2]
HEADER = ["NAME", "MEMBERS", "IMEX-READY", "READY", "DOMAIN", "AGE"]


def _tables(out: str) -> dict[str, tuple[list[str], list[str]]]:
    """Each `kubectl get imexens` the demo printed: {step: (the row, the Event lines)}."""
    found = {}
    for m in re.finditer(r"\$ kubectl get imexens -n demo +# (?P<step>[^\n]+)\n"
                         r" +(?P<head>NAME[^\n]*)\n +(?P<row>[^\n]+)\n"
                         r" +\$ kubectl describe imexens gb200 -n demo[^\n]*\n"
                         r"(?P<events>(?: {4}[^\n]+\n)+)", out):
        assert m["head"].split() == HEADER, m["head"]
        found[m["step"]] = (m["row"].split(), m["events"].splitlines()[1:])
    return found


def test_demo_shows_the_cr_path_and_one_verdict() -> None:
    before = {n for n in list_netns() if n.startswith("demo-")}
    proc = subprocess.run([sys.executable, "-m", "tests.sandbox", "demo", "--vms", "3",
                           "--timeout", "90"], cwd=REPO, capture_output=True, text=True,
                          timeout=600, check=False)
    out = proc.stdout
    assert proc.returncode == 0, out[-4000:] + proc.stderr[-3000:]
    lines = out.rstrip("\n").splitlines()
    assert [ln for ln in lines if ln.startswith("VERDICT:")] == [lines[-1]]
    assert lines[-1].startswith("VERDICT: PASS - every step converged")
    assert f"  {IMEX_LEGEND}" in lines
    assert "step 1/3 boot: ImexEnsemble demo/gb200" in out

    tables = _tables(out)
    assert list(tables) == ["after boot", "after the crash", "after the restore"]
    assert tables["after boot"][0][:5] == ["gb200", "3/3", "3", "True", "UP"]
    assert tables["after the crash"][0][:4] == ["gb200", "2/3", "2", "False"]
    assert tables["after the restore"][0][:5] == ["gb200", "3/3", "3", "True", "UP"]

    def reasons(step: str) -> list[tuple[str, str]]:
        return [tuple(ln.split()[:2]) for ln in tables[step][1]]  # type: ignore[misc]

    assert ("Normal", "ServiceCreated") in reasons("after boot")
    assert ("Warning", "MemberLeft") in reasons("after the crash")
    assert ("Warning", "ReadyLost") in reasons("after the crash")
    assert ("Normal", "MemberJoined") in reasons("after the restore")
    assert ("Normal", "ReadyRegained") in reasons("after the restore")
    crash = next(ln for ln in tables["after the crash"][1] if "MemberLeft" in ln)
    assert re.search(r"member 2 \(gb200-2\) left \(was at [\d.]+; VMI Failed\)", crash), crash

    assert {n for n in list_netns() if n.startswith("demo-")} == before


def test_make_demo_passes_demo_args() -> None:
    """The README's `make demo DEMO_ARGS="--keep --vms 6"` reaches the demo's parser."""
    proc = subprocess.run(["make", "-n", "demo", "DEMO_ARGS=--keep --vms 6"], cwd=REPO,
                          capture_output=True, text=True, timeout=60, check=True)
    (run,) = [ln for ln in proc.stdout.splitlines() if "tests.sandbox demo" in ln]
    assert run.endswith("-m tests.sandbox demo --keep --vms 6"), run
    assert '\nmake demo DEMO_ARGS="--keep --vms 6"' in (REPO / "README.md").read_text()
