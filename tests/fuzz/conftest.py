"""Writes and prints the examples each fuzzed surface ran (tests/fuzz/budget.py)."""

from __future__ import annotations

import pytest

from tests.fuzz.budget import COUNTS, write_counts


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    path = write_counts()
    if path is None:
        return
    terminalreporter.write_line(
        "fuzz examples: " + ", ".join(f"{k} {v}" for k, v in sorted(COUNTS.items()))
        + f" ({path})")
