"""Server-side printing: `meta.k8s.io/v1` Table responses for `kubectl get`.

TEST STAND-IN, never product code. kubectl asks for
`Accept: application/json;as=Table;v=v1;g=meta.k8s.io` and prints the
server's columns (Kubernetes API concepts, "Receiving resources as
Tables"). The columns imitate the real printers: the built-in ones for
Namespace/Service/EndpointSlice/Pod/ConfigMap/Event, and the
`additionalPrinterColumns` of KubeVirt's CRDs (VMI: Age, Phase, IP,
NodeName, Ready), and for a kind a stored CRD defines, its own printer
columns as the CRD table convertor computes them (crds.cell: JSONPath, one
value, typed; null where the path finds nothing). Rows carry the object as
`includeObject` asks: `None`, `Metadata` (default: PartialObjectMetadata) or
`Object`.

Pure functions of objects and a clock.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Mapping
from typing import Any

from . import crds
from . import resources as rt
from .resources import ResourceType

JSON = dict[str, Any]
Cell = Callable[[Mapping[str, Any], datetime.datetime], Any]


def wants_table(accept: str) -> bool:
    return any("as=Table" in part and "g=meta.k8s.io" in part for part in accept.split(","))


def human_age(created: str | None, now: datetime.datetime) -> str:
    """Like apimachinery's HumanDuration: 45s, 3m20s, 5h, 2d3h, 400d."""
    if not created:
        return "<unknown>"
    try:
        then = datetime.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(
            tzinfo=datetime.UTC)
    except ValueError:
        return "<invalid>"
    s = max(0, int((now - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 48:
        return f"{h}h"
    d = h // 24
    return f"{d}d{h % 24}h" if d < 8 and h % 24 else f"{d}d"


def _get(obj: Mapping[str, Any], *path: str | int) -> Any:
    cur: Any = obj
    for p in path:
        if isinstance(p, int):
            cur = cur[p] if isinstance(cur, list) and len(cur) > p else None
        else:
            cur = cur.get(p) if isinstance(cur, Mapping) else None
        if cur is None:
            return None
    return cur


def _age(o: Mapping[str, Any], now: datetime.datetime) -> str:
    return human_age(_get(o, "metadata", "creationTimestamp"), now)


def _condition(o: Mapping[str, Any], kind: str) -> str | None:
    for c in _get(o, "status", "conditions") or []:
        if isinstance(c, Mapping) and c.get("type") == kind:
            return str(c.get("status"))
    return None


def _service_ports(o: Mapping[str, Any], _: datetime.datetime) -> str:
    ports = _get(o, "spec", "ports") or []
    return ",".join(f"{p.get('port')}/{p.get('protocol', 'TCP')}" for p in ports) or "<none>"


def _slice_endpoints(o: Mapping[str, Any], _: datetime.datetime) -> str:
    addrs = [a for ep in o.get("endpoints") or [] for a in ep.get("addresses") or []]
    if not addrs:
        return "<unset>"
    shown = ",".join(addrs[:3])
    return shown + (f" + {len(addrs) - 3} more..." if len(addrs) > 3 else "")


def _slice_ports(o: Mapping[str, Any], _: datetime.datetime) -> str:
    ports = [str(p.get("port")) for p in o.get("ports") or [] if p.get("port") is not None]
    return ",".join(ports) or "<unset>"


def _s(*path: str | int, default: str = "") -> Cell:
    def cell(o: Mapping[str, Any], _: datetime.datetime) -> Any:
        v = _get(o, *path)
        return default if v is None else v
    return cell


Column = tuple[str, str, Cell, int]  # (name, type, cell, priority)
COLUMNS: dict[str, list[Column]] = {
    rt.NAMESPACE.key: [("Status", "string", _s("status", "phase"), 0),
                       ("Age", "date", _age, 0)],
    rt.SERVICE.key: [
        ("Type", "string", _s("spec", "type"), 0),
        ("Cluster-IP", "string", _s("spec", "clusterIP"), 0),
        ("External-IP", "string", lambda o, n: "<none>", 0),
        ("Port(s)", "string", _service_ports, 0),
        ("Age", "date", _age, 0),
        ("Selector", "string", lambda o, n: ",".join(
            f"{k}={v}" for k, v in (_get(o, "spec", "selector") or {}).items()) or "<none>", 1),
    ],
    rt.ENDPOINTSLICE.key: [
        ("AddressType", "string", _s("addressType"), 0),
        ("Ports", "string", _slice_ports, 0),
        ("Endpoints", "string", _slice_endpoints, 0),
        ("Age", "date", _age, 0),
    ],
    rt.POD.key: [("Status", "string", _s("status", "phase"), 0),
                 ("IP", "string", _s("status", "podIP", default="<none>"), 1),
                 ("Node", "string", _s("spec", "nodeName", default="<none>"), 1),
                 ("Age", "date", _age, 0)],
    rt.CONFIGMAP.key: [("Data", "integer", lambda o, n: len(o.get("data") or {}), 0),
                       ("Age", "date", _age, 0)],
    rt.EVENT.key: [
        ("Type", "string", _s("type"), 0),
        ("Reason", "string", _s("reason"), 0),
        ("Object", "string", lambda o, n: "{}/{}".format(
            str(_get(o, "involvedObject", "kind") or "").lower(),
            _get(o, "involvedObject", "name") or ""), 0),
        ("Message", "string", _s("message"), 0),
        ("Age", "date", _age, 0),
    ],
    rt.CRD.key: [("Created At", "date", lambda o, n: _get(o, "metadata", "creationTimestamp"), 0)],
    rt.VMI.key: [
        ("Age", "date", _age, 0),
        ("Phase", "string", _s("status", "phase"), 0),
        ("IP", "string", _s("status", "interfaces", 0, "ipAddress"), 0),
        ("NodeName", "string", _s("status", "nodeName"), 0),
        ("Ready", "string", lambda o, n: _condition(o, "Ready") or "", 0),
        ("Live-Migratable", "string", lambda o, n: _condition(o, "LiveMigratable") or "", 1),
        ("Paused", "string", lambda o, n: _condition(o, "Paused") or "", 1),
    ],
    rt.VM.key: [
        ("Age", "date", _age, 0),
        ("Status", "string", _s("status", "printableStatus"), 0),
        ("Ready", "string", lambda o, n: _condition(o, "Ready") or "", 0),
    ],
    rt.VMPOOL.key: [
        ("Desired", "string", _s("spec", "replicas"), 0),
        ("Current", "string", _s("status", "replicas"), 0),
        ("Ready", "string", _s("status", "readyReplicas"), 0),
        ("Age", "date", _age, 0),
    ],
}


def _row_object(obj: Mapping[str, Any], include: str) -> JSON | None:
    if include == "None":
        return None
    if include == "Object":
        return dict(obj)
    return {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
            "metadata": obj.get("metadata", {})}


def table(t: ResourceType, objs: list[JSON], resource_version: str | None,
          include: str = "Metadata", now: datetime.datetime | None = None) -> JSON:
    """A Table of `objs` with kind `t`'s columns."""
    now = now or datetime.datetime.now(datetime.UTC)
    if t.crd is not None:
        return _crd_table(t, objs, resource_version, include, now)
    cols = COLUMNS.get(t.key, [("Age", "date", _age, 0)])
    defs = [{"name": "Name", "type": "string", "format": "name", "priority": 0,
             "description": "Name must be unique within a namespace."}]
    defs += [{"name": name, "type": typ, "format": "", "description": name, "priority": prio}
             for name, typ, _, prio in cols]
    rows = []
    for obj in objs:
        cells = [_get(obj, "metadata", "name") or ""]
        cells += [cell(obj, now) for _, _, cell, _ in cols]
        row: JSON = {"cells": cells}
        o = _row_object(obj, include)
        if o is not None:
            row["object"] = o
        rows.append(row)
    meta = {"resourceVersion": resource_version} if resource_version else {}
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
            "columnDefinitions": defs, "rows": rows}


def _crd_table(t: ResourceType, objs: list[JSON], resource_version: str | None, include: str,
               now: datetime.datetime) -> JSON:
    columns = t.crd.columns
    defs: list[JSON] = [{"name": "Name", "type": "string", "format": "name",
                         "description": crds.NAME_DESCRIPTION, "priority": 0}]
    defs += [{"name": c["name"], "type": c["type"], "format": c.get("format", ""),
              "description": c.get("description") or
              f"Custom resource definition column (in JSONPath format): {c['jsonPath']}",
              "priority": c.get("priority", 0)} for c in columns]
    rows = []
    for obj in objs:
        cells = [_get(obj, "metadata", "name") or ""]
        cells += [crds.cell(c, obj, lambda ts: human_age(ts, now)) for c in columns]
        row: JSON = {"cells": cells}
        o = _row_object(obj, include)
        if o is not None:
            row["object"] = o
        rows.append(row)
    meta = {"resourceVersion": resource_version} if resource_version else {}
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
            "columnDefinitions": defs, "rows": rows}
