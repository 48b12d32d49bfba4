"""The registry over TLS: what HTTPS costs, side by side with plain HTTP in one run.

Processes: the API double (``kube_proc``, 10 ensembles of 18 Running VMIs), one real
``imex-host-agent`` serving both listeners (``--listen`` and ``--tls-listen`` with
``--tls-cert-file``: a serving certificate from the registry CA machinery, ECDSA P-256,
what ``--tls-self-issued`` makes), and the load generator in its own process.

Figures, each once per listener (``_http``, ``_https``), in one run of one agent:

- ``registry_tls_get_keepalive_per_s``: keep-alive GETs of ``/v1/ensembles/bench/e0`` on
  32 connections for 10 s (the encryption's cost alone);
- ``registry_tls_get_newconn_per_s``: one GET per connection, 16 at a time, for 10 s:
  how a guest asks (``Connection: close``), so every request pays the TCP and, for
  https, the TLS handshake;
- ``..._cpu_ms``: the agent's own CPU (``/proc``, utime + stime) per request in each of
  the two above: the cost on the registry, independent of what else the machine runs;
- ``registry_tls_longpoll_wake_p50_ms`` (and ``_p99_ms``): 1,000 long-polls parked on
  each listener at the same time; one VMI's IP is patched at the double; from the patch
  to each answer's arrival at the load generator (watch event, settle, wake-up, write).

The 1-minute load average before and after is recorded by the harness (``_meta``).
"""

from __future__ import annotations

import datetime as dt
import json
import tempfile
import time
from pathlib import Path

from tests.bench.common import (
    PY,
    BenchError,
    Results,
    cpu_seconds,
    free_port,
    get_load,
    http_json,
    read_line,
    spawn,
    stop,
    wait_for,
)
from tests.bench.kube_proc import NAMESPACE, member_ip
from tests.bench.loadgen import raise_nofile
from tests.bench.registry_load import _members, _waiters, patch_vmi_ip


def write_certificate(work: Path) -> Path:
    """tls.crt, tls.key and ca.crt for 127.0.0.1 (the registry CA machinery's)."""
    from host_agent.ca import registry_tls as rt

    tls = rt.first("bench", rt.Names(("localhost",), ("127.0.0.1",)), dt.datetime.now(dt.UTC))
    m = tls.material()
    (work / "tls.crt").write_text(m.chain_pem)
    (work / "tls.key").write_text(m.key_pem)
    (work / "tls.key").chmod(0o600)
    (work / "ca.crt").write_text(m.ca_pem or "")
    return work / "ca.crt"


def run(results: Results, *, quick: bool = False, profile: str | None = None) -> None:
    seconds = 1.0 if quick else 10.0
    polls = 50 if quick else 1000
    raise_nofile(polls * 4 + 1024)
    with tempfile.TemporaryDirectory(prefix="bench-tls-") as tmp:
        work = Path(tmp)
        ca = write_certificate(work)
        kubeconfig = work / "kubeconfig"
        api_proc = spawn([PY, "-m", "tests.bench.kube_proc", "--kubeconfig-out", str(kubeconfig),
                          "--ensembles", "10", "--per", "18"], log=work / "api.log",
                         stdout_pipe=True)
        agent = None
        try:
            ready = dict(kv.split("=", 1) for kv in
                         read_line(api_proc, "kube-api ready", timeout=120).split()[2:])
            api, token = ready["url"], ready["token"]
            port, tls_port = free_port(), free_port()
            agent = spawn([PY, "-m", "host_agent.cli", "--kubeconfig", str(kubeconfig),
                           "--listen", f"127.0.0.1:{port}", "--log-level", "WARNING",
                           "--tls-listen", f"127.0.0.1:{tls_port}",
                           "--tls-cert-file", str(work / "tls.crt"),
                           "--tls-private-key-file", str(work / "tls.key")],
                          log=work / "agent.log")
            path = f"/v1/ensembles/{NAMESPACE}/e0"
            urls = {"http": f"http://127.0.0.1:{port}{path}",
                    "https": f"https://127.0.0.1:{tls_port}{path}"}
            wait_for("ensemble e0 with 18 members", lambda: _members(urls["http"]) == 18,
                     timeout=120, interval=0.2)
            tls_args = ["--ca", str(ca)]
            for scheme, url in urls.items():
                cpu = cpu_seconds(agent.pid)
                out = get_load(url, connections=32, seconds=seconds,
                               log=work / f"get-{scheme}.log",
                               extra=tls_args if scheme == "https" else ())
                results.set(f"registry_tls_get_keepalive_per_s_{scheme}", out["per_s"])
                results.set(f"registry_tls_get_keepalive_p50_ms_{scheme}", out["p50_ms"])
                results.set(f"registry_tls_get_keepalive_cpu_ms_{scheme}",
                            (cpu_seconds(agent.pid) - cpu) * 1000 / max(1, out["requests"]))
            for scheme, url in urls.items():
                cpu = cpu_seconds(agent.pid)
                out = get_load(url, connections=16, seconds=seconds,
                               log=work / f"newconn-{scheme}.log", what="new-connection GETs",
                               extra=["--new-conn", *(tls_args if scheme == "https" else ())])
                results.set(f"registry_tls_get_newconn_per_s_{scheme}", out["per_s"])
                results.set(f"registry_tls_get_newconn_p50_ms_{scheme}", out["p50_ms"])
                # the agent's own CPU per request: what the handshake costs, whatever
                # else the machine runs
                results.set(f"registry_tls_get_newconn_cpu_ms_{scheme}",
                            (cpu_seconds(agent.pid) - cpu) * 1000 / max(1, out["requests"]))
            _longpolls(results, api, token, urls, tls_args, polls, port, work)
            if quick:
                results.note("registry-tls", f"quick: {polls} long-polls per listener")
        finally:
            if agent is not None:
                stop(agent, timeout=30)
            stop(api_proc)


def _longpolls(results: Results, api: str, token: str, urls: dict[str, str],
               tls_args: list[str], polls: int, port: int, work: Path) -> None:
    generation = http_json(urls["http"])["generation"]
    gens = []
    try:
        for scheme, url in urls.items():
            gens.append((scheme, spawn(
                [PY, "-m", "tests.bench.loadgen", "longpoll", "--count", str(polls),
                 "--url", f"{url}?wait={generation}&timeout=60", "--deadline", "300",
                 "--generation", str(generation),
                 *(tls_args if scheme == "https" else ())],
                log=work / f"longpoll-{scheme}.log", stdout_pipe=True)))
        for _, gen in gens:
            read_line(gen, "parked", timeout=180)
        wait_for(f"{2 * polls} parked long-polls", lambda: _waiters(port) >= 2 * polls,
                 timeout=180, interval=0.2)
        changed = time.monotonic()
        patch_vmi_ip(api, token, "e0-0", member_ip(0, 0, 1))
        for scheme, gen in gens:
            out = json.loads(read_line(gen, "{", timeout=300))
            if out["answered"] < polls or out["errors"]:
                raise BenchError(f"{scheme} long-polls: {out['answered']} of {polls} "
                                 f"answered, {out['errors']} errors")
            results.set(f"registry_tls_longpoll_wake_p50_ms_{scheme}",
                        (out["p50"] - changed) * 1000)
            results.set(f"registry_tls_longpoll_wake_p99_ms_{scheme}",
                        (out["p99"] - changed) * 1000)
    finally:
        for _, gen in gens:
            stop(gen)
