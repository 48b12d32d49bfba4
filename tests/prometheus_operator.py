"""prometheus-operator's own published CRDs (PrometheusRule, ServiceMonitor), for tests.

Fetched through the Go module proxy as data (``go mod download`` of the operator's
module, pinned; the files live in Go's module cache, never in this repository).
tests/integration/test_prometheusrule.py validates the example rule against the
PrometheusRule schema; the realk8s tier loads both CRDs into the real apiserver so
that the chart's monitoring objects are judged by it (tests/realk8s/test_chart_render.py).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import yaml

OPERATOR = "github.com/prometheus-operator/prometheus-operator"
OPERATOR_VERSION = "v0.85.0"
CRD_FILES = {
    "PrometheusRule": "example/prometheus-operator-crd/monitoring.coreos.com_prometheusrules.yaml",
    "ServiceMonitor": "example/prometheus-operator-crd/monitoring.coreos.com_servicemonitors.yaml",
}


class NoGo(Exception):
    """No Go toolchain to fetch the module with."""


def go_binary() -> str:
    go = shutil.which("go") or ("/usr/local/go/bin/go" if os.access(
        "/usr/local/go/bin/go", os.X_OK) else None)
    if go is None:
        raise NoGo("no Go toolchain: cannot fetch prometheus-operator's CRDs")
    return go


@functools.cache
def module_dir() -> Path:
    """The operator's module in Go's module cache (downloaded once)."""
    with tempfile.TemporaryDirectory(prefix="gomod-") as cwd:
        out = subprocess.run([go_binary(), "mod", "download", "-json",
                              f"{OPERATOR}@{OPERATOR_VERSION}"],
                             cwd=cwd, capture_output=True, text=True, timeout=600, check=False,
                             env={**os.environ, "GOFLAGS": "-mod=mod"})
    if out.returncode != 0:
        raise RuntimeError(f"go mod download {OPERATOR}@{OPERATOR_VERSION}: "
                           f"{out.stderr[-2000:]}")
    return Path(json.loads(out.stdout)["Dir"])


def crd(kind: str) -> dict[str, Any]:
    """The operator's CRD of ``kind``, as published."""
    doc: dict[str, Any] = yaml.safe_load((module_dir() / CRD_FILES[kind]).read_text())
    assert doc["spec"]["names"]["kind"] == kind
    return doc
