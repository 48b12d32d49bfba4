"""The Kubernetes API double as an object: start/stop, kubeconfig, fault injection.

TEST STAND-IN, never product code: it stands in for kube-apiserver + etcd +
the garbage collector so the real client library (lightkube, kubectl) is
what tests exercise. See store.py / api.py for what each part imitates.

Two shapes:

- `KubeApiServer`: asyncio-native; `async with KubeApiServer() as srv:` runs
  it on the current loop (ephemeral loopback port unless told otherwise).
  Its fault methods are called from that loop.
- `ThreadedKubeApi`: the same server on its own event loop in a background
  thread, with blocking methods; usable from sync tests, from async tests
  (the test's loop stays free for the code under test) and around
  subprocesses. This is what the pytest fixture yields.

Fault injection (Python API here, HTTP at `POST /_sandbox/faults`):
`fail(status=500|429|503, count=N | duration=S, retry_after=, verbs=, resources=)`,
`delay(seconds, count=|duration=, verbs=, resources=)`, `clear_faults()`,
`drop_watches(abort=False)` (end every watch stream; `abort=True` resets
the connections instead), `compact()` (resume from any older
resourceVersion gets 410), `outage("refuse"|"hold")` / `recover()`
(an API outage: connections refused, or accepted and never answered),
`restart(down=0.0, compact=False)` (watches and connections dropped, state
kept, optionally refusing for `down` seconds, as a restarting apiserver
behind a stable address; `compact` also forgets the watch history).
Audit: `start_audit(lease=(ns, name), keep=plurals)` logs every write with that
Lease's holder at its commit and the objects each client is sent (audit.py).
Counters: `writes(resource=None, verb=None, served_only=False)`, `requests`
(Counter of (verb, resource)), `faulted` (the part of `requests` a fault
answered), `changes` (Counter of (plural, event type) actually stored),
`reset_counters()`.

Admin HTTP (same authentication as the API):
`POST /_sandbox/faults` with JSON `{"action": "fail"|"delay"|"clear"|
"drop_watches"|"compact"|"restart"|"outage"|"recover", ...keyword args}`
(`outage` over HTTP needs `"duration"`: the server recovers by itself);
`GET /_sandbox/counters`; `POST /_sandbox/counters/reset`;
`POST /_sandbox/objects` (store an object as a controller would, status
included).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import copy
import functools
import json
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Coroutine
from pathlib import Path
from types import TracebackType
from typing import Any, TypeVar

import yaml

from . import resources as rt
from .api import KubeApi, encode, error_response, json_response
from .audit import Audit
from .errors import ApiError, bad_request
from .faults import Counters, Faults
from .http import HttpServer, Request, Response
from .store import Store

JSON = dict[str, Any]
T = TypeVar("T")


def kubeconfig_document(url: str, token: str, namespace: str = "default") -> JSON:
    return {
        "apiVersion": "v1", "kind": "Config", "preferences": {},
        "clusters": [{"name": "sandbox", "cluster": {"server": url}}],
        "users": [{"name": "sandbox", "user": {"token": token}}],
        "contexts": [{"name": "sandbox", "context": {
            "cluster": "sandbox", "user": "sandbox", "namespace": namespace}}],
        "current-context": "sandbox",
    }


REPO = Path(__file__).resolve().parents[3]
#: The CRDs a double has installed unless told otherwise: the ImexEnsemble CRD
#: exactly as users install it (the generated manifest in manifests/crds).
DEFAULT_CRDS = (REPO / "manifests" / "crds" / "crd-imexensembles.yaml",)


@functools.lru_cache(maxsize=16)
def _crd_docs(path: str, mtime_ns: int) -> tuple[JSON, ...]:
    """Parsed once per file version: PyYAML takes ~0.1 s for the CRD, and tests start
    hundreds of doubles."""
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    return tuple(d for d in yaml.load_all(Path(path).read_text(), Loader=loader)
                 if isinstance(d, dict) and d.get("kind") == "CustomResourceDefinition")


def load_crds(paths: Any) -> list[JSON]:
    """The CRD documents in YAML files (or already parsed dicts), as fresh copies."""
    out: list[JSON] = []
    for item in paths:
        if isinstance(item, dict):
            out.append(copy.deepcopy(item))
            continue
        path = Path(item)
        out.extend(copy.deepcopy(d) for d in _crd_docs(str(path), path.stat().st_mtime_ns))
    return out


class KubeApiServer:
    """The double on the current event loop. See the module docstring.

    `crds`: CustomResourceDefinitions installed at start (YAML paths or dicts;
    default DEFAULT_CRDS, `()` for a cluster without them). More can be
    installed at any time by creating CRD objects, as with `kubectl apply -f`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, token: str | None = None,
                 bookmark_interval: float = 1.0, history_limit: int = 100_000,
                 crds: Any = None) -> None:
        self.token = token if token is not None else secrets.token_hex(16)
        self.store = Store(history_limit=history_limit,
                           crds=load_crds(DEFAULT_CRDS if crds is None else crds))
        self.faults = Faults()
        self.counters = Counters()
        self.api = KubeApi(self.store, self.faults, self.counters, self.token,
                           bookmark_interval, self._admin)
        self.http = HttpServer(self.api.handle, host, port)
        self._timers: set[asyncio.Task[None]] = set()

    # ---------------------------------------------------------- lifecycle

    async def start(self) -> KubeApiServer:
        await self.http.start()
        return self

    async def stop(self) -> None:
        for task in list(self._timers):
            task.cancel()
        self.store.close_watches()
        await self.http.stop()

    async def __aenter__(self) -> KubeApiServer:
        return await self.start()

    async def __aexit__(self, et: type[BaseException] | None, e: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.stop()

    @property
    def host(self) -> str:
        return self.http.host

    @property
    def port(self) -> int:
        return self.http.port

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}"

    def kubeconfig(self, namespace: str = "default") -> JSON:
        return kubeconfig_document(self.url, self.token, namespace)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(yaml.safe_dump(self.kubeconfig(namespace), sort_keys=False))
        tmp.chmod(0o600)
        tmp.replace(out)
        return out

    # ------------------------------------------------------------- faults

    def fail(self, status: int = 500, *, count: int | None = None,
             duration: float | None = None, retry_after: int | None = None,
             verbs: Any = None, resources: Any = None) -> None:
        """Answer matching requests with `status` (500, 429 + Retry-After, 503, ...)."""
        self.faults.add(status=status, count=count, duration=duration, retry_after=retry_after,
                        verbs=verbs, resources=resources, now=time.monotonic())

    def delay(self, seconds: float, *, count: int | None = None,
              duration: float | None = None, verbs: Any = None, resources: Any = None) -> None:
        """Hold matching requests `seconds` before answering."""
        self.faults.add(delay=seconds, count=count, duration=duration, verbs=verbs,
                        resources=resources, now=time.monotonic())

    def clear_faults(self) -> None:
        self.faults.clear()

    def drop_watches(self, abort: bool = False) -> int:
        """End every open watch; `abort` resets the connection instead of a clean end."""
        return self.store.close_watches(abort)

    def compact(self) -> int:
        """Forget history: any watch resuming from an older resourceVersion gets 410."""
        return self.store.compact()

    async def outage(self, mode: str = "refuse", duration: float | None = None) -> None:
        """Stop answering: "refuse" connections, or "hold" requests unanswered."""
        if mode == "refuse":
            self.store.close_watches(abort=True)
            await self.http.refuse()
        elif mode == "hold":
            self.http.hold()
        else:
            raise ValueError(f'outage mode must be "refuse" or "hold", not {mode!r}')
        if duration is not None:
            self._later(duration, self.recover)

    async def recover(self) -> None:
        """End an outage (listening again on the same port)."""
        await self.http.resume()

    async def restart(self, down: float = 0.0, compact: bool = False) -> None:
        """Drop watches and connections, keep state; refuse for `down` seconds first.

        `compact=True` also forgets the watch history, as when etcd was compacted
        while the apiserver was away: every resume then gets 410.
        """
        self.store.close_watches(abort=True)
        if compact:
            self.store.compact()
        await self.http.refuse()
        if down > 0:
            await asyncio.sleep(down)
        await self.http.resume()

    def _later(self, delay: float, fn: Callable[[], Coroutine[Any, Any, None]]) -> None:
        async def run() -> None:
            await asyncio.sleep(delay)
            await fn()
        task = asyncio.get_running_loop().create_task(run())
        self._timers.add(task)
        task.add_done_callback(self._timers.discard)

    # ----------------------------------------------------------- counters

    @property
    def requests(self) -> Counter[tuple[str, str]]:
        return self.counters.requests

    @property
    def changes(self) -> Counter[tuple[str, str]]:
        return self.store.changes

    @property
    def faulted(self) -> Counter[tuple[str, str]]:
        """Requests an injected fault answered, by (verb, resource)."""
        return self.counters.faulted

    def writes(self, resource: str | None = None, verb: str | None = None,
               served_only: bool = False) -> int:
        """Write requests by kind/verb; `served_only` leaves out fault-answered ones."""
        return self.counters.writes(resource, verb, served_only)

    def reset_counters(self) -> None:
        self.counters.reset()
        self.store.changes.clear()

    def start_audit(self, lease: tuple[str, str] | None = None, keep: Any = ()) -> Audit:
        """Log every write with `lease`'s holder at its commit, and the objects of the
        `keep` plurals each client is sent (audit.py); returns the log."""
        self.api.audit = Audit(lease, keep)
        return self.api.audit

    # -------------------------------------------------------------- state

    def put(self, obj: JSON) -> JSON:
        """Store `obj` as a controller would (status included, validated)."""
        return self.store.put(obj)

    def put_many(self, objs: list[JSON]) -> list[JSON]:
        """`put` for a batch (one hop to the server's thread for ThreadedKubeApi)."""
        return [self.store.put(o) for o in objs]

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> JSON:
        t = self._kind(api_version, kind)
        return self.store.get(t, namespace, name)

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[JSON]:
        return self.store.list(self._kind(api_version, kind), namespace, label_selector)[0]

    def delete(self, api_version: str, kind: str, name: str,
               namespace: str | None = None) -> JSON:
        return self.store.delete(self._kind(api_version, kind), namespace, name)

    def _kind(self, api_version: str, kind: str) -> rt.ResourceType:
        t = self.store.types.find_kind(api_version, kind)
        if t is None:
            raise ValueError(f"the sandbox does not serve {api_version} {kind}")
        return t

    @property
    def resource_version(self) -> int:
        return self.store.rv

    # ----------------------------------------------------- admin over HTTP

    async def _admin(self, req: Request) -> Response:
        try:
            return await self._admin_route(req)
        except ApiError as e:
            return error_response(e)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            return error_response(bad_request(f"{type(e).__name__}: {e}"))

    async def _admin_route(self, req: Request) -> Response:
        if req.path == "/_sandbox/counters" and req.method == "GET":
            return json_response(200, {
                "requests": self.counters.snapshot(),
                "writes": self.writes(),
                "changes": {f"{p}/{k}": n for (p, k), n in sorted(self.changes.items())},
                "resourceVersion": str(self.store.rv),
            })
        if req.path == "/_sandbox/counters/reset" and req.method == "POST":
            self.reset_counters()
            return json_response(200, {"reset": True})
        if req.path == "/_sandbox/objects" and req.method == "POST":
            return json_response(200, self.put(json.loads(req.body or b"{}")))
        if req.path == "/_sandbox/faults" and req.method == "POST":
            args = json.loads(req.body or b"{}")
            if not isinstance(args, dict) or "action" not in args:
                raise bad_request('expected a JSON object with "action"')
            action = args.pop("action")
            result: Any = None
            if action == "fail":
                self.fail(**args)
            elif action == "delay":
                self.delay(**args)
            elif action == "clear":
                self.clear_faults()
            elif action == "drop_watches":
                result = self.drop_watches(**args)
            elif action == "compact":
                result = self.compact()
            elif action == "restart":
                # answer first, then restart: the caller's own connection is dropped too
                self._later(0.05, lambda: self.restart(**args))
            elif action == "outage":
                if args.get("duration") is None:
                    raise bad_request("an outage requested over HTTP needs a duration")
                self._later(0.05, lambda: self.outage(**args))
            elif action == "recover":
                await self.recover()
            else:
                raise bad_request(f"unknown action {action!r}")
            return Response(200, encode({"action": action, "result": result}))
        raise ApiError(404, "NotFound", f"no sandbox admin endpoint {req.method} {req.path}")


class ThreadedKubeApi:
    """A `KubeApiServer` on a private event loop thread, with blocking methods."""

    def __init__(self, **kwargs: Any) -> None:
        self._kwargs = kwargs
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="kube-api-double", daemon=True)
        self._server: KubeApiServer | None = None

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def start(self) -> ThreadedKubeApi:
        self._thread.start()

        async def make() -> KubeApiServer:
            return await KubeApiServer(**self._kwargs).start()

        self._server = self._call(make())
        return self

    def stop(self) -> None:
        if self._server is not None:
            self._call(self._server.stop())
            self._server = None
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
        with contextlib.suppress(RuntimeError):
            self._loop.close()

    def __enter__(self) -> ThreadedKubeApi:
        return self.start()

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def _call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        fut: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(coro, self._loop)
        return fut.result(timeout)

    def _sync(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        async def run() -> T:
            return fn(*args, **kwargs)
        return self._call(run())

    @property
    def server(self) -> KubeApiServer:
        """The underlying server; touch it only through its loop (`call`)."""
        assert self._server is not None, "not started"
        return self._server

    def call(self, fn: Callable[[KubeApiServer], T]) -> T:
        """Run `fn(server)` on the server's loop thread and return its result."""
        return self._sync(fn, self.server)

    @property
    def url(self) -> str:
        return self.server.url

    @property
    def port(self) -> int:
        return self.server.port

    @property
    def token(self) -> str:
        return self.server.token

    def kubeconfig(self, namespace: str = "default") -> JSON:
        return self.server.kubeconfig(namespace)

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        return self.server.write_kubeconfig(path, namespace)

    # faults
    def fail(self, status: int = 500, **kwargs: Any) -> None:
        self._sync(self.server.fail, status, **kwargs)

    def delay(self, seconds: float, **kwargs: Any) -> None:
        self._sync(self.server.delay, seconds, **kwargs)

    def clear_faults(self) -> None:
        self._sync(self.server.clear_faults)

    def drop_watches(self, abort: bool = False) -> int:
        return self._sync(self.server.drop_watches, abort)

    def compact(self) -> int:
        return self._sync(self.server.compact)

    def outage(self, mode: str = "refuse", duration: float | None = None) -> None:
        self._call(self.server.outage(mode, duration))

    def recover(self) -> None:
        self._call(self.server.recover())

    def restart(self, down: float = 0.0, compact: bool = False) -> None:
        self._call(self.server.restart(down, compact), timeout=30.0 + down)

    # counters
    def writes(self, resource: str | None = None, verb: str | None = None,
               served_only: bool = False) -> int:
        return self._sync(self.server.writes, resource, verb, served_only)

    @property
    def faulted(self) -> Counter[tuple[str, str]]:
        return self._sync(lambda: Counter(self.server.faulted))

    @property
    def requests(self) -> Counter[tuple[str, str]]:
        return self._sync(lambda: Counter(self.server.requests))

    @property
    def changes(self) -> Counter[tuple[str, str]]:
        return self._sync(lambda: Counter(self.server.changes))

    def reset_counters(self) -> None:
        self._sync(self.server.reset_counters)

    def start_audit(self, lease: tuple[str, str] | None = None, keep: Any = ()) -> Audit:
        """`KubeApiServer.start_audit`; the log's `drain()` may be called from any thread."""
        return self._sync(self.server.start_audit, lease, keep)

    @property
    def resource_version(self) -> int:
        return self._sync(lambda: self.server.resource_version)

    # state
    def put(self, obj: JSON) -> JSON:
        return self._sync(self.server.put, obj)

    def put_many(self, objs: list[JSON]) -> list[JSON]:
        return self._sync(self.server.put_many, objs)

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> JSON:
        return self._sync(self.server.get, api_version, kind, name, namespace)

    def list(self, api_version: str, kind: str, namespace: str | None = None,
             label_selector: str | None = None) -> list[JSON]:
        return self._sync(self.server.list, api_version, kind, namespace, label_selector)

    def delete(self, api_version: str, kind: str, name: str,
               namespace: str | None = None) -> JSON:
        return self._sync(self.server.delete, api_version, kind, name, namespace)
