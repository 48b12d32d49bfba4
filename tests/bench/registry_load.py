"""Registry load: GET throughput of one ensemble, and 5,000 parked long-polls.

Processes: the API double (``kube_proc``, 10 ensembles of 18 Running VMIs),
the real ``imex-host-agent`` serving the registry, and the load generator
(``loadgen``) in its own process, so the figure is what a separate client
gets over loopback TCP, not what the server could do in-process.

Figures:
- ``registry_get_per_s``: keep-alive GETs of ``/v1/ensembles/bench/e0`` (the
  full JSON) on 32 connections for 10 s; requests answered 200 per second.
  The load generator's latency percentiles are extras.
- ``longpoll_5000_last_answer_ms``: 5,000 connections each park
  ``GET ...?wait=<generation>&timeout=60`` (the registry's cap; a poll that
  times out before the change is made again, as a guest would); once the agent's
  ``imex_registry_longpoll_waiters`` gauge shows all of them, one VMI's IP is
  patched at the double; the figure runs from sending that patch to the
  arrival of the last of the 5,000 answers at the load generator (so it
  includes the watch event, the reconciler's settle time and the wake-up).
  ``longpoll_first_answer_ms`` is the same to the first answer.
"""

from __future__ import annotations

import json
import re
import tempfile
import time
import urllib.request
from pathlib import Path

from tests.bench.common import (
    PY,
    REPO_ROOT,
    BenchError,
    Results,
    free_port,
    get_load,
    http_json,
    read_line,
    spawn,
    stop,
    wait_for,
)
from tests.bench.host_scale import write_cpu_profile
from tests.bench.kube_proc import NAMESPACE, member_ip
from tests.bench.loadgen import raise_nofile


def _text(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return str(resp.read().decode())


def _waiters(port: int) -> float:
    """The agent's parked long-poll gauge; 0 while it is too busy to answer."""
    try:
        text = _text(f"http://127.0.0.1:{port}/metrics")
    except (OSError, ValueError):  # includes timeouts while 5,000 requests arrive
        return 0.0
    m = re.search(r"^imex_registry_longpoll_waiters (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def patch_vmi_ip(api: str, token: str, name: str, ip: str) -> None:
    body = json.dumps({"status": {"interfaces": [{
        "name": "default", "ipAddress": ip, "ipAddresses": [ip], "mac": "02:00:00:00:00:01",
        "infoSource": "domain, guest-agent", "podInterfaceName": "eth0"}]}}).encode()
    req = urllib.request.Request(
        f"{api}/apis/kubevirt.io/v1/namespaces/{NAMESPACE}/virtualmachineinstances/{name}/status",
        data=body, method="PATCH",
        headers={"Content-Type": "application/merge-patch+json",
                 "Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        if resp.status != 200:
            raise BenchError(f"patch {name}: HTTP {resp.status}")


def run(results: Results, *, quick: bool = False, profile: str | None = None) -> None:
    seconds = 1.0 if quick else 10.0
    polls = 100 if quick else 5000
    raise_nofile(polls * 2 + 1024)  # the agent inherits it: one socket per long-poll
    with tempfile.TemporaryDirectory(prefix="bench-registry-") as tmp:
        work = Path(tmp)
        kubeconfig = work / "kubeconfig"
        api_proc = spawn([PY, "-m", "tests.bench.kube_proc", "--kubeconfig-out", str(kubeconfig),
                          "--ensembles", "10", "--per", "18"], log=work / "api.log",
                         stdout_pipe=True)
        agent = None
        try:
            ready = dict(kv.split("=", 1) for kv in
                         read_line(api_proc, "kube-api ready", timeout=120).split()[2:])
            api, token = ready["url"], ready["token"]
            port = free_port()
            flags = ["--kubeconfig", str(kubeconfig), "--listen", f"127.0.0.1:{port}",
                     "--log-level", "WARNING"]
            entry = ["-m", "host_agent.cli"]
            if profile == "cpu":
                entry = ["-m", "tests.bench.cpu_profile", str(work / "registry.pstats")]
            agent = spawn([PY, *entry, *flags], log=work / "agent.log")
            url = f"http://127.0.0.1:{port}/v1/ensembles/{NAMESPACE}/e0"
            wait_for("ensemble e0 with 18 members", lambda: _members(url) == 18, timeout=120,
                     interval=0.1)

            out = get_load(url, connections=32, seconds=seconds, log=work / "loadgen.log")
            results.set("registry_get_per_s", out["per_s"])
            results.set("registry_get_p50_ms", out["p50_ms"])
            results.set("registry_get_p99_ms", out["p99_ms"])

            generation = http_json(url)["generation"]
            lp = spawn([PY, "-m", "tests.bench.loadgen", "longpoll", "--count", str(polls),
                        "--url", f"{url}?wait={generation}&timeout=60", "--deadline", "300",
                        "--generation", str(generation)],
                       log=work / "longpoll.log", stdout_pipe=True)
            try:
                read_line(lp, "parked", timeout=120)
                wait_for(f"{polls} parked long-polls", lambda: _waiters(port) >= polls,
                         timeout=180, interval=0.2)
                changed = time.monotonic()
                patch_vmi_ip(api, token, "e0-0", member_ip(0, 0, 1))
                out = json.loads(read_line(lp, "{", timeout=300))
            finally:
                stop(lp)
            if out["answered"] < polls or out["errors"]:
                raise BenchError(f"long-polls: {out['answered']} of {polls} answered, "
                                 f"{out['errors']} errors")
            key = "longpoll_5000_last_answer_ms"
            results.set(key, (out["last"] - changed) * 1000)
            results.set("longpoll_first_answer_ms", (out["first"] - changed) * 1000)
            results.set("longpoll_repolls", out["repolls"])
            if quick:
                results.note("registry", f"quick: {polls} long-polls, not 5,000")
        finally:
            if agent is not None:
                stop(agent, timeout=30)
            stop(api_proc)
        if profile == "cpu" and (work / "registry.pstats").exists():
            out = REPO_ROOT / "bench-profile-registry.txt"
            write_cpu_profile(work / "registry.pstats", out)
            results.note("registry_profile", str(out))


def _members(url: str) -> int:
    try:
        return len(http_json(url, timeout=2)["members"])
    except (OSError, ValueError, KeyError):
        return 0
