"""tests/machine_speed.py: the line .ci/run prints beside its stage times."""

from __future__ import annotations

import re
import subprocess
import sys

from tests.machine_speed import describe, loop_seconds


def test_the_line_gives_the_loop_time_and_the_load() -> None:
    assert describe(1.234, (0.5, 1.25, 2.0), steps=1000) == (
        "machine speed: 1.23 s for 1,000 Python additions on one core (best of 3, lower is "
        "faster); load average 0.50 1.25 2.00")


def test_a_timing_is_a_positive_number_of_seconds() -> None:
    assert 0 < loop_seconds(steps=10_000, runs=2) < 60


def test_ci_gets_one_line_with_its_prefix() -> None:
    out = subprocess.run([sys.executable, "-m", "tests.machine_speed", "ci: "],
                         capture_output=True, text=True, check=True, timeout=120).stdout
    assert re.fullmatch(r"ci: machine speed: \d+\.\d\d s for 5,000,000 Python additions on "
                        r"one core \(best of 3, lower is faster\); load average "
                        r"\d+\.\d\d \d+\.\d\d \d+\.\d\d\n", out), out
