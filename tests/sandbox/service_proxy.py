"""One Service address on loopback in front of changing pods (TEST STAND-IN for a
ClusterIP Service: the EndpointSlice controller and kube-proxy, for clients on this host).

tests/sandbox/balancer.py is the faithful one (nftables DNAT, the client's address
kept) for clients in network namespaces; this one serves clients on the host itself
(the realk8s install tests' guests and registry monitor), where pods come and go
while the address stays, without root:

- **Endpoints, set by the caller.** ``add`` and ``remove`` play the EndpointSlice
  controller: the install tests add a pod once its /readyz answers 200 and remove it
  before they stop it (in a cluster, removal and SIGTERM start together; the
  registry's own readiness turns 503 at SIGTERM, so the order only removes a race the
  tests do not measure).
- **New connections** go to the ready endpoints in turn (kube-proxy picks at
  random). With none, a new connection is accepted and closed at once (kube-proxy
  rejects it; either way the client sees a failed request at once, no hang).
- **Established connections keep their pod** until either side closes (conntrack):
  a long-poll parked on a pod that stops ends with that pod.

Unlike kube-proxy, the pod sees the proxy's address (127.0.0.1) as its peer, not the
client's: the registry refuses status reports through it (the address is no member's),
so the tests' guests send none.
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading


class ServiceProxy:
    """``with ServiceProxy() as svc: svc.add(port) ... svc.url``"""

    def __init__(self, host: str = "127.0.0.1") -> None:
        self._listener = socket.create_server((host, 0))
        self.host = host
        self.port: int = self._listener.getsockname()[1]
        self._lock = threading.Lock()
        self._endpoints: list[int] = []
        self._turn = itertools.count()
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._thread = threading.Thread(target=self._accept, name="service-proxy", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def add(self, port: int) -> None:
        with self._lock:
            if port not in self._endpoints:
                self._endpoints.append(port)

    def remove(self, port: int) -> None:
        with self._lock:
            if port in self._endpoints:
                self._endpoints.remove(port)

    def endpoints(self) -> list[int]:
        with self._lock:
            return list(self._endpoints)

    def _pick(self) -> int | None:
        with self._lock:
            if not self._endpoints:
                return None
            return self._endpoints[next(self._turn) % len(self._endpoints)]

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            port = self._pick()
            if port is None:
                client.close()
                continue
            try:
                upstream = socket.create_connection((self.host, port), timeout=2)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._conns |= {client, upstream}
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(src, dst), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                with self._lock:
                    self._conns.discard(s)
            src.close()

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):  # wakes the accept() (close alone does not)
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        with self._lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)
        self._thread.join(5)

    def __enter__(self) -> ServiceProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
