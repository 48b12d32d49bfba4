"""Host agent at scale: 10,000 VMIs in 1,000 ensembles against the API double, and
(``run_real``, benchmark ``host-real``) against a real kube-apiserver and etcd.

Three processes, so none steals the others' interpreter: the API double
(``kube_proc``, pre-seeded), the real ``imex-host-agent`` (production
settings, only ``--kubeconfig`` and ``--listen`` given), and for updates the
load generator (``loadgen patch``). The harness follows the slices with one
watch (``slicewatch``).

Figures:
- ``host_sync_10k_s``: from spawning the agent process (interpreter start and
  imports included) to the last of the 1,000 slices holding all its members,
  as the double stored them.
- ``host_updates_per_s``: the load generator changes VMI IPs (one status
  merge-patch each, spread over every ensemble, as fast as the double accepts
  them); figure = updates / (first update sent -> every slice holds the final
  IPs). Extras: the rate the double accepted (``host_updates_offered_per_s``)
  and the lag after the last update; and ``host_updates_backlog_per_s``: the
  same updates sent while the agent is stopped (SIGSTOP) and drained after
  SIGCONT, which is the agent's own ceiling when the double is not feeding it.
- ``host_rss_mb``: the agent's peak RSS (VmHWM) over the whole run.
- ``host_status_writes_per_report_storm`` / ``_churn`` (and friends): ImexEnsemble
  status writes per guest report, from ``status_writes`` (its own fleet of
  ImexEnsembles, run after the figures above).
- ``host_sync_writes_per_ensemble``, ``host_sync_events_per_ensemble``,
  ``host_restart_writes``, ``host_takeover_writes`` and the ImexEnsemble fleet's
  ``host_sync_10k_cr_s``: API writes counted at the double (``host_writes``).

``profile="wall"`` runs the agent under pyinstrument (wall-clock samples),
``profile="cpu"`` under cProfile with a CPU-time clock (``cpu_profile``); either
writes a text report next to the results (``bench-profile-host.txt``). On a
loaded machine the CPU view is the one to trust.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from imex_shared.model import EnsembleId
from tests.bench import host_writes
from tests.bench.common import (
    PY,
    REPO_ROOT,
    BenchError,
    Results,
    cpu_seconds,
    free_port,
    peak_rss_mb,
    read_line,
    rss_by_mapping,
    rss_mb,
    spawn,
    stop,
    wait_for,
)
from tests.bench.kube_proc import NAMESPACE, fleet, member_ip
from tests.bench.loadgen import raise_nofile, send_all
from tests.bench.slicewatch import Pins, SliceWatch


def expected_pins(ensembles: int, per: int, ips: dict[tuple[int, int], str]) -> Pins:
    out: Pins = {}
    for e in range(ensembles):
        ens = EnsembleId(NAMESPACE, f"e{e}")
        out[f"e{e}-imex"] = {ens.slot(i): ips[(e, i)] for i in range(per)}
    return out


def _updates(ensembles: int, per: int, count: int, round_: int) -> list[tuple[int, int, str]]:
    """``count`` IP changes (ensemble, member, new IP) spread over every ensemble."""
    out = []
    for k in range(count):
        e, i = k % ensembles, (k // ensembles) % per
        out.append((e, i, member_ip(e, i, round_ + k // (ensembles * per) + 1)))
    return out


def _send(workdir: Path, api: ApiTarget, updates: list[tuple[int, int, str]],
          seconds: float, ips: dict[tuple[int, int], str], log: Path) -> dict[str, Any]:
    """Send for at most ``seconds``; ``ips`` gets the updates that were sent."""
    path = workdir / "updates.json"
    path.write_text(json.dumps([(f"e{e}-{i}", ip) for e, i, ip in updates]))
    argv = [PY, "-m", "tests.bench.loadgen", "patch", "--api", api.url, "--token", api.token,
            "--updates", str(path), "--connections", "8", "--seconds", str(seconds)]
    if api.ca is not None:
        argv += ["--ca", api.ca]
    gen = spawn(argv, log=log, stdout_pipe=True)
    try:
        line = read_line(gen, "{", timeout=seconds + 300)
    finally:
        stop(gen)
    out: dict[str, Any] = json.loads(line)
    if out["errors"]:
        raise BenchError(f"the API refused {out['errors']} of {out['sent']} updates "
                         f"(see {log})")
    for e, i, ip in updates[: out["sent"]]:
        ips[(e, i)] = ip
    return out


class NotBuilt(BenchError):
    """tests/realk8s's binaries are not in the cache: the real-API run is skipped."""


@dataclass(frozen=True)
class ApiTarget:
    """Where the fleet lives: URL, bearer token, kubeconfig for the agent, CA for https."""

    url: str
    token: str
    kubeconfig: Path
    ca: str | None = None
    #: the API double's process (None: a real apiserver, which runs as several)
    pid: int | None = None


@contextlib.contextmanager
def api_double(work: Path, ensembles: int, per: int, log: Path) -> Iterator[ApiTarget]:
    """The Python API double in its own process, pre-seeded (``kube_proc``)."""
    kubeconfig = work / "kubeconfig"
    proc = spawn([PY, "-m", "tests.bench.kube_proc", "--kubeconfig-out", str(kubeconfig),
                  "--ensembles", str(ensembles), "--per", str(per)],
                 log=log, stdout_pipe=True)
    try:
        ready = dict(kv.split("=", 1) for kv in
                     read_line(proc, "kube-api ready", timeout=300).split()[2:])
        yield ApiTarget(ready["url"], ready["token"], kubeconfig, pid=proc.pid)
    finally:
        stop(proc)


@contextlib.contextmanager
def api_real(ensembles: int, per: int, results: Results) -> Iterator[ApiTarget]:
    """etcd and kube-apiserver built by tests/realk8s (no audit log), the VMI CRD, and the
    fleet written through the API as KubeVirt would (create, then the status subresource).

    Needs the binaries already built (``bash tests/realk8s/build.sh``; a cold build takes
    about 20 minutes, so the benchmark does not start one)."""
    import subprocess

    from tests.realk8s.crd import kubevirt_openapi
    from tests.realk8s.harness import ControlPlane

    check = subprocess.run(["bash", str(REPO_ROOT / "tests/realk8s/build.sh"), "--check"],
                           capture_output=True, text=True, check=False)
    if check.returncode != 0:
        raise NotBuilt("the real control plane is not built: run "
                       "'bash tests/realk8s/build.sh' once (about 20 min cold)")
    bin_dir = Path(check.stdout.strip().splitlines()[-1])
    cp = ControlPlane(bin_dir=bin_dir, vmi_openapi=kubevirt_openapi(), audit=False)
    try:
        cp.start(api_only=True)
        target = ApiTarget(cp.server, cp.admin_token, cp.admin_kubeconfig, str(cp.ca))
        t0 = time.monotonic()
        errors: list[str] = []
        for phase in fleet_requests(ensembles, per):
            errors += asyncio.run(send_all(target.url, target.token, phase, connections=16,
                                           ca=target.ca)).errors
        if errors:
            raise BenchError(f"seeding the fleet: {len(errors)} errors, e.g. {errors[:2]}")
        results.note("host_real_seed", f"{ensembles * per} VMIs and {ensembles} Services "
                     f"written in {time.monotonic() - t0:.1f} s; kube-apiserver and etcd "
                     f"from {bin_dir}")
        yield target
    finally:
        cp.stop()


def fleet_requests(ensembles: int, per: int) -> list[list[tuple[str, str, Any]]]:
    """The fleet of ``kube_proc`` as API requests, in phases that must not overlap: the
    namespace; Services and VMIs; the VMIs' status (a subresource: ignored on create)."""
    vmis = f"/apis/kubevirt.io/v1/namespaces/{NAMESPACE}/virtualmachineinstances"
    phases: list[list[tuple[str, str, Any]]] = [[], [], []]
    for obj in fleet(ensembles, per):
        obj["metadata"].pop("uid", None)  # the apiserver assigns it
        kind = obj["kind"]
        if kind == "Namespace":
            phases[0].append(("POST", "/api/v1/namespaces", obj))
        elif kind == "Service":
            phases[1].append(("POST", f"/api/v1/namespaces/{NAMESPACE}/services", obj))
        else:
            status = obj.pop("status")
            phases[1].append(("POST", vmis, obj))
            phases[2].append(("PATCH", f"{vmis}/{obj['metadata']['name']}/status",
                              {"status": status}))
    return phases


def run(results: Results, *, quick: bool = False, profile: str | None = None,
        out_dir: Path = REPO_ROOT, api: str = "double") -> None:
    """``api``: "double" (the goal figures) or "real" (keys ``host_real_*``)."""
    ensembles, per = (100, 10) if quick else (1000, 10)
    n_updates = 1000 if quick else 10_000
    send_s = 5.0 if quick else 30.0
    prefix = "host_real_" if api == "real" else "host_"

    def put(key: str, value: float | None) -> None:
        results.set(prefix + key.removeprefix("host_"), value)

    raise_nofile(8192)
    with tempfile.TemporaryDirectory(prefix="bench-host-") as tmp, contextlib.ExitStack() as stack:
        work = Path(tmp)
        log = work / "bench.log"
        target = stack.enter_context(api_real(ensembles, per, results) if api == "real"
                                     else api_double(work, ensembles, per, log))
        agent = None
        watch = None
        prof_out = out_dir / f"bench-profile-{prefix.rstrip('_')}.txt"
        session = work / "host.pyisession"
        pstats_path = work / "host.pstats"
        try:
            watch = SliceWatch(target.url, target.token, NAMESPACE, target.ca).start()
            ips = {(e, i): member_ip(e, i) for e in range(ensembles) for i in range(per)}
            watch.expect(expected_pins(ensembles, per, ips))
            port = free_port()
            argv = [PY, "-m", "host_agent.cli", "--kubeconfig", str(target.kubeconfig),
                    "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"]
            if profile == "wall":
                argv = [PY, "-m", "pyinstrument", "-r", "pyisession", "-o", str(session),
                        "-m", "host_agent.cli", *argv[3:]]
            elif profile == "cpu":
                argv = [PY, "-m", "tests.bench.cpu_profile", str(pstats_path), *argv[3:]]
            started = time.monotonic()
            agent = spawn(argv, log=work / "agent.log")
            synced_at = watch.wait(f"{ensembles} slices", timeout=900)
            sync_s = synced_at - started
            cpu_synced = cpu_seconds(agent.pid)
            put("host_sync_10k_s", sync_s)
            put("host_sync_cpu_s", cpu_synced)
            ready_at = wait_for("registry /readyz", lambda: _ready(port), timeout=60)
            put("host_rss_after_sync_mb", rss_mb(agent.pid))
            results.note(f"{prefix}rss_mappings", "largest parts of the agent's RSS after "
                         "sync: " + ", ".join(f"{os.path.basename(n)} {mb:.1f} MB"
                                              for n, mb in rss_by_mapping(agent.pid)))
            if api == "double":  # what the first sync wrote, counted by the API (issue 27)
                made = host_writes.quiet_writes(target.url, target.token)
                other, events = host_writes.split(made)
                put("host_sync_writes_per_ensemble", other / ensembles)
                put("host_sync_events_per_ensemble", events / ensembles)
                results.note("host_sync_writes", f"first sync of {ensembles} Service-only "
                             f"ensembles wrote: {host_writes.breakdown(made)}")

            # Steady: updates as fast as the API accepts them.
            writes_before = (host_writes.writes_now(target.url, target.token)
                             if api == "double" else {})
            cpu_before = cpu_seconds(agent.pid)
            sent = _send(work, target, _updates(ensembles, per, n_updates, 0), send_s, ips, log)
            n = sent["sent"]
            watch.expect(expected_pins(ensembles, per, ips))
            done = watch.wait("slices after updates", timeout=600)
            per_update = (cpu_seconds(agent.pid) - cpu_before) / n
            put("host_update_cpu_ms", per_update * 1000)
            put("host_updates_per_cpu_s", 1 / per_update if per_update else None)
            put("host_updates_per_s", n / (done - sent["first"]))
            put("host_updates_offered_per_s", n / (sent["last"] - sent["first"]))
            put("host_updates_lag_ms", (done - sent["last"]) * 1000)
            put("host_updates_sent", n)
            if api == "double":  # writes the agent made per update: how much it coalesced
                made = host_writes.diff(host_writes.writes_now(target.url, target.token),
                                        writes_before)
                put("host_update_writes_per_update", host_writes.split(made)[0] / n)
                results.note("host_update_writes", f"steady updates: {n} sent; writes "
                             f"{host_writes.breakdown(made)}")

            put("host_rss_peak_before_backlog_mb", peak_rss_mb(agent.pid))

            # Backlog: the same number of updates queued while the agent is stopped.
            agent.send_signal(signal.SIGSTOP)
            try:
                n = _send(work, target, _updates(ensembles, per, n_updates, 3), send_s, ips,
                          log)["sent"]
                watch.expect(expected_pins(ensembles, per, ips))
            finally:
                resumed = time.monotonic()
                agent.send_signal(signal.SIGCONT)
            cpu_before = cpu_seconds(agent.pid)
            done = watch.wait("slices after the backlog", timeout=600)
            put("host_backlog_update_cpu_ms", (cpu_seconds(agent.pid) - cpu_before) / n * 1000)
            put("host_updates_backlog_per_s", n / (done - resumed))
            put("host_rss_mb", peak_rss_mb(agent.pid))
            results.note(prefix.rstrip("_"), f"{ensembles * per} VMIs / {ensembles} ensembles "
                         f"({api} API); sync {sync_s:.2f} s (readyz at "
                         f"{ready_at - started:.2f} s)")
        finally:
            if watch is not None:
                watch.close()
            if agent is not None:
                stop(agent, timeout=60 if profile else 10)
        if api == "double":  # the fleet is published and unchanged now
            host_writes.restart_writes(results, target.url, target.token, target.kubeconfig,
                                       work)
            host_writes.takeover_writes(results, target.url, target.token,
                                        target.kubeconfig, work)
        if profile == "wall" and session.exists():
            write_profile(session, prof_out)
            results.note(f"{prefix}profile", str(prof_out))
        elif profile == "cpu" and pstats_path.exists():
            write_cpu_profile(pstats_path, prof_out)
            results.note(f"{prefix}profile", str(prof_out))
    if api == "double":
        # issue 15: API writes per guest report (ImexEnsemble status), beside the rest
        from tests.bench import status_writes

        status_writes.run(results, quick=quick)
        host_writes.cr_fleet(results, quick=quick)


def run_real(results: Results, *, quick: bool = False, profile: str | None = None,
             out_dir: Path = REPO_ROOT) -> None:
    """The same figures against a real kube-apiserver and etcd: ``host_real_*``.

    Skipped, with a note, where tests/realk8s has not been built: the goals are judged on
    the double's run, so this one is a comparison, not a gate."""
    try:
        run(results, quick=quick, profile=profile, out_dir=out_dir, api="real")
    except NotBuilt as exc:
        results.note("host_real", f"skipped: {exc}")
        print(f"   skipped: {exc}", flush=True)


def write_cpu_profile(pstats_path: Path, out: Path) -> None:
    import io
    import pstats

    buf = io.StringIO()
    stats = pstats.Stats(str(pstats_path), stream=buf)
    buf.write("== CPU seconds (time.process_time), by own time\n")
    stats.sort_stats("tottime").print_stats(40)
    buf.write("\n== by cumulative time\n")
    stats.sort_stats("cumulative").print_stats(60)
    out.write_text(buf.getvalue())


def write_profile(session_path: Path, out: Path) -> None:
    """The agent's profile as text: functions by own time, then the call tree."""
    from pyinstrument.renderers import ConsoleRenderer
    from pyinstrument.session import Session

    session = Session.load(str(session_path))
    flat = ConsoleRenderer(flat=True, unicode=False, color=False).render(session)
    tree = ConsoleRenderer(unicode=False, color=False).render(session)
    out.write_text("== own time per function (top of the list dominates)\n"
                   + "\n".join(flat.splitlines()[:60]) + "\n\n== call tree\n" + tree)


def _ready(port: int) -> float | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as resp:
            return time.monotonic() if resp.status == 200 else None
    except (OSError, ValueError):
        return None
