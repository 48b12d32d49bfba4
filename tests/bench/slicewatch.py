"""Follow the EndpointSlices at the API (the double, or a real apiserver) from the harness.

Why a watch and not polling: checking 1,000 slices by listing them every few
milliseconds would load the double (and so the measurement) far more than one
stream of events. A background thread keeps ``pins`` (slice name -> {hostname:
IP}) and the CLOCK_MONOTONIC time of the last event; ``wait(pred)`` blocks on a
condition variable until every slice matches the expectation set with
``expect`` (kept incrementally: one event re-checks one slice, so a check
never scans the whole fleet) or a deadline passes.

Plain ``http.client`` on purpose: the harness measures other processes and
should add as little CPU as possible; the watch is newline-delimited JSON.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import threading
import time
from typing import Any

from tests.bench.common import BenchError
from tests.bench.loadgen import split_url, tls_context

Pins = dict[str, dict[str, str]]


def _pins_of(obj: dict[str, Any]) -> dict[str, str]:
    out: dict[str, str] = {}
    for ep in obj.get("endpoints") or []:
        host = ep.get("hostname")
        addrs = ep.get("addresses") or []
        if host and addrs:
            out[str(host)] = str(addrs[0])
    return out


class SliceWatch:
    def __init__(self, api_url: str, token: str, namespace: str, ca: str | None = None) -> None:
        self._host, self._port, _ = split_url(api_url)
        #: https (a real kube-apiserver): verified against ``ca``
        self._tls = tls_context(api_url, ca)
        self._headers = {"Authorization": f"Bearer {token}"}
        self._path = f"/apis/discovery.k8s.io/v1/namespaces/{namespace}/endpointslices"
        self.pins: Pins = {}
        self.events = 0
        self.last_event = 0.0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._conn: http.client.HTTPConnection | None = None
        self._closed = False
        self._expected: Pins = {}
        self.mismatched: set[str] = set()
        self._thread = threading.Thread(target=self._run, name="slice-watch", daemon=True)

    def start(self) -> SliceWatch:
        conn = self._connect(timeout=30)
        conn.request("GET", self._path, headers=self._headers)
        resp = conn.getresponse()
        doc = json.loads(resp.read())
        conn.close()
        if resp.status != 200:
            raise BenchError(f"list endpointslices: {resp.status} {doc}")
        for item in doc.get("items") or []:
            self.pins[item["metadata"]["name"]] = _pins_of(item)
        self._rv = doc["metadata"]["resourceVersion"]
        self._thread.start()
        return self

    def _connect(self, timeout: float | None) -> http.client.HTTPConnection:
        if self._tls is not None:
            return http.client.HTTPSConnection(self._host, self._port, timeout=timeout,
                                               context=self._tls)
        return http.client.HTTPConnection(self._host, self._port, timeout=timeout)

    def _run(self) -> None:
        try:
            conn = self._connect(timeout=None)
            self._conn = conn
            conn.request("GET", f"{self._path}?watch=true&resourceVersion={self._rv}"
                         "&timeoutSeconds=86400", headers=self._headers)
            resp = conn.getresponse()
            while not self._closed:
                line = resp.readline()
                if not line:
                    break
                event = json.loads(line)
                obj = event.get("object") or {}
                name = (obj.get("metadata") or {}).get("name")
                with self._cond:
                    if event.get("type") in ("ADDED", "MODIFIED") and name:
                        self.pins[name] = _pins_of(obj)
                    elif event.get("type") == "DELETED" and name:
                        self.pins.pop(name, None)
                    if name:
                        self._check(name)
                    self.events += 1
                    self.last_event = time.monotonic()
                    self._cond.notify_all()
        except BaseException as exc:  # reported by wait()
            if not self._closed:
                self.error = exc
        finally:
            with self._cond:
                self._cond.notify_all()

    def _check(self, name: str) -> None:
        if name not in self._expected:
            return
        if self.pins.get(name) == self._expected[name]:
            self.mismatched.discard(name)
        else:
            self.mismatched.add(name)

    def expect(self, expected: Pins) -> None:
        """From now on ``wait`` waits for these slices to hold exactly these pins."""
        with self._cond:
            self._expected = {k: dict(v) for k, v in expected.items()}
            self.mismatched = set()
            for name in self._expected:
                self._check(name)

    def wait(self, what: str, timeout: float) -> float:
        """Block until every expected slice matches; the monotonic time of the deciding event."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                if not self.mismatched:
                    return self.last_event or time.monotonic()
                if self.error is not None:
                    raise BenchError(f"slice watch failed: {self.error!r}") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    raise BenchError(f"timed out after {timeout} s waiting for {what}; "
                                     f"{len(self.mismatched)} slices differ, e.g. "
                                     f"{sorted(self.mismatched)[:3]}")
                self._cond.wait(min(left, 0.5))

    def close(self) -> None:
        self._closed = True
        if self._conn is not None:
            with contextlib.suppress(OSError):
                if self._conn.sock is not None:
                    self._conn.sock.shutdown(2)
            self._conn.close()
        self._thread.join(5)
