"""Logging setup: readable lines for people, one JSON object per line for machines.

Call sites log with ``extra={"ensemble": "ns/name", ...}``; both formats show
those fields, so a problem can be grepped by ensemble or VMI either way.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Final, TextIO

_STANDARD: Final = frozenset(
    logging.LogRecord("", 0, "", 0, "", None, None).__dict__.keys() | {"message", "asctime"}
)


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {
        k: v for k, v in record.__dict__.items() if k not in _STANDARD and not k.startswith("_")
    }


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for key, value in _extras(record).items():
            doc[key] = value if isinstance(value, str | int | float | bool | None) else str(value)
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, sort_keys=False)


class TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
        extras = "".join(f" {k}={v}" for k, v in _extras(record).items())
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
    return handler
