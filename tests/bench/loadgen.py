"""Load generator, run as its own process so it never shares a GIL with what it measures.

``python -m tests.bench.loadgen get --url URL --connections C --seconds S``
    keep-alive GETs of one URL on C connections for S seconds; prints one JSON
    line ``{"requests", "errors", "seconds", "per_s", "p50_ms", "p99_ms"}``.
``python -m tests.bench.loadgen longpoll --url URL --count N --deadline S``
    opens N connections, each holding one GET (the caller puts ``?wait=G`` in
    the URL); prints ``parked N`` once every request is written, then one JSON
    line with the CLOCK_MONOTONIC time of every answer's arrival
    (``first``, ``last``, ``answered``, ``errors``, ``repolls``). With
    ``--generation G`` an answer still at G (the registry's long-poll cap
    passed) is polled again on the same connection, as a guest would. CLOCK_MONOTONIC is
    system-wide on Linux, so the harness compares these times with its own.
``python -m tests.bench.loadgen patch --api URL --token T --updates FILE [--ca CA]``
    sends VMI status merge-patches (as virt-handler would) read from FILE (JSON
    list of ``[name, ip]``) on C connections as fast as the API accepts them
    (the double over http, or a real kube-apiserver over https verified with CA),
    for at most ``--seconds``; prints ``{"sent", "errors", "first", "last"}``
    (monotonic times; the updates sent are the first ``sent`` of the list).

The HTTP/1.1 client is a few lines of asyncio streams rather than a library
client: it costs a fraction of the CPU per request, so on a small machine the
generator is not what limits the figure. Only Content-Length and chunked
bodies are understood; that is all the servers measured here send.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import ssl
import sys
import time
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit


class HttpError(Exception):
    pass


def raise_nofile(want: int) -> int:
    """Raise the soft open-files limit toward ``want`` (up to the hard limit)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft < target:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        return target
    return soft


def split_url(url: str) -> tuple[str, int, str]:
    """(host, port, path with query) of an http(s) URL; HttpError for anything else."""
    u = urlsplit(url)
    if u.scheme not in ("http", "https") or not u.hostname:
        raise HttpError(f"only http(s)://HOST:PORT/... URLs are supported, not {url!r}")
    path = u.path or "/"
    if u.query:
        path += "?" + u.query
    return u.hostname, u.port or (443 if u.scheme == "https" else 80), path


def tls_context(url: str, ca: str | None) -> ssl.SSLContext | None:
    """For an https URL (the real kube-apiserver, the registry's HTTPS): verify it
    against ``ca``."""
    if urlsplit(url).scheme != "https":
        return None
    return ssl.create_default_context(cafile=ca)


def request_bytes(method: str, host: str, port: int, path: str, *, body: bytes = b"",
                  headers: dict[str, str] | None = None) -> bytes:
    lines = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Accept: */*"]
    for k, v in (headers or {}).items():
        lines.append(f"{k}: {v}")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body


async def read_response(r: asyncio.StreamReader) -> tuple[int, bytes]:
    head = await r.readuntil(b"\r\n\r\n")
    status_line, _, rest = head.partition(b"\r\n")
    status = int(status_line.split()[1])
    length: int | None = None
    chunked = False
    for line in rest.split(b"\r\n"):
        name, _, value = line.partition(b":")
        lname = name.strip().lower()
        if lname == b"content-length":
            length = int(value.strip())
        elif lname == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
    if chunked:
        body = bytearray()
        while True:
            size = int((await r.readuntil(b"\r\n")).split(b";")[0].strip(), 16)
            if size == 0:
                await r.readuntil(b"\r\n")
                return status, bytes(body)
            body += await r.readexactly(size + 2)
            del body[-2:]
    if length is None:
        raise HttpError("response without Content-Length")
    return status, await r.readexactly(length)


# ------------------------------------------------------------------------- get


async def run_get(url: str, connections: int, seconds: float, ca: str | None = None,
                  new_conn: bool = False) -> dict[str, float]:
    """Keep-alive GETs; ``new_conn``: one request per connection, as a guest asks (each
    request pays the TCP, and for https the TLS, handshake)."""
    host, port, path = split_url(url)
    ctx = tls_context(url, ca)
    req = request_bytes("GET", host, port, path,
                        headers={"Connection": "close"} if new_conn else None)
    latencies: list[float] = []
    errors = 0
    ready = asyncio.Event()
    end = 0.0

    async def worker() -> None:
        nonlocal errors
        if new_conn:
            await ready.wait()
            while (now := time.monotonic()) < end:
                r, w = await asyncio.open_connection(host, port, ssl=ctx)
                try:
                    w.write(req)
                    status, _ = await read_response(r)
                finally:
                    w.close()
                latencies.append(time.monotonic() - now)
                if status != 200:
                    errors += 1
            return
        r, w = await asyncio.open_connection(host, port, ssl=ctx)
        try:
            await ready.wait()
            while (now := time.monotonic()) < end:
                w.write(req)
                status, _ = await read_response(r)
                latencies.append(time.monotonic() - now)
                if status != 200:
                    errors += 1
        finally:
            w.close()

    tasks = [asyncio.create_task(worker()) for _ in range(connections)]
    await asyncio.sleep(0.2)  # connections open before the clock starts
    start = time.monotonic()
    end = start + seconds
    ready.set()
    await asyncio.gather(*tasks)
    took = time.monotonic() - start
    lat = sorted(latencies)
    n = len(lat)
    return {"requests": n, "errors": errors, "seconds": round(took, 3),
            "per_s": round(n / took, 1),
            "p50_ms": round(lat[n // 2] * 1000, 2) if n else -1,
            "p99_ms": round(lat[min(n - 1, int(n * 0.99))] * 1000, 2) if n else -1}


# -------------------------------------------------------------------- longpoll


async def run_longpoll(url: str, count: int, deadline: float, open_batch: int,
                       generation: int | None, ca: str | None = None) -> dict[str, float]:
    host, port, path = split_url(url)
    ctx = tls_context(url, ca)
    req = request_bytes("GET", host, port, path)
    arrivals: list[float] = []
    errors = 0
    repolls = 0
    streams: list[tuple[asyncio.StreamReader, asyncio.StreamWriter]] = []
    # Open in batches: a burst of thousands of SYNs overflows the listen backlog
    # and a dropped SYN is retried only after a second.
    for i in range(0, count, open_batch):
        batch = await asyncio.gather(*(asyncio.open_connection(host, port, ssl=ctx)
                                       for _ in range(min(open_batch, count - i))))
        streams.extend(batch)
    for _, w in streams:
        w.write(req)
    await asyncio.gather(*(w.drain() for _, w in streams))
    print(f"parked {len(streams)}", flush=True)

    async def wait_one(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        nonlocal errors, repolls
        while True:
            try:
                status, body = await read_response(r)
            except (OSError, asyncio.IncompleteReadError, HttpError):
                errors += 1
                return
            now = time.monotonic()
            if status != 200:
                errors += 1
                return
            # A timed-out poll comes back with the same generation: poll again, as a guest does.
            if generation is not None and json.loads(body).get("generation") == generation:
                repolls += 1
                w.write(req)
                continue
            arrivals.append(now)
            return

    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(deadline):
            await asyncio.gather(*(wait_one(r, w) for r, w in streams))
    for _, w in streams:
        w.close()
    arrivals.sort()
    return {"answered": len(arrivals), "errors": errors, "repolls": repolls,
            "first": arrivals[0] if arrivals else -1, "last": arrivals[-1] if arrivals else -1,
            "p50": arrivals[len(arrivals) // 2] if arrivals else -1,
            "p99": arrivals[min(len(arrivals) - 1, int(len(arrivals) * 0.99))]
            if arrivals else -1}


# ----------------------------------------------------------------------- patch


async def run_patch(api: str, token: str, namespace: str, updates: list[tuple[str, str]],
                    connections: int, seconds: float, ca: str | None = None) -> dict[str, float]:
    """Send ``updates`` (VMI status merge-patches) in order; stop taking new ones
    ``seconds`` after the first. The ones sent are always a prefix of the list."""
    vmis = f"/apis/kubevirt.io/v1/namespaces/{namespace}/virtualmachineinstances"
    requests = [("PATCH", f"{vmis}/{name}/status", {"status": {"interfaces": [{
        "name": "default", "ipAddress": ip, "ipAddresses": [ip], "mac": "02:00:00:00:00:01",
        "infoSource": "domain, guest-agent", "podInterfaceName": "eth0"}]}})
        for name, ip in updates]
    out = await send_all(api, token, requests, connections, ca, seconds)
    for err in out.errors[:2]:
        print(f"patch: {err}", file=sys.stderr)
    return {"sent": out.sent, "errors": len(out.errors), "first": out.first, "last": out.last}


@dataclass
class Sent:
    """What :func:`send_all` did: how many sent, the refusals, first and last send times."""

    sent: int = 0
    errors: list[str] = field(default_factory=list)
    first: float = 0.0
    last: float = 0.0


async def send_all(api: str, token: str, requests: list[tuple[str, str, Any]],
                   connections: int = 16, ca: str | None = None,
                   seconds: float | None = None) -> Sent:
    """Send ``(method, path, json_body)`` requests in order on ``connections`` keep-alive
    connections; with ``seconds``, stop taking new ones that long after the first.

    Bodies go as JSON; a PATCH as a merge patch. An answer of 300 or more is an error
    (``"<status> <path>: <body>"``); the time of each answer is ``last``."""
    host, port, _ = split_url(api)
    tls = tls_context(api, ca)
    queue = list(reversed(requests))
    out = Sent()

    def more() -> bool:
        return bool(queue) and not (seconds is not None and out.first
                                    and time.monotonic() - out.first > seconds)

    async def worker() -> None:
        r, w = await asyncio.open_connection(host, port, ssl=tls)
        try:
            while more():
                method, path, obj = queue.pop()
                out.sent += 1
                kind = "merge-patch+json" if method == "PATCH" else "json"
                w.write(request_bytes(method, host, port, path,
                                      body=json.dumps(obj, separators=(",", ":")).encode(),
                                      headers={"Authorization": f"Bearer {token}",
                                               "Content-Type": f"application/{kind}"}))
                if not out.first:
                    out.first = time.monotonic()
                status, text = await read_response(r)
                out.last = time.monotonic()
                if status >= 300:
                    out.errors.append(f"{status} {path}: {text[:300]!r}")
        finally:
            w.close()

    await asyncio.gather(*(worker() for _ in range(connections)))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.bench.loadgen")
    sub = p.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("get")
    g.add_argument("--url", required=True)
    g.add_argument("--connections", type=int, default=32)
    g.add_argument("--seconds", type=float, default=5.0)
    g.add_argument("--ca", default=None, help="CA file for an https --url")
    g.add_argument("--new-conn", action="store_true",
                   help="one request per connection (as a guest asks)")
    lp = sub.add_parser("longpoll")
    lp.add_argument("--url", required=True)
    lp.add_argument("--count", type=int, default=5000)
    lp.add_argument("--deadline", type=float, default=60.0)
    lp.add_argument("--open-batch", type=int, default=200)
    lp.add_argument("--generation", type=int, default=None,
                    help="an answer with this generation is a timeout: poll again")
    lp.add_argument("--ca", default=None, help="CA file for an https --url")
    pa = sub.add_parser("patch")
    pa.add_argument("--api", required=True)
    pa.add_argument("--token", required=True)
    pa.add_argument("--namespace", default="bench")
    pa.add_argument("--updates", required=True)
    pa.add_argument("--connections", type=int, default=16)
    pa.add_argument("--seconds", type=float, default=3600.0,
                    help="stop sending new updates this long after the first")
    pa.add_argument("--ca", default=None, help="CA file for an https --api")
    args = p.parse_args(argv)
    if args.cmd == "get":
        out = asyncio.run(run_get(args.url, args.connections, args.seconds, args.ca,
                                  args.new_conn))
    elif args.cmd == "longpoll":
        raise_nofile(args.count + 256)
        out = asyncio.run(run_longpoll(args.url, args.count, args.deadline, args.open_batch,
                                       args.generation, args.ca))
    else:
        with open(args.updates) as f:
            updates = [(str(n), str(ip)) for n, ip in json.load(f)]
        out = asyncio.run(run_patch(args.api, args.token, args.namespace, updates,
                                    args.connections, args.seconds, args.ca))
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
