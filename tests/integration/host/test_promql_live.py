"""Every PromQL expression of the alerts and of the Grafana dashboard, evaluated in Debian's
real Prometheus while it scrapes the real host agent (the ``imex-host-agent`` process,
leader-elected, against the API double) on loopback.

The agent publishes an ensemble of two members; both guests report (through the agent's
trusted-proxy path, as a guest behind a proxy would), and one report with a wrong token
is refused. Prometheus scrapes it every second as a ServiceMonitor would (job
``imex-host-agent``, ``honor_labels``, the agent's namespace as a target label). Then:

- each expression names only metrics and labels the scrape has (tests/promql_check.py;
  a made-up metric or label is shown to fail the same check);
- each returns series in its neutral form, else in its widened form (promql_check's
  docstring says what those are), and every series carries the labels the alert's
  annotations or the panel's legend use;
- the dashboard's variable query names an exported metric and label.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import promql_check
from tests.host_support.kubevirt import service, vmi
from tests.integration.host.conftest import NS
from tests.sandbox.kube_api.fixtures import KubeApiHandle

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]
RULES = ROOT / "charts/imex-ensemble/files/prometheus-rules.yaml"
DASHBOARD = ROOT / "charts/imex-ensemble/dashboards/imex-ensemble.json"
TOKEN = "live-promql-token"
AGENT_NS = "imex-system"
#: printed at the end: how many expressions were checked, and how
FIGURES: dict[str, int] = {}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def http(method: str, url: str, body: bytes | None = None,
         headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def expressions() -> list[tuple[str, str, set[str]]]:
    """(where, expr, labels it shows) for every alert and dashboard target."""
    out = []
    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for r in group["rules"]:
            shown = promql_check.label_refs(r.get("annotations", {}).values())
            out.append((f"alert {r['alert']}", r["expr"], shown))
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for t in panel["targets"]:
            shown = promql_check.label_refs([t.get("legendFormat", "")])
            out.append((f"panel {panel['title']!r} {t['refId']}", t["expr"], shown))
    return out


class Prometheus:
    def __init__(self, url: str) -> None:
        self.url = url

    def query(self, expr: str) -> list[dict[str, Any]]:
        q = urllib.parse.urlencode({"query": expr})
        status, body = http("GET", f"{self.url}/api/v1/query?{q}")
        doc = json.loads(body)
        assert status == 200 and doc["status"] == "success", f"{expr}: {doc}"
        return list(doc["data"]["result"])

    def exported(self) -> dict[str, set[str]]:
        """metric -> label names, of every series the scrape stored."""
        out: dict[str, set[str]] = {}
        q = urllib.parse.urlencode({"match[]": '{job="imex-host-agent"}'})
        status, body = http("GET", f"{self.url}/api/v1/series?{q}")
        assert status == 200, body
        for s in json.loads(body)["data"]:
            out.setdefault(s["__name__"], set()).update(k for k in s if k != "__name__")
        return out


@pytest.fixture
def prometheus(tmp_path: Path) -> Iterator[tuple[Prometheus, int]]:
    """Debian's Prometheus, scraping 127.0.0.1:<port> every second (the agent comes
    up on that port later)."""
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("prometheus is not installed (Debian: apt-get install prometheus)")
    agent_port, web_port = free_port(), free_port()
    config = {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
              "scrape_configs": [{
                  "job_name": "imex-host-agent", "honor_labels": True,
                  "static_configs": [{"targets": [f"127.0.0.1:{agent_port}"],
                                      "labels": {"namespace": AGENT_NS}}]}]}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    log = (tmp_path / "prometheus.log").open("w")
    proc = subprocess.Popen(
        [binary, f"--config.file={tmp_path / 'prometheus.yml'}",
         f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{web_port}"],
        stdout=log, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{web_port}"
        deadline = time.monotonic() + 30
        while True:
            try:
                if http("GET", f"{url}/-/ready")[0] == 200:
                    break
            except OSError:
                pass
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()
            assert time.monotonic() < deadline, "prometheus did not get ready in 30 s"
            time.sleep(0.2)
        yield Prometheus(url), agent_port
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


def report(port: int, index: int, ip: str, token: str) -> int:
    body = {"imex_state": "READY", "preflight": [
        {"name": "dns", "result": "PASS", "message": "resolves the members"}]}
    status, _ = http("PUT", f"http://127.0.0.1:{port}/v1/ensembles/{NS}/gb200/members/"
                     f"{index}/status", json.dumps(body).encode(),
                     {"Authorization": f"Bearer {token}", "X-Forwarded-For": ip,
                      "Content-Type": "application/json"})
    return status


async def test_every_expression_returns_series_with_its_labels_from_a_running_agent(
        api: KubeApiHandle, prometheus: tuple[Prometheus, int], tmp_path: Path) -> None:
    prom, port = prometheus
    sha = hashlib.sha256(TOKEN.encode()).hexdigest()
    api.put(service("gb200", namespace=NS,
                    annotations={"imex-ensemble.io/token-sha256": sha}))
    api.put(vmi("gb200-0", ip="10.244.0.1", index="0"))
    api.put(vmi("gb200-1", ip="10.244.0.2", index="1"))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    log = (tmp_path / "agent.log").open("w")
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "host_agent.cli", "--kubeconfig", str(api.kubeconfig_path),
        "--listen", f"127.0.0.1:{port}", "--tls-listen", "", "--agent-namespace", NS,
        "--leader-elect", "--namespace", NS, "--trusted-proxy", "127.0.0.1/32",
        env=env, cwd=ROOT, stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 30
        while not (_up(port) and report(port, 0, "10.244.0.1", TOKEN) in (200, 204)):
            assert proc.returncode is None, (tmp_path / "agent.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "agent.log").read_text()[-3000:]
            await asyncio.sleep(0.3)
        assert report(port, 1, "10.244.0.2", TOKEN) in (200, 204)
        assert report(port, 1, "10.244.0.2", "not-the-token") == 401
        await scraped(prom, 4)
        check(prom)
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 15)
            except TimeoutError:
                proc.kill()
                await proc.wait()
        log.close()


async def scraped(prom: Prometheus, samples: int) -> None:
    """Wait until Prometheus holds ``samples`` scrapes taken after the first accepted
    report (the reports counter has no series before it), so every rate() has samples.
    Counted, not slept for: on a loaded machine a scrape may time out (1 s, the
    interval) and be lost."""
    expr = "min(count_over_time(imex_registry_reports_total[5m]))"
    deadline = time.monotonic() + 60
    while True:
        got = prom.query(expr)
        if got and float(got[0]["value"][1]) >= samples:
            return
        assert time.monotonic() < deadline, f"{expr} is {got} after 60 s"
        await asyncio.sleep(0.5)


def _up(port: int) -> bool:
    try:
        return http("GET", f"http://127.0.0.1:{port}/v1/ensembles/{NS}/gb200")[0] == 200
    except OSError:
        return False


def check(prom: Prometheus) -> None:
    exported = prom.exported()
    assert "imex_host_agent_leader" in exported, sorted(exported)
    # the check bites: a made-up metric and a made-up label are both named
    assert "metric imex_ensemble_no_such" in promql_check.unknown(
        "max by (namespace) (imex_ensemble_no_such)", exported)
    assert promql_check.unknown('sum by (rack) (imex_ensemble_cliques{clique="x"})',
                                exported) == ["label clique of imex_ensemble_cliques",
                                              "label rack"]
    failures: list[str] = []
    neutral, widened = 0, []
    for where, expr, shown in expressions():
        if bad := promql_check.unknown(expr, exported):
            failures.append(f"{where}: names what the agent does not export: {bad}")
            continue
        result = prom.query(promql_check.neutral(expr))
        if result:
            neutral += 1
        else:
            result = prom.query(promql_check.widened(expr))
            widened.append(where)
        if not result:
            failures.append(f"{where}: no series (as {promql_check.widened(expr)})")
            continue
        lacking = {k for s in result for k in shown if k not in s["metric"]}
        if lacking:
            failures.append(f"{where}: series lack {sorted(lacking)}: {result[:2]}")
    variables = json.loads(DASHBOARD.read_text())["templating"]["list"]
    for var in variables:
        if var["type"] != "query":
            continue
        metric, label = var["definition"].removeprefix("label_values(").rstrip(")").split(", ")
        if not prom.query(f"count by ({label}) ({metric})"):
            failures.append(f"variable {var['name']}: no {label} values of {metric}")
    assert failures == []
    doc = " ".join((ROOT / "docs/monitoring.md").read_text().split())  # the figures it states
    assert f"the dashboard's {neutral + len(widened)} expressions" in doc
    assert f"{neutral} expressions return series as written, and {len(widened)} need" in doc
    FIGURES.update(expressions=neutral + len(widened), neutral=neutral, widened=len(widened))
    print(f"\npromql live: {FIGURES}; widened: {widened}")
