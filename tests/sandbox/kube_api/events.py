"""events.k8s.io/v1 Events: the registry's defaulting and validation.

TEST STAND-IN, never product code. Kubernetes v1.37.2 validates an
events.k8s.io/v1 Event as its internal core.Event
(pkg/apis/core/validation/events.go), so the causes name the *internal*
fields where the versions differ: `involvedObject` (v1: `regarding`),
`message` (`note`), `count`, `firstTimestamp`, `lastTimestamp`, `source`
(the v1 `deprecated*` fields); `reportingController`, `series.count` and
`series.lastObservedTime` keep their names. On create: eventTime required,
type Normal or Warning, reportingController a qualified name, reportingInstance,
action and reason present and at most 128 characters, the note at most 1024,
a series with count >= 2 and a lastObservedTime, the deprecated fields unset,
`regarding.namespace` equal to the Event's unless that is default or
kube-system. On update also: everything but the series and metadata is
immutable ("field is immutable"), which is why repeats are recorded by
patching `series` (count, lastObservedTime), never by rewriting the note.

MicroTime fields are stored as the server renders them
(`2006-01-02T15:04:05.000000Z`). Not imitated: the one-hour TTL (Events
here never expire), the core/v1 view of the same objects (the double keeps
core/v1 Events separate; `kubectl describe` reads those, so the realk8s tier
checks describe against the real server).
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Mapping
from typing import Any

from .validation import Cause, _check_qualified_key, invalid, required

JSON = dict[str, Any]
LIMIT_128 = 128
NOTE_LIMIT = 1024
_MICRO = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d{1,9})?(Z|[+-]\d{2}:\d{2})$")
# v1 name -> internal name, for the fields whose validation message names them
_INTERNAL = {"regarding": "involvedObject", "note": "message",
             "deprecatedSource": "source", "deprecatedFirstTimestamp": "firstTimestamp",
             "deprecatedLastTimestamp": "lastTimestamp", "deprecatedCount": "count"}
_IMMUTABLE = ("regarding", "reason", "note", "deprecatedSource", "deprecatedFirstTimestamp",
              "deprecatedLastTimestamp", "deprecatedCount", "type", "eventTime", "action",
              "related", "reportingController", "reportingInstance")


def micro_time(value: Any) -> Any:
    """A MicroTime as the apiserver renders it (six fractional digits, UTC)."""
    if not isinstance(value, str):
        return value
    m = _MICRO.match(value)
    if m is None:
        return value
    base, frac, zone = m.groups()
    when = datetime.datetime.fromisoformat(base + (zone if zone != "Z" else "+00:00"))
    micros = int(((frac or ".0")[1:] + "000000")[:6])
    utc = when.astimezone(datetime.UTC).replace(microsecond=micros)
    return utc.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def default(obj: JSON) -> None:
    for key in ("eventTime", "deprecatedFirstTimestamp", "deprecatedLastTimestamp"):
        if key in obj:
            obj[key] = micro_time(obj[key])
    series = obj.get("series")
    if isinstance(series, dict) and "lastObservedTime" in series:
        series["lastObservedTime"] = micro_time(series["lastObservedTime"])


def _bad_time(value: Any) -> bool:
    return not isinstance(value, str) or _MICRO.match(value) is None


def _legacy(obj: Mapping[str, Any]) -> list[Cause]:
    causes: list[Cause] = []
    ns = (obj.get("metadata") or {}).get("namespace") or ""
    regarding = obj.get("regarding") or {}
    if not obj.get("eventTime"):
        their = regarding.get("namespace") or ""
        if (not their and ns not in ("", "default")) or (their and their != ns):
            causes.append(invalid("involvedObject.namespace", their,
                                  "does not match event.namespace"))
        return causes
    if not regarding.get("namespace") and ns not in ("default", "kube-system"):
        causes.append(invalid("involvedObject.namespace", "", "does not match event.namespace"))
    controller = obj.get("reportingController") or ""
    if not controller:
        causes.append(required("reportingController"))
    problem = _check_qualified_key(controller) if controller else \
        "name part must be non-empty"
    if problem:
        causes.append(invalid("reportingController", controller, problem))
    for key in ("reportingInstance", "action", "reason"):
        value = obj.get(key) or ""
        if not value:
            causes.append(required(key))
        if len(value) > LIMIT_128:
            causes.append(invalid(key, "", f"can have at most {LIMIT_128} characters"))
    if len(obj.get("note") or "") > NOTE_LIMIT:
        causes.append(invalid("message", "", f"can have at most {NOTE_LIMIT} characters"))
    return causes


def _series(obj: Mapping[str, Any]) -> list[Cause]:
    series = obj.get("series")
    if not isinstance(series, Mapping):
        return []
    causes: list[Cause] = []
    if int(series.get("count") or 0) < 2:
        causes.append(invalid("series.count", "", "should be at least 2"))
    if not series.get("lastObservedTime"):
        causes.append(required("series.lastObservedTime"))
    return causes


def validate(obj: Mapping[str, Any], old: Mapping[str, Any] | None) -> list[Cause]:
    """The causes for storing `obj` (old: the stored Event on update)."""
    causes = _legacy(obj)
    for key in ("eventTime",):
        if obj.get(key) and _bad_time(obj[key]):
            causes.append(invalid(key, obj[key], "must be an RFC 3339 MicroTime"))
    if old is None:
        causes.extend(_series(obj))
        if not obj.get("eventTime"):
            causes.append(required("eventTime"))
        if obj.get("type") not in ("Normal", "Warning"):
            causes.append(invalid("type", "", f"has invalid value: {obj.get('type') or ''}"))
        for key in ("deprecatedFirstTimestamp", "deprecatedLastTimestamp", "deprecatedCount",
                    "deprecatedSource"):
            if obj.get(key):
                causes.append(invalid(_INTERNAL[key], "", "needs to be unset"))
        return causes
    if obj.get("series") != old.get("series"):
        causes.extend(_series(obj))
    for key in _IMMUTABLE:
        if obj.get(key) != old.get(key):
            causes.append(invalid(_INTERNAL.get(key, key), obj.get(key), "field is immutable"))
    return causes
