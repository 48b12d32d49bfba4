"""Suite-wide rules: root-only tests skip (with the reason) when not root; under CI=true
no skip passes that tests/allowed_skips.toml does not allow (tests/skips.py); the host's
reserved ports are as the suite found them."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# make test's two xdist workers: root and e2e tests on one of them (tests/parallel.py)
from tests.parallel import (  # noqa: F401
    pytest_configure,
    pytest_unconfigure,
    pytest_xdist_make_scheduler,
    write_system_ids,
)

# the skip policy's hooks (tests/skips.py), for every tier
from tests.skips import pytest_sessionfinish, pytest_terminal_summary  # noqa: F401

RESERVED_PORTS = Path("/proc/sys/net/ipv4/ip_local_reserved_ports")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    write_system_ids(config, items)
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: creates network namespaces and bind mounts")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def machine_kubectl() -> str:
    """The kubectl on PATH, at or above tests/kubectl.py's floor (make test's tier)."""
    from tests.kubectl import machine_kubectl as find

    return find()


@pytest.fixture(scope="session", autouse=True)
def _host_reserved_ports_restored() -> Iterator[None]:
    """A guest agent run as root outside a namespace reserves its IMEX port in the host's
    own ``ip_local_reserved_ports`` (guest_agent/net/portreserve.py); put it back after."""
    try:
        before = RESERVED_PORTS.read_text()
    except OSError:
        before = None
    yield
    if before is None or os.geteuid() != 0:
        return
    try:
        if RESERVED_PORTS.read_text() != before:
            RESERVED_PORTS.write_text(before if before.strip() else "\n")
    except OSError:
        pass

