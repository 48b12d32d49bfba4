"""ImexEnsemble status writes per guest report: a boot storm and steady churn (issue 15).

Part of the ``host`` benchmark (run after its 10,000-VMI figures, printed beside
them). Three processes again: the API double (``kube_proc --imexensembles``: E
ImexEnsembles of 18 Running VMIs each), the real ``imex-host-agent`` (production
settings plus ``--trusted-proxy 127.0.0.1/32``, since the reports come from this
machine and carry the member's address in X-Forwarded-For, as a proxy would), and
this process sending the guests' reports as real HTTP PUTs to the registry.

Counted by the agent's own metrics: reports accepted
(``imex_registry_reports_total``), status writes
(``imex_host_agent_status_writes_total{result="written"}``), Events
(``imex_host_agent_events_total{result="created"|"series"}``).

- Boot storm: every member of every ensemble reports READY within one second,
  as 18 guests booting together do (issue 15: "18 guests reporting within a
  second cost at most 2 status writes"). Figures:
  ``host_status_writes_per_report_storm`` and
  ``host_status_writes_per_ensemble_storm``, and ``host_status_storm_spread_s``:
  how long the reports actually took to be answered (the registry stores each
  report in the API before it answers, so on a loaded machine a second's worth
  of sends can arrive over more than a second, which costs one more write).
- Steady churn: every member reports every ``REPORT_INTERVAL`` seconds (the
  guests' heartbeat), and in each round ``CHURN`` of the reports carry a
  changed IMEX state (a daemon flapping), for ``duration`` seconds. Figures:
  ``host_status_writes_per_report_churn`` and ``host_status_writes_per_s_churn``
  (the per-second rate over all ensembles).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.bench.common import (
    PY,
    BenchError,
    Results,
    free_port,
    percentile,
    read_line,
    spawn,
    stop,
    wait_for,
)
from tests.bench.kube_proc import BENCH_TOKEN, NAMESPACE, member_ip
from tests.bench.loadgen import raise_nofile, read_response, request_bytes

PER = 18
#: The guests' report heartbeat (guest_agent report_interval), seconds.
REPORT_INTERVAL = 10.0
#: Share of a steady round's reports that carry a changed IMEX state.
CHURN = 0.05


def metrics(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of every sample the agent serves."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[key] = float(value)
    return out


def total(samples: dict[str, float], name: str, **labels: str) -> float:
    want = [f'{k}="{v}"' for k, v in labels.items()]
    return sum(v for k, v in samples.items()
               if k.split("{", 1)[0] == name and all(w in k for w in want))


def counts(port: int) -> dict[str, float]:
    m = metrics(port)
    return {
        "reports": total(m, "imex_registry_reports_total"),
        "status": total(m, "imex_host_agent_status_writes_total", result="written"),
        "events": total(m, "imex_host_agent_events_total", result="created")
        + total(m, "imex_host_agent_events_total", result="series"),
    }


def statuses(url: str, token: str) -> list[dict[str, Any]]:
    req = urllib.request.Request(
        f"{url}/apis/imex-ensemble.io/v1alpha1/namespaces/{NAMESPACE}/imexensembles",
        headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return [o.get("status") or {} for o in json.loads(r.read())["items"]]


async def send_reports(port: int, reports: list[tuple[float, int, int, str, int]],
                       answers: list[float] | None = None) -> int:
    """Send (at, ensemble, member, imex_state, generation) at their times; returns the
    number accepted (200). ``answers`` gets each report's send -> answer time.

    Every guest has a connection of its own, opened at its first report and kept, as
    360 VMs do (a shared pool of 64 made the reports of one second queue behind each
    other's answers: the storm the agent saw was spread over several seconds by the
    harness). The client is loadgen's few lines of asyncio streams, not httpx: at 360
    reports httpx spent 3.3 CPU-s sending them, five times the agent's CPU for
    answering, so on 2 cores the answer times were mostly the harness's own queue
    (docs/benchmarks.md "The boot storm, without the harness's own cost")."""
    t0 = time.monotonic()
    ok = 0
    streams: dict[tuple[int, int], tuple[asyncio.StreamReader, asyncio.StreamWriter]] = {}
    locks: dict[tuple[int, int], asyncio.Lock] = {}

    async def exchange(e: int, i: int, request: bytes) -> int:
        kept = (e, i) in streams
        if not kept:
            streams[(e, i)] = await asyncio.open_connection("127.0.0.1", port)
        r, w = streams[(e, i)]
        try:
            w.write(request)
            status, _ = await asyncio.wait_for(read_response(r), 30)
            return status
        except (asyncio.IncompleteReadError, ConnectionError):
            # the server closes a connection idle past its keep-alive timeout (uvicorn:
            # 5 s, as the churn's pauses are): a kept one is opened again, as a guest's
            # HTTP client does, and the report sent on it
            del streams[(e, i)]
            w.close()
            if not kept:
                raise
            return await exchange(e, i, request)

    async def one(at: float, e: int, i: int, state: str, gen: int) -> None:
        nonlocal ok
        await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
        async with locks.setdefault((e, i), asyncio.Lock()):
            sent = time.monotonic()
            body = json.dumps({"imex_state": state, "generation_applied": gen}).encode()
            status = await exchange(e, i, request_bytes(
                "PUT", "127.0.0.1", port,
                f"/v1/ensembles/{NAMESPACE}/e{e}/members/{i}/status", body=body,
                headers={"Authorization": f"Bearer {BENCH_TOKEN}",
                         "X-Forwarded-For": member_ip(e, i),
                         "Content-Type": "application/json"}))
            ok += status == 200
            if answers is not None:
                answers.append(time.monotonic() - sent)

    raise_nofile(len({(e, i) for _, e, i, _, _ in reports}) + 256)
    try:
        await asyncio.gather(*(one(*rep) for rep in reports))
    finally:
        for _, w in streams.values():
            w.close()
    return ok


def generations(port: int, ensembles: int) -> dict[int, int]:
    out = {}
    for e in range(ensembles):
        with urllib.request.urlopen(
                f"http://127.0.0.1:{port}/v1/ensembles/{NAMESPACE}/e{e}", timeout=10) as r:
            out[e] = int(json.loads(r.read())["generation"])
    return out


def quiet(port: int, seconds: float = 2.5, timeout: float = 120) -> dict[str, float]:
    """The counters once they have not moved for ``seconds`` (the writer's 1 s windows)."""
    deadline = time.monotonic() + timeout
    last = counts(port)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = counts(port)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= seconds:
            return now
    raise BenchError(f"status writes never settled: {last}")


@contextlib.contextmanager
def fleet(work: Path, ensembles: int) -> Iterator[tuple[str, str, int]]:
    """(API URL, token, registry port) of a double seeded with ImexEnsembles and an agent."""
    kubeconfig = work / "kubeconfig-cr"
    api = spawn([PY, "-m", "tests.bench.kube_proc", "--kubeconfig-out", str(kubeconfig),
                 "--ensembles", str(ensembles), "--per", str(PER), "--imexensembles"],
                log=work / "kube-cr.log", stdout_pipe=True)
    agent = None
    try:
        ready = dict(kv.split("=", 1) for kv in
                     read_line(api, "kube-api ready", timeout=300).split()[2:])
        port = free_port()
        agent = spawn([PY, "-m", "host_agent.cli", "--kubeconfig", str(kubeconfig),
                       "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING",
                       "--trusted-proxy", "127.0.0.1/32"], log=work / "agent-cr.log")

        def published() -> bool:
            try:
                sts = statuses(ready["url"], ready["token"])
            except OSError:
                return False
            return len(sts) == ensembles and all(s.get("membersPublished") == PER for s in sts)

        wait_for("every ImexEnsemble published", published, timeout=300, interval=0.5)
        yield ready["url"], ready["token"], port
    finally:
        if agent is not None:
            stop(agent)
        stop(api)


def run(results: Results, *, quick: bool = False) -> None:
    ensembles = 4 if quick else 20
    duration = 12.0 if quick else 60.0
    rng = random.Random(15)
    with tempfile.TemporaryDirectory(prefix="bench-status-") as tmp, \
            fleet(Path(tmp), ensembles) as (url, token, port):
        before = quiet(port)
        gens = generations(port, ensembles)
        storm = [(rng.uniform(0, 0.9), e, i, "READY", gens[e])
                 for e in range(ensembles) for i in range(PER)]
        t0 = time.monotonic()
        answers: list[float] = []
        accepted = asyncio.run(send_reports(port, storm, answers))
        took = time.monotonic() - t0
        if accepted != len(storm):
            raise BenchError(f"the registry accepted {accepted} of {len(storm)} reports")
        wait_for("every ImexEnsemble READY", lambda: all(
            s.get("imexReady") == PER for s in statuses(url, token)), timeout=120, interval=0.5)
        after = quiet(port)
        reports = after["reports"] - before["reports"]
        writes = after["status"] - before["status"]
        results.set("host_status_writes_per_report_storm", writes / reports)
        results.set("host_status_writes_per_ensemble_storm", writes / ensembles)
        results.set("host_events_per_ensemble_storm",
                    (after["events"] - before["events"]) / ensembles)
        results.set("host_status_storm_spread_s", took)
        results.set("host_status_storm_answer_p50_s", percentile(answers, 50))
        results.set("host_status_storm_answer_p99_s", percentile(answers, 99))
        results.note("host_status_storm", f"{ensembles} ImexEnsembles x {PER} members, "
                     f"{int(reports)} reports sent within 0.9 s, all answered after "
                     f"{took:.2f} s (each stored in the API first), {int(writes)} status "
                     "writes")

        # Steady churn: the heartbeat, with a few states changing each round.
        state = {(e, i): "READY" for e in range(ensembles) for i in range(PER)}
        churn: list[tuple[float, int, int, str, int]] = []
        rounds = max(1, int(duration / REPORT_INTERVAL))
        for r in range(rounds):
            for (e, i), current in state.items():
                if rng.random() < CHURN:
                    current = "WAITING_FOR_PEERS" if current == "READY" else "READY"
                    state[(e, i)] = current
                churn.append((r * REPORT_INTERVAL + rng.uniform(0, REPORT_INTERVAL), e, i,
                              current, gens[e]))
        start = quiet(port)
        t0 = time.monotonic()
        accepted = asyncio.run(send_reports(port, churn))
        elapsed = time.monotonic() - t0
        end = quiet(port)
        reports = end["reports"] - start["reports"]
        writes = end["status"] - start["status"]
        if accepted != len(churn):
            raise BenchError(f"the registry accepted {accepted} of {len(churn)} reports")
        results.set("host_status_writes_per_report_churn", writes / reports)
        results.set("host_status_writes_per_s_churn", writes / elapsed)
        results.note("host_status_churn", f"{int(reports)} reports over {elapsed:.0f} s "
                     f"({CHURN:.0%} changing the IMEX state), {int(writes)} status writes")
