"""Host agent at fleet scale (issue 27): 25,200 VMIs in 1,400 ensembles of 18, a
100,000-GPU fleet of NVL72 racks (18 compute trays of 4 GPUs each).

The same three processes as ``host_scale`` (the API double pre-seeded, the real
``imex-host-agent`` with production settings, the load generator), and the same
slice watch. Figures:

- ``host_sync_25k_s`` (goal <= 12 s): agent spawn -> every slice holds its 18 members;
  ``host_sync_cpu_25k_s`` the agent's CPU over that span;
- ``host_rss_25k_mb`` (goal <= 300 MB): the agent's peak RSS (VmHWM) over the sync and
  a round of steady updates (one IP change for every ensemble, as fast as the API
  takes them), which is what one replica holds;
- ``fleet-real`` (``run_real``): the same against the real kube-apiserver and etcd of
  tests/realk8s, keys ``host_real_*_25k*``, printed beside, not goals.
"""

from __future__ import annotations

import contextlib
import tempfile
import time
from pathlib import Path

from tests.bench.common import PY, Results, cpu_seconds, free_port, peak_rss_mb, spawn, stop
from tests.bench.host_scale import (
    NotBuilt,
    _send,
    _updates,
    api_double,
    api_real,
    expected_pins,
)
from tests.bench.kube_proc import NAMESPACE, member_ip
from tests.bench.loadgen import raise_nofile
from tests.bench.slicewatch import SliceWatch

ENSEMBLES, PER = 1400, 18


def run(results: Results, *, quick: bool = False, api: str = "double") -> None:
    ensembles, per = (140, 18) if quick else (ENSEMBLES, PER)
    prefix = "host_real_" if api == "real" else "host_"
    raise_nofile(8192)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp, \
            contextlib.ExitStack() as stack:
        work = Path(tmp)
        log = work / "bench.log"
        target = stack.enter_context(api_real(ensembles, per, results) if api == "real"
                                     else api_double(work, ensembles, per, log))
        watch = SliceWatch(target.url, target.token, NAMESPACE, target.ca).start()
        agent = None
        try:
            ips = {(e, i): member_ip(e, i) for e in range(ensembles) for i in range(per)}
            watch.expect(expected_pins(ensembles, per, ips))
            port = free_port()
            started = time.monotonic()
            agent = spawn([PY, "-m", "host_agent.cli", "--kubeconfig", str(target.kubeconfig),
                           "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING"],
                          log=work / "agent.log")
            synced = watch.wait(f"{ensembles} slices", timeout=1800)
            results.set(f"{prefix}sync_25k_s", synced - started)
            results.set(f"{prefix}sync_cpu_25k_s", cpu_seconds(agent.pid))
            # one IP change for every ensemble, then the peak RSS of the whole run
            _send(work, target, _updates(ensembles, per, ensembles, 0), 60.0, ips, log)
            watch.expect(expected_pins(ensembles, per, ips))
            watch.wait("slices after one change per ensemble", timeout=600)
            results.set(f"{prefix}rss_25k_mb", peak_rss_mb(agent.pid))
            results.note(f"{prefix}fleet", f"{ensembles * per} VMIs in {ensembles} "
                         f"ensembles of {per} ({api} API)")
        finally:
            watch.close()
            if agent is not None:
                stop(agent)


def run_real(results: Results, *, quick: bool = False) -> None:
    """``fleet-real``: the same against tests/realk8s's kube-apiserver (skipped with a note
    where it is not built)."""
    try:
        run(results, quick=quick, api="real")
    except NotBuilt as exc:
        results.note("host_real_fleet", f"skipped: {exc}")
        print(f"   skipped: {exc}", flush=True)
