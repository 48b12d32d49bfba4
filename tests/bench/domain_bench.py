"""The IMEX domain view (issue 17): aggregation CPU, the page under load, link drop -> DEGRADED.

Figures:
- ``domain_ingest_cpu_ms_per_s``, ``domain_ingest_full_cpu_ms_per_s`` and
  ``domain_aggregate_cpu_ms_per_s``: the registry's own work for 1,000 ensembles x 18
  members reporting every 10 s (1,800 reports/s), in process: each report's body
  validated by the registry's schema (``StatusReport``), reduced to the member's row and
  stored (``guest_report`` + ``State.report``); then every ensemble aggregated once for a
  metrics scrape (``DomainCollector.collect``, so once per 10 s). CPU ms per second of
  that load. ``_full_``: every report carries the 18-node ``-N -j`` (the guest before
  it left an unchanged view out); without it: steady state, nothing changing, each
  member's view in full on one report in ``ceil(domain_refresh(10 s) / 10 s)`` (the
  guest's minute refresh, staggered over the members) and heartbeats without
  ``imex_domain`` otherwise; ``domain_ingest_ratio`` is full / steady. The HTTP and
  TLS cost of 1,800 requests/s is not in it (``registry_get_per_s`` gives the server's
  request rate).
- ``ui_page_p50_ms`` / ``ui_page_per_s``: the real host agent (API double with 10
  ensembles x 18) serving ``/ui/ensembles/bench/e0`` (after 18 reports) to the load
  generator's 32 keep-alive connections for 10 s.
- ``link_drop_to_degraded_s`` (p50 of 5, max too): a 4-VM sandbox ensemble (real guest
  agents, IMEX stand-ins, registry), member 1's dials to member 2 refused (nftables reset
  + ``ss -K``), at a random phase of the report interval; from the block to ``/domain``
  saying DEGRADED with 1->2 missing. Bounded by the guests' ``report_interval`` (10 s):
  expect about half of it plus a collection.
- ``report_writes_per_s_before`` / ``report_writes_per_s`` (``_2_replicas``, ``_ratio``):
  the reports ConfigMap writes of 1,000 quiet ensembles x 18 heartbeating every 10 s,
  every report written vs news and refreshes only (tests/bench/report_writes.py).
"""

from __future__ import annotations

import json
import math
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from tests.bench import report_writes
from tests.bench.common import (
    PY,
    BenchError,
    Results,
    free_port,
    get_load,
    read_line,
    spawn,
    stop,
    wait_for,
)
from tests.bench.kube_proc import NAMESPACE
from tests.bench.registry_load import _members

UUID = "5e1f0c2a-7b3d-4c8e-9a61-2d4f8b0e3c17"


def domain_doc(n: int, own: int) -> dict[str, Any]:
    """An n-node ``-N -j`` as the IMEX stand-in prints it (member ``own``'s view)."""
    nodes = {}
    for i in range(n):
        nodes[str(i)] = {
            "status": "READY", "host": f"10.20.0.{i + 1}", "hostName": f"imex-0a1b2c3d-{i}",
            "version": "580.82.07",
            "connections": {str(j): {"host": f"10.20.0.{j + 1}", "status": "CONNECTED",
                                     "changed": 1795973999} for j in range(n) if j != i}}
    return {"nodes": nodes, "timestamp": 1795974000 + own, "status": "UP"}


def aggregation(results: Results, quick: bool) -> None:
    from guest_agent.report.report import domain_refresh
    from host_agent.registry.domain_routes import DomainCache, DomainCollector
    from host_agent.registry.models import StatusReport
    from host_agent.registry.report_routes import guest_report
    from host_agent.state.snapshot import EnsembleSpec
    from host_agent.state.store import State
    from imex_shared.model import EnsembleId, Member

    ensembles = 50 if quick else 1000
    clock = [1_800_000_000.0]
    state = State(clock=lambda: clock[0])
    heartbeat = {"imex_state": "READY", "nodes_config_sha256": "a" * 64,
                 "imex_channel0": True, "fabric": {"cluster_uuid": UUID, "clique_id": 1}}
    full = [json.dumps({**heartbeat, "imex_domain": domain_doc(18, i)}) for i in range(18)]
    beat = json.dumps(heartbeat)
    ids = []
    for e in range(ensembles):
        ens = EnsembleId(NAMESPACE, f"e{e}")
        ids.append(ens)
        state.set(EnsembleSpec(ens, 18, 50000),
                  [Member(i, f"10.{20 + e // 250}.{e % 250}.{i + 1}") for i in range(18)], [])
    cache = DomainCache(120.0, clock=lambda: clock[0])
    collector = DomainCollector(state, cache)
    window = 10.0  # every member reports once per window; one scrape per window
    period = math.ceil(domain_refresh(window) / window)  # reports per full view, steady

    def ingest_round(carries: Any) -> float:
        clock[0] += window
        t0 = time.process_time()
        for ens in ids:
            snap = state.get(ens)
            assert snap is not None
            for i in range(18):
                report = StatusReport.model_validate_json(full[i] if carries(i) else beat)
                state.report(ens, i, guest_report(report, snap, i, clock[0], "10.0.0.1"))
        return time.process_time() - t0

    def aggregate_round() -> float:
        t0 = time.process_time()
        families = list(collector.collect())
        took = time.process_time() - t0
        if not families or state.get(ids[0]) is None:
            raise BenchError("no metrics collected")
        status = cache.view(state.get(ids[0]))  # type: ignore[arg-type]
        if status.status != "UP":
            raise BenchError(f"aggregated status {status.status}, expected UP")
        return took

    rounds = 1 if quick else 3
    ingest_full = aggregate = 0.0
    for _ in range(rounds):  # every report carries the view
        ingest_full += ingest_round(lambda i: True)
        aggregate += aggregate_round()
    ingest_steady = 0.0
    for r in range(period):  # one full cycle of the minute refresh
        ingest_steady += ingest_round(lambda i, r=r: (i + r) % period == 0)
        aggregate_round()  # the kept rows: still UP
    scale = 1000 / ensembles
    full_ms = ingest_full / rounds / window * 1000 * scale
    steady_ms = ingest_steady / period / window * 1000 * scale
    results.set("domain_ingest_cpu_ms_per_s", steady_ms)
    results.set("domain_ingest_full_cpu_ms_per_s", full_ms)
    results.set("domain_ingest_ratio", full_ms / steady_ms if steady_ms else None)
    results.set("domain_aggregate_cpu_ms_per_s", aggregate / rounds / window * 1000 * scale)
    results.set("domain_report_ingest_us", ingest_full / rounds / (ensembles * 18) * 1e6)
    results.note("domain", f"steady state: 1 report in {period} carries the view"
                 + (f"; quick: {ensembles} ensembles, scaled to 1,000" if quick else ""))


def ui_page(results: Results, quick: bool) -> None:
    seconds = 1.0 if quick else 10.0
    with tempfile.TemporaryDirectory(prefix="bench-ui-") as tmp:
        work = Path(tmp)
        kubeconfig = work / "kubeconfig"
        api_proc = spawn([PY, "-m", "tests.bench.kube_proc", "--kubeconfig-out", str(kubeconfig),
                          "--ensembles", "10", "--per", "18"], log=work / "api.log",
                         stdout_pipe=True)
        agent = None
        try:
            read_line(api_proc, "kube-api ready", timeout=120)
            port = free_port()
            agent = spawn([PY, "-m", "host_agent.cli", "--kubeconfig", str(kubeconfig),
                           "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING",
                           "--trusted-proxy", "127.0.0.0/8"], log=work / "agent.log")
            base = f"http://127.0.0.1:{port}"
            url = f"{base}/v1/ensembles/{NAMESPACE}/e0"
            wait_for("ensemble e0 with 18 members", lambda: _members(url) == 18,
                     timeout=120, interval=0.2)
            out = get_load(f"{base}/ui/ensembles/{NAMESPACE}/e0", connections=32,
                           seconds=seconds, log=work / "loadgen.log", what="page GETs")
            results.set("ui_page_p50_ms", out["p50_ms"])
            results.set("ui_page_p99_ms", out["p99_ms"])
            results.set("ui_page_per_s", out["per_s"])
        finally:
            if agent is not None:
                stop(agent)
            stop(api_proc)


def link_drop(results: Results, quick: bool) -> None:
    from tests.e2e.domain_support import block_dials, unblock_dials, wait_domain
    from tests.sandbox.ensemble import Sandbox, SandboxSettings
    from tests.sandbox.virt_controller import VirtController

    trials = 1 if quick else 5
    with Sandbox(SandboxSettings(prefix="bdom")) as sbx:
        ctl = VirtController(sbx)
        try:
            spec = ctl.create_ensemble("bench", "drop", max_members=4)
            pool = ctl.pool(spec)
            pool.scale(4)
            sbx.wait_converged(spec, 120)
            interval = sbx.settings.report_interval

            def up(d: dict[str, Any]) -> bool:
                return d.get("status") == "UP" and not d.get("silent")

            times = []
            rng = random.Random(17)
            for _ in range(trials):
                wait_domain(sbx, spec, up, 3 * interval + 10)
                # UP is seen right after a report: block at a random phase of the interval,
                # not always just after one (that would measure the worst case only)
                time.sleep(rng.uniform(0, interval))
                a, b = sbx.vm(spec, pool.vmi_name(1)), sbx.vm(spec, pool.vmi_name(2))
                block_dials(a, b, spec.port)
                try:
                    _, took = wait_domain(sbx, spec, lambda d: d.get("missing_links") == [[1, 2]],
                                          3 * interval + 10, every=0.05)
                finally:
                    unblock_dials(a)
                times.append(took)
        finally:
            ctl.close()
    results.set("link_drop_to_degraded_s", statistics.median(times))
    results.set("link_drop_to_degraded_max_s", max(times))
    results.note("link_drop", f"{trials} trials, report_interval {interval:g}s: "
                 + ", ".join(f"{t:.1f}" for t in times) + " s")


def run(results: Results, *, quick: bool = False, profile: str | None = None) -> None:
    aggregation(results, quick)
    report_writes.run(results, quick)
    ui_page(results, quick)
    link_drop(results, quick)
