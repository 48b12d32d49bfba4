"""``--json`` log lines, shared by both agents so a machine parses one format.

One JSON object per line: ``time`` (RFC 3339, UTC, milliseconds: what log
pipelines parse), ``ts`` (the same instant as epoch seconds: kept beside ``time`` for
this release so existing pipelines keep working; CHANGELOG.md says when it goes),
``level``, ``logger``, ``msg``, any ``extra`` fields a call site passed (``ensemble``,
``slot``, ``generation``, ...; lists and dicts stay JSON, anything else JSON cannot
carry becomes its ``str``), and ``exc`` with the traceback when there is one.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any, Final

#: attributes every LogRecord has; anything else on a record came from ``extra``
_STANDARD: Final = frozenset(vars(logging.makeLogRecord({})).keys()) | {"message", "asctime"}


def log_extras(record: logging.LogRecord) -> dict[str, Any]:
    """The fields a call site added with ``extra={...}``, in the order it gave them."""
    return {
        k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")
    }


def rfc3339_ms(epoch: float) -> str:
    """``2026-12-02T18:41:20.123Z``: UTC, milliseconds (rounded as ``ts`` is), ``Z``."""
    ms = round(epoch * 1000)
    moment = dt.datetime.fromtimestamp(ms // 1000, tz=dt.UTC)
    return f"{moment:%Y-%m-%dT%H:%M:%S}.{ms % 1000:03d}Z"


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": rfc3339_ms(record.created),
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(log_extras(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)
