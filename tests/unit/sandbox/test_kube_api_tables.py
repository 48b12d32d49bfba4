"""Server-side Table printing of the API double (what `kubectl get` shows)."""

from __future__ import annotations

import datetime

import pytest

from tests.sandbox.kube_api import resources as rt
from tests.sandbox.kube_api.tables import human_age, table, wants_table

NOW = datetime.datetime(2026, 1, 2, 3, 4, 5, tzinfo=datetime.UTC)


@pytest.mark.parametrize(("seconds", "shown"), [
    (0, "0s"), (119, "119s"), (120, "2m"), (200, "3m20s"), (3600, "60m"), (3 * 3600, "3h"),
    (50 * 3600, "2d2h"), (30 * 86400, "30d"),
])
def test_human_age(seconds: int, shown: str) -> None:
    created = (NOW - datetime.timedelta(seconds=seconds)).strftime("%Y-%m-%dT%H:%M:%SZ")
    assert human_age(created, NOW) == shown


def test_accept_negotiation() -> None:
    kubectl = ("application/json;as=Table;v=v1;g=meta.k8s.io,"
               "application/json;as=Table;v=v1beta1;g=meta.k8s.io,application/json")
    assert wants_table(kubectl)
    assert not wants_table("application/json")


def test_vmi_and_slice_rows() -> None:
    vmi = {"metadata": {"name": "gb200-0", "creationTimestamp": "2026-01-02T03:04:00Z"},
           "status": {"phase": "Running", "nodeName": "node-a",
                      "interfaces": [{"name": "default", "ipAddress": "10.244.0.5"}],
                      "conditions": [{"type": "Ready", "status": "True"}]}}
    t = table(rt.VMI, [vmi], "42", now=NOW)
    assert [c["name"] for c in t["columnDefinitions"] if c["priority"] == 0] == \
        ["Name", "Age", "Phase", "IP", "NodeName", "Ready"]
    assert t["rows"][0]["cells"][:6] == ["gb200-0", "5s", "Running", "10.244.0.5", "node-a",
                                         "True"]
    assert t["rows"][0]["object"]["kind"] == "PartialObjectMetadata"
    assert t["metadata"]["resourceVersion"] == "42"
    es = {"metadata": {"name": "s"}, "addressType": "IPv4", "ports": [{"port": 50000}],
          "endpoints": [{"addresses": [f"10.0.0.{i}"]} for i in range(1, 6)]}
    (row,) = table(rt.ENDPOINTSLICE, [es], None, include="None", now=NOW)["rows"]
    assert row == {"cells": ["s", "IPv4", "50000", "10.0.0.1,10.0.0.2,10.0.0.3 + 2 more...",
                             "<unknown>"]}
