"""What `make demo` prints of the ImexEnsemble: its printer columns and its Events.

TEST STAND-IN, never product code. ``kubectl get imexens`` asks the apiserver for a
``meta.k8s.io/v1`` Table and prints the columns the CRD declares (priority 0: NAME,
MEMBERS, IMEX-READY, READY, DOMAIN, AGE); the demo asks the API double the same way
(its Table form computes the CRD's printer columns, kube_api/tables.py) and prints the
rows as kubectl lays them out. The Events are the events.k8s.io/v1 ones the host agent
wrote regarding the ensemble, as ``kubectl describe imexens`` lists them (type, reason,
from, message).
"""

from __future__ import annotations

from typing import Any

import httpx
import yaml

from tests.sandbox.ensemble import EnsembleSpec, Sandbox

TABLE = "application/json;as=Table;v=v1;g=meta.k8s.io"
#: one line under the registry table: why IMEX shows other states while a VM boots
IMEX_LEGEND = (
    "IMEX column (the guest's last `nvidia-imex-ctl -q`): - no report yet; NOT_RUNNING "
    "IMEX not started yet (the agent starts it once nodes_config.cfg is written); "
    "UNKNOWN started, no answer yet; INITIALIZING/WAITING_FOR_PEERS on the way; "
    "READY done. The first three are normal while a VM boots or comes back.")


def _api(sbx: Sandbox) -> tuple[str, str]:
    doc = yaml.safe_load(sbx.kubeconfig.read_text())
    return doc["clusters"][0]["cluster"]["server"], doc["users"][0]["user"]["token"]


def format_table(table: dict[str, Any]) -> str:
    """A meta.k8s.io/v1 Table as kubectl prints it: the priority-0 columns, names in
    upper case, cells left-aligned three spaces apart, ``<none>`` for a null cell."""
    cols = [i for i, c in enumerate(table.get("columnDefinitions") or [])
            if not c.get("priority")]
    head = [str(table["columnDefinitions"][i]["name"]).upper() for i in cols]
    rows = [head]
    for row in table.get("rows") or []:
        cells = row.get("cells") or []
        rows.append(["<none>" if cells[i] is None else str(cells[i]) for i in cols])
    widths = [max(len(r[c]) for r in rows) for c in range(len(head))]
    return "\n".join("   ".join(cell.ljust(w) for cell, w in zip(r, widths,
                                                               strict=True)).rstrip()
                     for r in rows)


def imexens_table(sbx: Sandbox, spec: EnsembleSpec) -> str:
    """``kubectl get imexens -n NAMESPACE``, through the API double's Table form."""
    server, token = _api(sbx)
    resp = httpx.get(f"{server}/apis/imex-ensemble.io/v1alpha1/namespaces/{spec.namespace}"
                     "/imexensembles", headers={"Accept": TABLE,
                                                "Authorization": f"Bearer {token}"},
                     timeout=10, trust_env=False)
    resp.raise_for_status()
    return format_table(resp.json())


def event_lines(events: list[dict[str, Any]]) -> list[str]:
    """Events as ``kubectl describe`` lists them: Type, Reason, From, Message."""
    rows = [("Type", "Reason", "From", "Message")]
    for e in events:
        count = (e.get("series") or {}).get("count")
        note = str(e.get("note") or "") + (f" (x{count})" if count else "")
        rows.append((str(e.get("type")), str(e.get("reason")),
                     str(e.get("reportingController") or "").rpartition("/")[2], note))
    widths = [max(len(r[c]) for r in rows) for c in range(3)]
    return ["  ".join([*(r[c].ljust(widths[c]) for c in range(3)), r[3]]) for r in rows]


def new_events(all_events: list[dict[str, Any]], seen: set[str]) -> list[dict[str, Any]]:
    """The Events not in ``seen`` (their names), which it then holds."""
    out = [e for e in all_events if e["metadata"]["name"] not in seen]
    seen.update(e["metadata"]["name"] for e in out)
    return out
