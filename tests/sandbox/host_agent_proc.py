"""The real host agent as a process, with test-sized backoff (TEST STAND-IN launcher).

``python -m tests.sandbox.host_agent_proc [--tune FIELD=VALUE ...] <imex-host-agent flags>``

Why: the sandbox runs the host agent exactly as ``imex-host-agent`` does (same flag
parsing, logging and ``run``), but an API outage in a test must not cost the production
backoff ceiling (30 s) before the agent tries again. ``--tune`` overrides numeric
``HostSettings`` fields that have no flag (``backoff_initial``, ``backoff_max``,
``watch_timeout_seconds``, ``settle_seconds``, ``quiet_seconds``, ``shutdown_grace``,
``optional_kind_retry``, the registry's serving certificate lifetime and Secret re-read:
``registry_cert_lifetime``, ``tls_recheck``); everything else comes from the real CLI.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Sequence

from host_agent.cli import build_settings
from host_agent.settings import HostSettings, SettingsError

TUNABLE = ("backoff_initial", "backoff_max", "watch_timeout_seconds", "settle_seconds",
           "quiet_seconds", "shutdown_grace", "workers", "shutdown_drain", "optional_kind_retry",
           "registry_cert_lifetime", "tls_recheck")


def split_tuning(argv: Sequence[str]) -> tuple[dict[str, float | int], list[str]]:
    """(``--tune`` overrides, the remaining argv for the real CLI)."""
    tune: dict[str, float | int] = {}
    rest: list[str] = []
    it = iter(argv)
    for arg in it:
        if arg != "--tune":
            rest.append(arg)
            continue
        item = next(it, "")
        key, sep, value = item.partition("=")
        if not sep or key not in TUNABLE:
            raise SettingsError(f"--tune {item!r}: expected FIELD=VALUE with FIELD one of "
                                f"{', '.join(TUNABLE)}")
        try:
            number = float(value)
        except ValueError as e:
            raise SettingsError(f"--tune {item!r}: {value!r} is not a number") from e
        is_int = key in ("watch_timeout_seconds", "workers")
        tune[key] = int(number) if is_int else number
    return tune, rest


def main(argv: Sequence[str] | None = None) -> int:
    from host_agent.kube.client import KubeConfigError
    from host_agent.logs import setup_logging
    from host_agent.main import run

    try:
        tune, rest = split_tuning(list(sys.argv[1:] if argv is None else argv))
        settings: HostSettings = dataclasses.replace(
            build_settings(rest, os.environ), **tune)  # type: ignore[arg-type]
    except SettingsError as e:
        print(f"host_agent_proc: {e}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.json_logs)
    try:
        return run(settings)
    except KubeConfigError as e:
        print(f"host_agent_proc: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
