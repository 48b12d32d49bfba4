"""The one ``--json`` line format: ``time`` in RFC 3339 with milliseconds, ``ts`` beside it."""

from __future__ import annotations

import json
import logging

from imex_shared.jsonlog import JsonFormatter, rfc3339_ms


def test_time_is_rfc3339_utc_with_milliseconds_and_ts_stays() -> None:
    record = logging.makeLogRecord({"name": "imex.host.reconcile", "levelno": logging.INFO,
                                    "levelname": "INFO", "msg": "rack1/gb200: slot 0 joined",
                                    "created": 1796245200.1237,
                                    "ensemble": "rack1/gb200", "slot": 0, "generation": 7})
    doc = json.loads(JsonFormatter().format(record))
    assert list(doc)[:5] == ["time", "ts", "level", "logger", "msg"]
    assert doc["time"] == "2026-12-02T21:00:00.124Z" == rfc3339_ms(1796245200.1237)
    assert doc["ts"] == 1796245200.124
    assert (doc["ensemble"], doc["slot"], doc["generation"]) == ("rack1/gb200", 0, 7)
