"""``--json`` log lines, shared by both agents so a machine parses one format.

One JSON object per line: ``ts``, ``level``, ``logger``, ``msg``, any ``extra``
fields a call site passed (lists and dicts stay JSON; anything else JSON cannot
carry becomes its ``str``), and ``exc`` with the traceback when there is one.
"""

from __future__ import annotations

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


class JsonFormatter(logging.Formatter):
    """One JSON object per line (see the module docstring)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        doc.update(log_extras(record))
        if record.exc_info:
            doc["exc"] = self.formatException(record.exc_info)
        return json.dumps(doc, default=str)
