"""Suite-wide rules: root-only tests skip (with the reason) when not root."""

from __future__ import annotations

import os

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason="needs root: creates network namespaces and bind mounts")
    for item in items:
        if "root" in item.keywords:
            item.add_marker(skip)
