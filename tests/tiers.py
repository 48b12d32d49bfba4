"""The test tiers: one definition of what each one selects, for the Makefile and CI alike.

    python -m tests.tiers run TIER [PYTEST ARGS...]   # what `make test`, `make realk8s`, ... run
    python -m tests.tiers args TIER                   # the pytest arguments it would pass
    python -m tests.tiers list                        # every tier, its make target and markers

A tier is a marker expression over some paths. ``run`` execs pytest with them and with
``IMEX_TIER`` set, so the suite's conftest can name the tier in its summary and check
its skips against tests/allowed_skips.toml. tests/test_tiers.py checks that every test
in the tree is selected by at least one tier.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Tier:
    """What one tier runs: ``markers`` (a pytest ``-m`` expression) over ``paths``."""

    target: str
    markers: str
    paths: tuple[str, ...]
    ignore: tuple[str, ...] = ()
    #: pytest options of this tier (no cache: these tiers run from CI's fresh clone too)
    options: tuple[str, ...] = field(default=("-q",))
    #: does .ci/run run it (a make target otherwise, named in the README)
    in_ci: bool = True
    #: environment defaults of this tier (the caller's environment wins)
    env: tuple[tuple[str, str], ...] = ()

    def args(self) -> list[str]:
        out = [*self.options, "-m", self.markers]
        for path in self.ignore:
            out += ["--ignore", path]
        return [*out, *self.paths]


#: Markers only the other tiers select; `make test` is everything else.
_ELSEWHERE = ("vm", "chroot", "realk8s", "realnode", "bench", "soak")

TIERS: dict[str, Tier] = {
    # the 30 slowest tests and fixtures printed at the end: where CI's time goes; two
    # xdist workers, every root and e2e test on one of them (tests/parallel.py)
    "test": Tier("make test", " and ".join(f"not {m}" for m in _ELSEWHERE), ("tests",),
                 options=("-q", "--durations=30", "-n", "2")),
    "realk8s": Tier("make realk8s", "realk8s", ("tests/realk8s",),
                    options=("-q", "--durations=30")),
    # issue 29: the docs' shell blocks on the realk8s control plane (tests/docs/blocks.py)
    "docs-test": Tier("make docs-test", "realk8s", ("tests/docs",)),
    "vmtest": Tier("make vmtest", "vm", ("tests/vm",), ignore=("tests/vm/test_matrix.py",),
                   options=("-q", "-p", "no:cacheprovider")),
    "vmtest-matrix": Tier("make vmtest-matrix", "vm", ("tests/vm/test_matrix.py",),
                          options=("-q", "-p", "no:cacheprovider")),
    "chroottest": Tier("make chroottest", "chroot", ("tests/chroot",),
                       options=("-q", "-p", "no:cacheprovider")),
    # issue 25: the base Deployment's pods on a real kubelet; builds on demand, not in CI
    "realnode": Tier("make realnode", "realnode", ("tests/realnode",),
                     options=("-q", "-s", "-p", "no:cacheprovider"), in_ci=False),
    # issue 30: tests/fuzz at 500 examples per property and per API operation; CI runs
    # the same files at 50 (the default) inside the test tier
    "fuzz": Tier("make fuzz", " and ".join(f"not {m}" for m in _ELSEWHERE), ("tests/fuzz",),
                 options=("-q", "-p", "no:cacheprovider"), in_ci=False,
                 env=(("IMEX_FUZZ_EXAMPLES", "500"),)),
    # issue 30: the CI-size soak (6 VMs, the commit's seed and tests/soak/seeds.txt, about
    # 3 minutes), a required stage of .ci/run
    "soak-ci": Tier("make soak-ci", "soak", ("tests/soak",),
                    options=("-q", "-s", "-p", "no:cacheprovider")),
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in ("run", "args", "list"):
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "list":
        for name, tier in TIERS.items():
            print(f"{name:<14} {tier.target:<22} -m '{tier.markers}' {' '.join(tier.paths)}")
        return 0
    if len(argv) < 2 or argv[1] not in TIERS:
        print(f"tests.tiers: name a tier: {', '.join(TIERS)}", file=sys.stderr)
        return 2
    name, tier = argv[1], TIERS[argv[1]]
    args = tier.args()
    if argv[0] == "args":
        print(" ".join(args))
        return 0
    import subprocess

    env = {**dict(tier.env), **os.environ, "IMEX_TIER": name}
    code = subprocess.run([sys.executable, "-m", "pytest", *args, *argv[2:]], env=env,
                          check=False).returncode
    if code == 5:  # make reports any failure as 2: say what this one was
        print(f"tests.tiers: the {name} tier collected no tests (pytest exit 5): "
              f"{' '.join(args)}", file=sys.stderr)
    return code


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))


# -- a plugin for tests/test_tiers.py: `-p tests.tiers` with IMEX_COLLECT_DUMP=FILE ------


def pytest_collection_finish(session: object) -> None:
    """Write every collected test's id, file and markers to ``IMEX_COLLECT_DUMP``."""
    out = os.environ.get("IMEX_COLLECT_DUMP")
    if not out:
        return
    import json

    items = [{"id": item.nodeid, "path": item.nodeid.split("::", 1)[0],
              "markers": sorted({m.name for m in item.iter_markers()})}
             for item in getattr(session, "items", [])]
    with open(out, "w", encoding="utf-8") as f:
        json.dump(items, f)
