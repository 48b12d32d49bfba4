"""Benchmark ``ha``: electing host agents (issue 16).

Figures (keys ``ha_*``; goals where the issue gives one):
- ``ha_takeover_p50_s`` / ``ha_takeover_p99_s``: SIGKILL of the leader -> another
  replica leads (its ``imex_host_agent_leader`` is 1), over 20 failovers, with
  kube-controller-manager's 15/10/2 s, against the real kube-apiserver and etcd of
  tests/realk8s (skipped with a note where they are not built);
- ``ha_handover_p50_s`` / ``ha_handover_max_s``: the same after SIGTERM (the lease is
  released at once);
- ``ha_rolling_failed_requests`` (goal 0): guest-like long-poll clients (18 "guests"
  plus 1,000 parked long-polls) behind the kube-proxy stand-in on loopback, while all
  three replicas are replaced one by one and a VMI's IP keeps changing; a failed
  request is a connection error or non-200 answer a client could not ride out as a
  handover (asked again at once, through the Service), or an answer whose generation
  is below what the client holds (needs root and nft; else skipped with a note);
- ``ha_api_watches_{1,3}`` and ``ha_api_writes_{1,3}``: the apiserver's open watches
  of the agents and the writes they sent (EndpointSlices, Services, Leases,
  ConfigMaps) over one minute of the same VMI churn, with one replica and with three;
- ``ha_rss_mb_max`` (goal <= 150): each replica's peak RSS with 10,000 VMIs in 1,000
  ensembles (three electing replicas against the API double's process), beside the
  single agent's ``host_rss_mb``.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from tests.bench.common import (
    PY,
    REPO_ROOT,
    Results,
    free_port,
    peak_rss_mb,
    percentile,
    spawn,
    stop,
    wait_for,
)
from tests.bench.host_scale import NotBuilt

NS = "bench-ha"


def _metric(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(f"{url}/metrics", timeout=2) as r:
            text = r.read().decode()
    except OSError:
        return None
    for line in text.splitlines():
        head, _, value = line.rpartition(" ")
        if head == name:
            return float(value)
    return None


class Replicas:
    """Electing agents as processes; identities unique per start, as pod names are."""

    def __init__(self, kubeconfig: Path, work: Path, agent_ns: str,
                 lease: tuple[float, float, float] = (15, 10, 2), host: str = "127.0.0.1") -> None:
        self.kubeconfig, self.work, self.agent_ns, self.lease, self.host = (
            kubeconfig, work, agent_ns, lease, host)
        self.procs: dict[str, tuple[subprocess.Popen[bytes], str]] = {}
        self.n = 0

    def start(self, port: int | None = None, wait: bool = True) -> tuple[str, str]:
        self.n += 1
        ident = f"bench-{self.n}"
        port = port or free_port(self.host)
        url = f"http://{self.host}:{port}"
        lease, renew, retry = self.lease
        proc = spawn([PY, "-m", "tests.sandbox.host_agent_proc", "--kubeconfig",
                      str(self.kubeconfig), "--listen", f"{self.host}:{port}", "--json",
                      "--leader-elect", "--identity", ident, "--agent-namespace", self.agent_ns,
                      "--leader-elect-lease-duration", str(lease),
                      "--leader-elect-renew-deadline", str(renew),
                      "--leader-elect-retry-period", str(retry)],
                     log=self.work / f"{ident}.log")
        self.procs[ident] = (proc, url)
        if wait:
            wait_for(f"{ident} ready", lambda: _ready(url), 600)
        return ident, url

    def live(self) -> dict[str, tuple[subprocess.Popen[bytes], str]]:
        return {k: v for k, v in self.procs.items() if v[0].poll() is None}

    def leader(self, exclude: str = "", timeout: float = 120) -> str:
        def one() -> str | None:
            found = [k for k, (_, url) in self.live().items()
                     if k != exclude and _metric(url, "imex_host_agent_leader") == 1.0]
            return found[0] if len(found) == 1 else None
        return wait_for("one leader", one, timeout, interval=0.02)

    def kill(self, ident: str, sig: signal.Signals) -> None:
        proc, _ = self.procs[ident]
        proc.send_signal(sig)
        if sig == signal.SIGKILL:
            proc.wait(10)

    def close(self) -> None:
        for proc, _ in self.procs.values():
            stop(proc)


def _ready(url: str) -> bool | None:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
            return True if r.status == 200 else None
    except OSError:
        return None


def failovers(reps: Replicas, count: int, sig: signal.Signals) -> list[float]:
    took = []
    for _ in range(count):
        old = reps.leader()
        t0 = time.monotonic()
        reps.kill(old, sig)
        reps.leader(exclude=old)
        took.append(time.monotonic() - t0)
        if sig != signal.SIGKILL:
            reps.procs[old][0].wait(30)
        reps.start()  # the replacement pod
    return took


# -- the real control plane ---------------------------------------------------------------


def control_plane(work: Path) -> Any:
    from tests.realk8s.crd import kubevirt_openapi
    from tests.realk8s.harness import ControlPlane

    check = subprocess.run(["bash", str(REPO_ROOT / "tests/realk8s/build.sh"), "--check"],
                           capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise NotBuilt("the real control plane is not built: run 'bash tests/realk8s/build.sh'")
    cp = ControlPlane(bin_dir=Path(check.stdout.strip().splitlines()[-1]),
                      vmi_openapi=kubevirt_openapi(), workdir=work / "cp", audit=False)
    cp.start(api_only=True)
    return cp


def seed(cp: Any, ensembles: int, per: int) -> None:
    from tests.realk8s.fixtures import ensemble_service, vmi
    from tests.realk8s.kubeops import SERVICES, create_vmi

    admin = cp.admin
    admin.apply(f"/api/v1/namespaces/{NS}", {"apiVersion": "v1", "kind": "Namespace",
                                              "metadata": {"name": NS}})
    for e in range(ensembles):
        admin.create(SERVICES.format(ns=NS), ensemble_service(NS, f"e{e}", max_members=per))
        for i in range(per):
            create_vmi(admin, vmi(NS, f"e{e}-{i}", f"e{e}", ip=f"10.60.{e}.{i + 1}"))


def apiserver_counts(cp: Any) -> tuple[float, float]:
    """(open WATCH requests, writes to the agents' kinds) from kube-apiserver's /metrics."""
    text = cp.admin.request("GET", "/metrics").text
    watches = writes = 0.0
    for line in text.splitlines():
        if line.startswith("apiserver_longrunning_requests{") and 'verb="WATCH"' in line:
            watches += float(line.rsplit(" ", 1)[1])
        elif line.startswith("apiserver_request_total{"):
            verb = re.search(r'verb="([A-Z]+)"', line)
            res = re.search(r'resource="([a-z]+)"', line)
            if verb and res and verb.group(1) in ("POST", "PUT", "PATCH", "APPLY", "DELETE") \
                    and res.group(1) in ("endpointslices", "services", "leases", "configmaps"):
                writes += float(line.rsplit(" ", 1)[1])
    return watches, writes


def churn(cp: Any, seconds: float, ensembles: int) -> int:
    from tests.realk8s.kubeops import set_vmi_ip

    n, t0 = 0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        n += 1
        set_vmi_ip(cp.admin, NS, f"e{n % ensembles}-0", f"10.61.{n // 250 % 250}.{n % 250 + 1}")
        time.sleep(0.5)
    return n


def api_load(cp: Any, work: Path, results: Results, quick: bool) -> None:
    seconds = 10.0 if quick else 60.0
    w_base, _ = apiserver_counts(cp)  # the apiserver's own loopback watches
    results.set("ha_api_watches_base", w_base)
    for count in (1, 3):
        reps = Replicas(cp.admin_kubeconfig, work / f"load{count}", NS)
        (work / f"load{count}").mkdir()
        try:
            for _ in range(count):
                reps.start()
            reps.leader()
            time.sleep(3)
            _w0, x0 = apiserver_counts(cp)
            churn(cp, seconds, 10)
            w1, x1 = apiserver_counts(cp)
            results.set(f"ha_api_watches_{count}", w1 - w_base)
            results.set(f"ha_api_writes_{count}", x1 - x0)
        finally:
            reps.close()
        time.sleep(2)
    results.note("ha_api", f"open watches of the agents (the apiserver's own, "
                 f"{w_base:.0f}, subtracted) and writes to slices, Services, "
                 f"Leases and ConfigMaps during {seconds:g} s of one VMI change per 0.5 s")


# -- the rolling upgrade under long-polls ---------------------------------------------------


#: clients start spread over this many seconds, as guests do (none start in lockstep)
RAMP_S = 3.0


async def _client(url: str, path: str, until: float, counts: dict[str, int],
                  failures: list[tuple[float, str]], t_start: float, delay: float) -> None:
    """One guest's loop, with the guest's handover rules (docs/guest-agent.md).

    Every failure is kept as (seconds since the clients started, reason), so the
    harness can say when and why, beside the replacements' own times.
    """
    await asyncio.sleep(delay)
    held: int | None = None
    closing_or_dropped = False
    while time.monotonic() < until:
        q = f"{path}?wait={held}&timeout=10" if held is not None else path
        host, port = url.split("//")[1].split(":")
        stage = "connect"
        try:
            r, w = await asyncio.wait_for(asyncio.open_connection(host, int(port)), 2)
            stage = "read"
            w.write(f"GET {q} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n".encode())
            raw = await asyncio.wait_for(r.read(), 20)
            w.close()
            if not raw:
                raise ConnectionResetError("closed before any response")
            head, _, body = raw.partition(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            if status != 200:
                stage = f"HTTP {status}"
                raise ConnectionError(stage)
            counts["answers"] += 1
            gen = int(json.loads(body)["generation"])
            if held is not None and gen < held:
                counts["backwards"] += 1
                failures.append((round(time.monotonic() - t_start, 2), "backwards"))
            held = max(held or 0, gen)
            closing_or_dropped = b"x-imex-registry: closing" in head.lower()
        except (TimeoutError, OSError, ValueError, IndexError) as exc:
            if closing_or_dropped or isinstance(exc, ConnectionResetError):
                closing_or_dropped = False  # a handover: asked again at once, not counted
                counts["handovers"] += 1
                continue
            counts["failed"] += 1
            kind = ("timeout" if isinstance(exc, TimeoutError) else
                    "refused" if isinstance(exc, ConnectionRefusedError) else
                    type(exc).__name__)
            reason = stage if stage.startswith("HTTP") else f"{stage} {kind}"
            failures.append((round(time.monotonic() - t_start, 2), reason))
            await asyncio.sleep(0.2)


async def _clients(url: str, path: str, n: int, seconds: float) -> dict[str, Any]:
    counts = {"answers": 0, "failed": 0, "backwards": 0, "handovers": 0}
    failures: list[tuple[float, str]] = []
    t_start = time.monotonic()
    until = t_start + seconds
    await asyncio.gather(*(_client(url, path, until, counts, failures, t_start,
                                   RAMP_S * k / max(1, n)) for k in range(n)))
    return {"counts": counts, "failures": failures}


def clients_main(argv: list[str]) -> int:
    from tests.bench.loadgen import raise_nofile

    raise_nofile(4 * int(argv[2]) + 256)
    print(json.dumps(asyncio.run(_clients(argv[0], argv[1], int(argv[2]), float(argv[3])))),
          flush=True)
    return 0


def failure_summary(failures: list[tuple[float, str]], steps: list[tuple[float, float]]
                    ) -> dict[str, dict[str, int]]:
    """Failures by reason, split into before the first replacement, during one (from
    its new replica's start to the old one's exit, plus 2 s), and otherwise."""
    out: dict[str, dict[str, int]] = {"before": {}, "during": {}, "between": {}}
    first = steps[0][0] if steps else float("inf")
    for t, reason in failures:
        phase = ("before" if t < first else
                 "during" if any(a <= t <= b + 2.0 for a, b in steps) else "between")
        out[phase][reason] = out[phase].get(reason, 0) + 1
    return out


def rolling(cp: Any, work: Path, results: Results, quick: bool) -> None:
    from tests.sandbox.balancer import Backend, Balancer

    if os.geteuid() != 0 or shutil.which("nft") is None:
        results.note("ha_rolling", "skipped: needs root and nft (the kube-proxy stand-in)")
        return
    (work / "rolling").mkdir()
    reps = Replicas(cp.admin_kubeconfig, work / "rolling", NS, lease=(15, 10, 2))
    lb: Balancer | None = None
    clients = None
    try:
        for _ in range(3):
            reps.start()
        vip = free_port()
        lb = Balancer.over("127.0.0.1", vip, [("127.0.0.1", int(u.rsplit(":", 1)[1]))
                                               for _, u in reps.procs.values()])
        lb.start()
        n = 118 if quick else 1018
        seconds = 40.0 if quick else 90.0
        t_clients = time.monotonic()
        clients = subprocess.Popen([PY, "-m", "tests.bench.ha_bench", "clients",
                                    f"http://127.0.0.1:{vip}", f"/v1/ensembles/{NS}/e0", str(n),
                                    str(seconds)], stdout=subprocess.PIPE, cwd=REPO_ROOT)
        time.sleep(8)
        steps: list[tuple[float, float]] = []  # (start, end) of each replacement, clients' clock
        for ident in list(reps.live()):
            began = time.monotonic() - t_clients
            _, url = reps.start()
            lb.backends.append(Backend("127.0.0.1", int(url.rsplit(":", 1)[1])))
            wait_for("new replica in the balancer", lambda: (len(lb.backends) - 1) in lb.ready()
                     or None, 30)
            churn(cp, 1.0, 1)
            reps.kill(ident, signal.SIGTERM)
            reps.procs[ident][0].wait(30)
            steps.append((began, time.monotonic() - t_clients))
            churn(cp, 3.0, 1)
        out, _ = clients.communicate(timeout=seconds + 60)
        got = json.loads(out.decode().strip().splitlines()[-1])
        counts, failures = got["counts"], got["failures"]
        results.set("ha_rolling_failed_requests", counts["failed"] + counts["backwards"])
        by_phase = failure_summary([(t, r) for t, r in failures], steps)
        for phase, reasons in by_phase.items():
            results.set(f"ha_rolling_failed_{phase}", sum(reasons.values()))
        results.note("ha_rolling", f"{n} long-poll clients (18 guests + 1,000 parked, started "
                     f"over {RAMP_S:g} s), 3 replicas replaced one by one at "
                     f"{', '.join(f'{a:.1f}-{b:.1f} s' for a, b in steps)}: {counts}; "
                     f"failures by phase and reason: {by_phase}")
    finally:
        if clients is not None and clients.poll() is None:
            clients.kill()
        if lb is not None:
            lb.close()
        reps.close()


# -- memory -------------------------------------------------------------------------------


def memory(work: Path, results: Results, quick: bool) -> None:
    from tests.bench.host_scale import api_double

    ensembles, per = (100, 10) if quick else (1000, 10)
    (work / "mem").mkdir()
    with api_double(work / "mem", ensembles, per, work / "mem" / "api.log") as api:
        from tests.bench.kube_proc import NAMESPACE

        reps = Replicas(api.kubeconfig, work / "mem", NAMESPACE)
        try:
            for _ in range(3):
                reps.start(wait=False)
            for ident, (_, url) in reps.procs.items():
                wait_for(f"{ident} ready", lambda url=url: _ready(url), 900)
            reps.leader(timeout=300)
            time.sleep(5)
            rss = {k: peak_rss_mb(p.pid) for k, (p, _) in reps.live().items()}
        finally:
            reps.close()
    results.set("ha_rss_mb_max", max(rss.values()))
    results.note("ha_rss", f"peak RSS per replica, {ensembles * per} VMIs in {ensembles} "
                 f"ensembles: " + ", ".join(f"{v:.0f} MB" for v in rss.values()))


def run_memory(results: Results, *, quick: bool = False) -> None:
    """Only ``ha_rss_mb_max`` (benchmark ``ha-memory``): about a minute, no control plane."""
    work = Path(tempfile.mkdtemp(prefix="bench-ha-"))
    try:
        memory(work, results, quick)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def run(results: Results, *, quick: bool = False) -> None:
    work = Path(tempfile.mkdtemp(prefix="bench-ha-"))
    try:
        memory(work, results, quick)
        try:
            cp = control_plane(work)
        except NotBuilt as exc:
            results.note("ha", f"takeover, handover, rolling and API load skipped: {exc}")
            return
        try:
            seed(cp, 10, 4)
            (work / "elect").mkdir()
            reps = Replicas(cp.admin_kubeconfig, work / "elect", NS)
            try:
                for _ in range(3):
                    reps.start()
                took = failovers(reps, 3 if quick else 20, signal.SIGKILL)
                results.set("ha_takeover_p50_s", statistics.median(took))
                results.set("ha_takeover_p99_s", percentile(took, 99))
                handed = failovers(reps, 2 if quick else 5, signal.SIGTERM)
                results.set("ha_handover_p50_s", statistics.median(handed))
                results.set("ha_handover_max_s", max(handed))
            finally:
                reps.close()
            rolling(cp, work, results, quick)
            api_load(cp, work, results, quick)
        finally:
            cp.stop()
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    if sys.argv[1:2] == ["clients"]:
        sys.exit(clients_main(sys.argv[2:]))
    sys.exit(2)
