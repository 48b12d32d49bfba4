"""tests/parallel.py: on two xdist workers, the root and e2e tests all run on one, in
order, and nothing else changes. Runs a small pytest session of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from tests.parallel import ENV, SYSTEM, scope_of

ROOT = Path(__file__).resolve().parents[1]

CONFTEST = '''
import os, json, pytest
from tests.parallel import (pytest_configure, pytest_unconfigure,
                            pytest_xdist_make_scheduler, write_system_ids)

def pytest_collection_modifyitems(config, items):
    write_system_ids(config, items)

@pytest.fixture(autouse=True)
def _where(request):
    with open(os.environ["RAN_LOG"], "a") as f:
        f.write(json.dumps([request.node.nodeid, os.environ["PYTEST_XDIST_WORKER"]]) + "\\n")
'''

MODULE = '''
import time, pytest
{mark}
@pytest.mark.parametrize("n", range(4))
def test_it(n):
    time.sleep(0.05)
'''


def test_scope_is_the_system_group_or_the_test_file() -> None:
    system = frozenset({"tests/e2e/test_a.py::test_x"})
    assert scope_of("tests/e2e/test_a.py::test_x", system) == SYSTEM
    assert scope_of("tests/unit/test_b.py::test_y[1]", system) == "tests/unit/test_b.py"
    assert scope_of("tests/unit/test_b.py::C::test_z", system) == "tests/unit/test_b.py"


def test_root_and_e2e_tests_run_on_one_worker_in_collection_order(tmp_path: Path) -> None:
    tree = tmp_path / "suite"
    (tree / "e2e").mkdir(parents=True)
    (tree / "conftest.py").write_text(CONFTEST)
    (tree / "e2e" / "test_e2e_story.py").write_text(MODULE.format(mark=""))
    (tree / "test_root_one.py").write_text(MODULE.format(mark="pytestmark = pytest.mark.root"))
    for name in ("test_plain_a.py", "test_plain_b.py", "test_plain_c.py"):
        (tree / name).write_text(MODULE.format(mark=""))
    (tree / "pytest.ini").write_text("[pytest]\nmarkers =\n    root: needs root\n")
    log = tmp_path / "ran.jsonl"
    env = {**os.environ, "RAN_LOG": str(log), "PYTHONPATH": str(ROOT)}
    env.pop(ENV, None)
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-n", "2", "-rA", str(tree)], cwd=tree, env=env,
                         capture_output=True, text=True, timeout=120, check=False)
    assert run.returncode == 0, run.stdout + run.stderr
    ran = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(ran) == 20
    system = [(nodeid, worker) for nodeid, worker in ran
              if "e2e/" in nodeid or "root_one" in nodeid]
    assert len(system) == 8
    assert len({worker for _, worker in system}) == 1, system  # one worker
    ids = [nodeid for nodeid, _ in system]
    assert ids == sorted(ids, key=lambda i: (not i.startswith("e2e/"), i)), ids  # in order
    # each plain file stays whole on one worker (module fixtures are set up once)
    for name in ("test_plain_a.py", "test_plain_b.py", "test_plain_c.py"):
        assert len({w for nodeid, w in ran if nodeid.startswith(name)}) == 1, ran
