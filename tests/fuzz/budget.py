"""How many examples each fuzz property runs, and the count per surface it records.

``IMEX_FUZZ_EXAMPLES`` (default 50, CI's size; ``make fuzz`` sets 500). Each property
calls :func:`count` once per example it ran; the suite writes the totals per surface to
``test-artifacts/fuzz/counts.json`` and prints them (docs/reliability.md "Fuzzing").
"""

from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, settings

EXAMPLES = int(os.environ.get("IMEX_FUZZ_EXAMPLES", "50"))
COUNTS: Counter[str] = Counter()
#: the registry's answers per (where, operation, status): shows the fuzzer got past the
#: checks in front (a certificate endpoint answering only 409 would test nothing)
STATUSES: Counter[str] = Counter()
OUT = Path(__file__).parents[2] / "test-artifacts" / "fuzz" / "counts.json"

#: the settings of every fuzz property: no deadline (2 shared cores), no health check
#: that a slow generator trips, the example budget above
fuzz = settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck),
                print_blob=True)


def count(surface: str) -> None:
    COUNTS[surface] += 1


def write_counts() -> Path | None:
    if not COUNTS:
        return None
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps({"examples_per_property": EXAMPLES,
                               "examples": dict(sorted(COUNTS.items())),
                               "registry_statuses": dict(sorted(STATUSES.items()))},
                              indent=1) + "\n")
    return OUT
