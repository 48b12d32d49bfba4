"""``make test`` on two pytest-xdist workers: every root or e2e test on one worker.

Root and e2e tests share the host: network namespaces, bind mounts, the reserved
ports, the sandbox's address ranges, and the order of a module's tests (the e2e
modules tell one story on one module-scoped sandbox). So they run one after the other
on one worker, in collection order, as they do without xdist. The other worker runs the
rest of the tier beside them, a test file at a time, so that module fixtures are set up
once and a file's tests keep their order.

xdist's own ``--dist loadgroup`` cannot do this under pytest 9: it renames
``item._nodeid``, which pytest 9 no longer reads, and every group is silently lost. The
workers know the markers and the controller schedules by node id, so each worker writes
the ids of its system tests to the file ``IMEX_XDIST_SYSTEM`` names (the controller
names it before it starts them) and the controller's scheduler reads it once every
worker has collected.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

import pytest

ENV = "IMEX_XDIST_SYSTEM"
SYSTEM = "system"


def is_system(item: pytest.Item) -> bool:
    return "root" in item.keywords or "e2e" in item.keywords


def scope_of(nodeid: str, system: frozenset[str]) -> str:
    """The unit of work a test belongs to: the one system group, or its test file."""
    return SYSTEM if nodeid in system else nodeid.split("::", 1)[0]


def _is_controller(config: pytest.Config) -> bool:
    return bool(getattr(config.option, "numprocesses", None)) and \
        not hasattr(config, "workerinput")


def pytest_configure(config: pytest.Config) -> None:
    if _is_controller(config):
        fd, path = tempfile.mkstemp(prefix="imex-xdist-system-", suffix=".json")
        os.close(fd)
        os.environ[ENV] = path  # the workers inherit it


def pytest_unconfigure(config: pytest.Config) -> None:
    if _is_controller(config):
        path = os.environ.pop(ENV, None)
        if path:
            Path(path).unlink(missing_ok=True)


def write_system_ids(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker: the node ids of the system tests, for the controller."""
    path = os.environ.get(ENV)
    if not path or not hasattr(config, "workerinput"):
        return
    ids = [item.nodeid for item in items if is_system(item)]
    tmp = Path(f"{path}.{config.workerinput['workerid']}")
    tmp.write_text(json.dumps(ids), encoding="utf-8")
    tmp.replace(path)  # both workers write the same list: either one whole


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    class SystemOnOneWorker(LoadScopeScheduling):  # type: ignore[misc]
        _system: frozenset[str] | None = None

        def _split_scope(self, nodeid: str) -> str:
            if self._system is None:
                path = os.environ.get(ENV)
                text = Path(path).read_text(encoding="utf-8") if path else ""
                self._system = frozenset(json.loads(text) if text else ())
            return scope_of(nodeid, self._system)

    return SystemOnOneWorker(config, log)
