"""Logging setup: readable lines for people, one JSON object per line for machines.

Call sites log with ``extra={"ensemble": "ns/name", ...}``; both formats show
those fields, so a problem can be grepped by ensemble or VMI either way. At INFO a
line is an event a person would want (a member joined, left or moved; a slice was
written; leadership changed; a refused report; an error); per-request and periodic
lines are DEBUG, so an idle leader writes no INFO line at all.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import TextIO

from imex_shared.jsonlog import JsonFormatter, log_extras


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        extras = "".join(f" {k}={v}" for k, v in log_extras(record).items())
        line = f"{stamp}Z {record.levelname:<7} {record.name}: {record.getMessage()}{extras}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def setup_logging(level: str, json_logs: bool, stream: TextIO | None = None) -> logging.Handler:
    """Install one handler on the root logger; returns it (tests remove it)."""
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if json_logs else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        if getattr(old, "_imex_host_agent", False):
            root.removeHandler(old)
    handler._imex_host_agent = True  # type: ignore[attr-defined]
    root.addHandler(handler)
    root.setLevel(level.upper())
    # the HTTP client logs every API request at INFO (an idle leader's Lease GET and PUT
    # every 2 s): that is DEBUG here, so INFO holds only events a person wants
    quiet = logging.DEBUG if root.level <= logging.DEBUG else logging.WARNING
    for name in ("httpx2", "httpx", "httpcore"):
        logging.getLogger(name).setLevel(quiet)
    return handler
