"""API writes of the host agent, counted at the API double (issue 27), and the ImexEnsemble
fleet's sync. Part of the ``host`` benchmark; printed beside its other figures.

A level-triggered controller writes what differs and nothing else. The double counts
every request it serves (``GET /_sandbox/counters``: per resource and verb, as an
audit log would), so the figures are what the API received, not what the agent
believes it sent:

- ``host_sync_writes_per_ensemble`` (goal <= 2.0): API writes of the first sync of a
  fleet never published (1,000 Service-only ensembles), per ensemble: the generation
  pair on the Service and the slice. Events apart: ``host_sync_events_per_ensemble``.
  The breakdown per resource is a note.
- ``host_restart_writes`` (goal 0): a new agent process over the same fleet, published
  and unchanged: writes from its start until it has been quiet (no write) for
  ``QUIET_S``, Lease writes excluded (there are none without ``--leader-elect``).
- ``host_takeover_writes`` (goal 0): two electing replicas over the same fleet; the
  leader is killed (SIGKILL) and the follower takes over: writes from the kill until
  quiet, Lease writes excluded.
- Not writes, in every figure above: SelfSubjectAccessReviews. The agent's start-up
  checks ask the API what it may do (one review per right, as ``kubectl auth can-i``
  does); the API answers a review and stores nothing. They are counted apart and
  printed (``host_restart_access_reviews``), so a check that asks more each start shows.
- ``host_sync_10k_cr_s`` / ``host_sync_writes_per_cr_ensemble`` (printed beside, not
  goals this round): the same sync for 1,000 ImexEnsembles of 10 VMIs (the agent
  creates each Service, writes the slice and the status that holds the pair).
"""

from __future__ import annotations

import contextlib
import json
import signal
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
    cpu_seconds,
    free_port,
    read_line,
    spawn,
    stop,
    wait_for,
)
from tests.bench.kube_proc import NAMESPACE, member_ip

WRITE_VERBS = frozenset({"create", "update", "patch", "apply", "delete"})
#: How long no write must come before the agent counts as done writing.
QUIET_S = 3.0


def counters(url: str, token: str) -> dict[str, dict[str, int]]:
    """Requests the double served so far: resource -> verb -> count."""
    req = urllib.request.Request(f"{url}/_sandbox/counters",
                                 headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        out: dict[str, dict[str, int]] = json.loads(r.read())["requests"]
        return out


def writes_by_resource(counts: dict[str, dict[str, int]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for resource, verbs in counts.items():
        n = sum(v for verb, v in verbs.items() if verb in WRITE_VERBS)
        if n:
            out[resource] = n
    return out


def writes_now(url: str, token: str) -> dict[str, int]:
    """Writes by resource the double has served so far."""
    return writes_by_resource(counters(url, token))


def diff(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: v - before.get(k, 0) for k, v in after.items() if v - before.get(k, 0)}


def quiet_writes(url: str, token: str, *, quiet: float = QUIET_S,
                 timeout: float = 300.0) -> dict[str, int]:
    """Writes by resource once no write but a Lease renewal has come for ``quiet`` s."""
    deadline = time.monotonic() + timeout
    last = writes_now(url, token)
    since = time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = writes_now(url, token)
        if _no_lease(now) != _no_lease(last):
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return now
    raise BenchError(f"the agent's writes never stopped: {last}")


#: POSTs that store nothing: the API answers an access review and keeps no object
REVIEWS = ("selfsubjectaccessreviews",)


def _no_lease(writes: dict[str, int]) -> dict[str, int]:
    return {k: v for k, v in writes.items() if k.split("/")[0] not in ("leases", *REVIEWS)}


def reviews(writes: dict[str, int]) -> int:
    return sum(v for k, v in writes.items() if k.split("/")[0] in REVIEWS)


#: written by the load generator (VMI status: the updates), never by the agent
NOT_AGENT = ("virtualmachineinstances",)


def split(writes: dict[str, int]) -> tuple[int, int]:
    """(the agent's writes without Events, Leases and access reviews, Events)."""
    events = sum(v for k, v in writes.items() if k.split("/")[0] == "events")
    other = sum(v for k, v in writes.items()
                if k.split("/")[0] not in ("events", "leases", *REVIEWS, *NOT_AGENT))
    return other, events


def breakdown(writes: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(writes.items())) or "none"


def ready(port: int) -> bool | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2) as r:
            return True if r.status == 200 else None
    except OSError:
        return None


def agent(kubeconfig: Path, log: Path, *extra: str) -> tuple[Any, int]:
    port = free_port()
    proc = spawn([PY, "-m", "host_agent.cli", "--kubeconfig", str(kubeconfig),
                  "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING", *extra], log=log)
    return proc, port


def restart_writes(results: Results, url: str, token: str, kubeconfig: Path,
                   work: Path) -> None:
    """``host_restart_writes``: a new agent over the published, unchanged fleet."""
    before = writes_now(url, token)
    proc, port = agent(kubeconfig, work / "agent-restart.log")
    try:
        wait_for("the restarted agent ready", lambda: ready(port), timeout=600, interval=0.2)
        made = diff(quiet_writes(url, token), before)
    finally:
        stop(proc)
    other, events = split(made)
    results.set("host_restart_writes", other + events)
    results.set("host_restart_access_reviews", reviews(made))
    results.note("host_restart_writes", f"a new agent over the published fleet wrote: "
                 f"{breakdown(made)}")


def takeover_writes(results: Results, url: str, token: str, kubeconfig: Path,
                    work: Path) -> None:
    """``host_takeover_writes``: the follower of two electing replicas takes over."""
    from tests.bench.ha_bench import Replicas

    reps = Replicas(kubeconfig, work, NAMESPACE, lease=(4, 3, 1))
    try:
        for _ in range(2):
            reps.start(wait=False)
        for ident, (_, rurl) in list(reps.procs.items()):
            wait_for(f"{ident} ready", lambda u=rurl: _url_ready(u), 600, interval=0.2)
        old = reps.leader(timeout=300)
        quiet_writes(url, token)  # the first leader's own start is not the figure
        before = writes_now(url, token)
        reps.kill(old, signal.SIGKILL)
        new = reps.leader(exclude=old, timeout=120)
        made = diff(quiet_writes(url, token), before)
    finally:
        reps.close()
    other, events = split(made)
    results.set("host_takeover_writes", other + events)
    results.note("host_takeover_writes", f"{new} took over from {old} (SIGKILL); writes "
                 f"but Leases: {breakdown({k: v for k, v in made.items() if k != 'leases'})}")


def _url_ready(url: str) -> bool | None:
    try:
        with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
            return True if r.status == 200 else None
    except OSError:
        return None


@contextlib.contextmanager
def cr_double(work: Path, ensembles: int, per: int) -> Iterator[tuple[str, str, Path]]:
    kubeconfig = work / "kubeconfig-crfleet"
    proc = spawn([PY, "-m", "tests.bench.kube_proc", "--kubeconfig-out", str(kubeconfig),
                  "--ensembles", str(ensembles), "--per", str(per), "--imexensembles"],
                 log=work / "kube-crfleet.log", stdout_pipe=True)
    try:
        ready_line = read_line(proc, "kube-api ready", timeout=300)
        kv = dict(item.split("=", 1) for item in ready_line.split()[2:])
        yield kv["url"], kv["token"], kubeconfig
    finally:
        stop(proc)


def cr_fleet(results: Results, *, quick: bool = False) -> None:
    """``host_sync_10k_cr_s`` and ``host_sync_writes_per_cr_ensemble``."""
    from tests.bench.host_scale import expected_pins
    from tests.bench.slicewatch import SliceWatch

    ensembles, per = (100, 10) if quick else (1000, 10)
    with tempfile.TemporaryDirectory(prefix="bench-crfleet-") as tmp:
        work = Path(tmp)
        with cr_double(work, ensembles, per) as (url, token, kubeconfig):
            watch = SliceWatch(url, token, NAMESPACE).start()
            proc = None
            try:
                ips = {(e, i): member_ip(e, i) for e in range(ensembles) for i in range(per)}
                watch.expect(expected_pins(ensembles, per, ips))
                started = time.monotonic()
                proc, _port = agent(kubeconfig, work / "agent-crfleet.log")
                synced = watch.wait(f"{ensembles} slices of ImexEnsembles", timeout=900)
                results.set("host_sync_10k_cr_s", synced - started)
                results.set("host_sync_cpu_cr_s", cpu_seconds(proc.pid))
                made = quiet_writes(url, token)
            finally:
                watch.close()
                if proc is not None:
                    stop(proc)
    other, events = split(made)
    results.set("host_sync_writes_per_cr_ensemble", other / ensembles)
    results.set("host_sync_events_per_cr_ensemble", events / ensembles)
    results.note("host_sync_cr", f"{ensembles} ImexEnsembles x {per} VMIs, first sync "
                 f"wrote: {breakdown(made)}")
