"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(params=["python", "c"])
def imex_impl(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """The IMEX daemon stand-in this test's processes start (``bin/nvidia-imex`` reads
    ``IMEX_STANDIN_IMPL``): a test that uses it runs against both, the Python reference
    (imex_standin.py, which the tests' sandboxes run) and its native copy
    (imex_standin.c, which the benchmarks run). Parity, so the benchmarks' cheaper
    daemon cannot be one that does less."""
    monkeypatch.setenv("IMEX_STANDIN_IMPL", str(request.param))
    return str(request.param)
