"""The ``vm-matrix:`` lines of this run, printed again together at its end (conftest)."""

from __future__ import annotations

MATRIX_LINES: list[str] = []
