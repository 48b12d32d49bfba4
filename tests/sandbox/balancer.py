"""A Service address in front of several host agent replicas (TEST STAND-IN for kube-proxy).

The tiers here have no kube-proxy and no kubelet, so "one address in front of the
replicas", readiness-driven removal and "retried against the Service" need a stand-in.
It does what kube-proxy's nftables mode does for a ClusterIP Service, in the network
namespace that holds the Service address (the root namespace: the host side of the
sandbox bridge), with an nftables table of its own (``imexlb<tag>``):

- **DNAT, source kept.** New TCP connections to ``VIP:PORT`` are destination-NATed to
  one ready backend, picked with ``numgen random mod N`` (kube-proxy's choice, too). The
  client's address is not rewritten (no masquerade), so the registry still sees the
  guest's own address as its TCP peer, as it does behind kube-proxy.
- **Readiness, as the kubelet and the EndpointSlice controller report it.** A thread
  probes every backend's ``/readyz`` (every ``period`` s, ``timeout`` s each, like a
  readinessProbe with failureThreshold 1) and rewrites the map in one nft transaction
  when the ready set changes. New connections go only to ready backends; connections
  already established keep their backend (conntrack), as with kube-proxy.
- **No ready backend:** new connections are refused with a TCP reset (kube-proxy's
  ``reject`` for a Service without endpoints; here nothing listens on the VIP port).
- **Partition** (``partition(i)``): every packet to and from backend ``i`` is dropped,
  in both directions: what a guest sees when the node under a replica vanishes (no FIN,
  no RST). The probe then times out and the backend leaves the map.

Differences from a cluster, said where they matter: the probe stands in for kubelet
+ EndpointSlice controller + kube-proxy, so readiness changes reach the data path
within about ``period`` + ``timeout`` here, where a cluster takes a probe period plus
propagation (about a second); a dead node is noticed here by the probe, where a
cluster keeps its endpoints ready until node-monitor-grace-period (40-50 s) runs out.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import subprocess
import threading
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field

log = logging.getLogger("sandbox.balancer")


class BalancerError(Exception):
    """nft refused a rule set (the message has its stderr)."""


def nft(script: str) -> None:
    proc = subprocess.run(["nft", "-f", "-"], input=script, text=True, capture_output=True,
                          timeout=10, check=False)
    if proc.returncode != 0:
        raise BalancerError(f"nft: {proc.stderr.strip()}\n--- script ---\n{script}")


@dataclass
class Backend:
    host: str
    port: int
    ready: bool = False
    partitioned: bool = False


@dataclass
class Balancer:
    """``VIP:PORT`` -> the ready ones of ``backends``; see the module docstring."""

    vip: str
    port: int
    backends: list[Backend]
    period: float = 0.2
    timeout: float = 0.5
    table: str = field(default_factory=lambda: "imexlb" + secrets.token_hex(3))
    changes: list[tuple[float, tuple[int, ...]]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._installed: tuple[int, ...] | None = None

    @classmethod
    def over(cls, vip: str, port: int, backends: Sequence[tuple[str, int]],
             **kw: float) -> Balancer:
        return cls(vip, port, [Backend(h, p) for h, p in backends], **kw)  # type: ignore[arg-type]

    # -- rules -----------------------------------------------------------------------

    def _script(self, ready: tuple[int, ...]) -> str:
        """The whole table, replaced in one transaction. Without a ready backend nothing
        is translated, and the kernel resets connections to the unused VIP port, which
        is what kube-proxy's reject gives a Service without endpoints."""
        nat = ""
        if ready:
            targets = ", ".join(f"{i} : {self.backends[b].host} . {self.backends[b].port}"
                                for i, b in enumerate(ready))
            nat = (f"    ip daddr {self.vip} tcp dport {self.port} ct state new "
                   f"dnat ip to numgen random mod {len(ready)} map {{ {targets} }}\n")
        drops = "".join(
            f"    ip daddr {b.host} tcp dport {b.port} drop\n"
            f"    ip saddr {b.host} tcp sport {b.port} drop\n"
            for b in self.backends if b.partitioned)

        def chain(name: str, hook: str, body: str) -> str:
            kind, priority = ("nat", "-100") if name in ("pre", "out") else ("filter", "-10")
            return (f"  chain {name} {{\n    type {kind} hook {hook} priority {priority};\n"
                    f"{body}  }}\n")

        return (f"table ip {self.table} {{}}\n"
                f"delete table ip {self.table}\n"
                f"table ip {self.table} {{\n"
                + chain("pre", "prerouting", nat) + chain("out", "output", nat)
                + chain("fin", "input", drops) + chain("fout", "output", drops)
                + chain("ffwd", "forward", drops) + "}\n")

    def _install(self) -> None:
        ready = tuple(i for i, b in enumerate(self.backends) if b.ready and not b.partitioned)
        nft(self._script(ready))
        if ready != self._installed:
            self.changes.append((time.monotonic(), ready))
            log.info("balancer %s:%d -> %s", self.vip, self.port,
                     [f"{self.backends[i].host}:{self.backends[i].port}" for i in ready] or
                     "nothing (reset)")
        self._installed = ready

    # -- readiness ----------------------------------------------------------------------

    def _probe(self, b: Backend) -> bool:
        if b.partitioned:
            return False
        try:
            with urllib.request.urlopen(f"http://{b.host}:{b.port}/readyz",
                                        timeout=self.timeout) as r:
                return bool(r.status == 200)
        except Exception:
            return False

    def _loop(self) -> None:
        while not self._stop.is_set():
            self.probe_once()
            self._stop.wait(self.period)

    def probe_once(self) -> None:
        states = [self._probe(b) for b in self.backends]
        with self._lock:
            changed = False
            for b, ok in zip(self.backends, states, strict=True):
                if b.ready != ok:
                    b.ready, changed = ok, True
            if changed:
                self._install()

    def ready(self) -> list[int]:
        with self._lock:
            return list(self._installed or ())

    # -- faults -------------------------------------------------------------------------

    def partition(self, index: int, on: bool = True) -> None:
        """Drop every packet to and from backend ``index`` (its node's network is gone)."""
        with self._lock:
            self.backends[index].partitioned = on
            if on:
                self.backends[index].ready = False
            self._install()  # established flows keep their conntrack entry: now dropped

    # -- lifecycle ----------------------------------------------------------------------

    def start(self) -> Balancer:
        with self._lock:
            self._install()
        self.probe_once()
        self._thread = threading.Thread(target=self._loop, name=f"balancer {self.table}",
                                        daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        with contextlib.suppress(BalancerError):
            nft(f"table ip {self.table} {{}}\ndelete table ip {self.table}\n")

    def __enter__(self) -> Balancer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
