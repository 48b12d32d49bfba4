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

MicroTime fields (`eventTime`, `series.lastObservedTime`) are decoded as
metav1.MicroTime is: exactly six fractional digits (`2006-01-02T15:04:05.000000Z07:00`),
anything else is a decoding error (400 on create and update, 422 naming `patch`
on a patch); they are stored in UTC. A created Event carries the empty
deprecated fields as the server renders them (`deprecatedSource: {}`, null
timestamps). Not imitated: the one-hour TTL (Events
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
_MICRO = re.compile(r"^(\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2})(\.\d{6})(Z|[+-]\d{2}:\d{2})$")
_SECONDS = re.compile(r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}")
MICRO_LAYOUT = "2006-01-02T15:04:05.000000Z07:00"
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


def decode_error(obj: Mapping[str, Any]) -> str | None:
    """Go's time.Parse error for a MicroTime field that is not in MICRO_LAYOUT."""
    raw = obj.get("series")
    series: Mapping[str, Any] = raw if isinstance(raw, Mapping) else {}
    for value in (obj.get("eventTime"), series.get("lastObservedTime")):
        if value is None or (isinstance(value, str) and _MICRO.match(value)):
            continue
        text = str(value)
        m = _SECONDS.match(text)
        rest, want = (text[m.end():], ".000000") if m else (text, "2006")
        return f'parsing time "{text}" as "{MICRO_LAYOUT}": cannot parse "{rest}" as "{want}"'
    return None


def default(obj: JSON) -> None:
    obj["eventTime"] = micro_time(obj.get("eventTime"))
    if obj["eventTime"] is None:
        del obj["eventTime"]
    series = obj.get("series")
    if isinstance(series, dict) and "lastObservedTime" in series:
        series["lastObservedTime"] = micro_time(series["lastObservedTime"])
    obj.setdefault("deprecatedSource", {})
    obj.setdefault("deprecatedFirstTimestamp", None)
    obj.setdefault("deprecatedLastTimestamp", None)


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
    if not controller:  # IsQualifiedName(""): empty, and not matching the pattern
        causes.append(invalid("reportingController", "", "name part must be non-empty"))
        causes.append(invalid("reportingController", "", "name part must consist of "
                              "alphanumeric characters, '-', '_' or '.', and must start and "
                              "end with an alphanumeric character"))
    elif (problem := _check_qualified_key(controller)) is not None:
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
