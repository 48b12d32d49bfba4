"""REST routing: Kubernetes API paths and verbs onto the store, plus discovery.

TEST STAND-IN, never product code. Imitates the apiserver's HTTP surface
(Kubernetes API concepts, "Kubernetes API terminology" and "Efficient
detection of changes"):

- discovery: `/version`, `/api`, `/api/v1`, `/apis`, `/apis/<group>`,
  `/apis/<group>/<version>` (legacy, unaggregated discovery documents; clients
  that ask for aggregated discovery fall back to these, as they do against
  older servers);
- collections `/api/v1/[namespaces/<ns>/]<plural>` and
  `/apis/<g>/<v>/[namespaces/<ns>/]<plural>`: GET = list or watch
  (`?watch=true`), POST = create, DELETE = deletecollection; items `.../<plural>/<name>`: GET, PUT,
  PATCH (by Content-Type), DELETE; `.../<name>/status` for the status
  subresource;
- Table responses for `Accept: ...;as=Table;g=meta.k8s.io` (kubectl get),
  see tables.py;
- watch streams: newline-delimited `{"type", "object"}` events, BOOKMARK
  events every `bookmark_interval` seconds when `allowWatchBookmarks=true`
  (default 1 s: a real apiserver sends about one a minute, so the double is
  faster on purpose; set it higher to test a client that must not rely on
  them),
  `timeoutSeconds` ends the stream cleanly, a too-old `resourceVersion`
  yields a single ERROR event carrying a 410 Status;
- `Authorization: Bearer <token>` checked when sent (401 when wrong); requests
  without credentials are served, as the old insecure port did, because
  client-go (kubectl) does not send bearer tokens over plain HTTP; a token
  from the TokenRequest API (`POST .../serviceaccounts/<name>/token`) is that
  ServiceAccount, held to RBAC, and `POST
  /apis/authorization.k8s.io/v1/selfsubjectaccessreviews` answers what RBAC
  allows whoever asks (rbac.py);
- every failure answered with a `Status` object.

The `/_sandbox/...` admin endpoints (faults, counters, seeding objects) are
the double's own and documented in server.py.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import yaml

from . import audit as audit_mod
from . import openapi, rbac, tables
from .errors import ApiError, bad_request, status_object
from .faults import Counters, Faults
from .http import AbortConnection, Request, Response, StreamResponse
from .resources import ResourceType
from .store import WATCH_ABORT, WATCH_CLOSE, Store, Watcher

log = logging.getLogger(__name__)
JSON = dict[str, Any]
SERVER_VERSION = {"major": "1", "minor": "33", "gitVersion": "v1.33.0-sandbox",
                  "gitCommit": "0000000000000000000000000000000000000000",
                  "gitTreeState": "clean", "buildDate": "2026-01-01T00:00:00Z",
                  "goVersion": "go1.24", "compiler": "gc", "platform": "linux/amd64"}

PATCH_TYPES = {
    "application/merge-patch+json": "merge",
    "application/json-patch+json": "json",
    "application/strategic-merge-patch+json": "strategic",
    "application/apply-patch+yaml": "apply",
    "application/apply-patch+cbor": "apply",
}


def encode(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def json_response(status: int, obj: Any, headers: dict[str, str] | None = None) -> Response:
    return Response(status, encode(obj), headers or {})


def with_warnings(resp: Response, warnings: list[str]) -> Response:
    """Add the `Warning: 299 - "..."` header the apiserver sends (RFC 7234 form)."""
    if warnings:
        text = ", ".join('299 - "' + w.replace('"', '\\"') + '"' for w in warnings)
        resp.headers["Warning"] = text
    return resp


def error_response(err: ApiError) -> Response:
    return json_response(err.code, err.status(), err.headers)


AdminHandler = Callable[[Request], Awaitable[Response]]


class PageNotFound(Exception):
    """A path no registered resource serves."""


class KubeApi:
    """The request handler: auth, counting, faults, then routing."""

    def __init__(self, store: Store, faults: Faults, counters: Counters, token: str | None,
                 bookmark_interval: float, admin: AdminHandler | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store = store
        self.faults = faults
        self.counters = counters
        self.token = token
        self.bookmark_interval = bookmark_interval
        self.admin = admin
        self.clock = clock
        self.tokens = rbac.Tokens()
        #: the audit and delivery logs (audit.py), when a test asked for them
        self.audit: audit_mod.Audit | None = None

    def _identity(self, auth: str | None) -> rbac.Identity | None:
        """Who sent the request (rbac.py); None: a token nobody minted (401)."""
        if auth is None or self.token is None or auth == f"Bearer {self.token}":
            return rbac.SUPERUSER
        if auth.startswith("Bearer "):
            return self.tokens.identity(auth.removeprefix("Bearer "), self.store)
        return None

    async def handle(self, req: Request) -> Response | StreamResponse:
        # client-go (kubectl) never sends a bearer token over plain HTTP, so a request
        # without credentials is served as on the old insecure port; a wrong one is 401.
        # A ServiceAccount's token (TokenRequest) is held to RBAC (rbac.py).
        if req.path.startswith("/_sandbox/") and self.admin is not None:
            if self._identity(req.headers.get("authorization")) is not rbac.SUPERUSER:
                return json_response(401, status_object(401, "Unauthorized", "Unauthorized"))
            return await self.admin(req)
        who = self._identity(req.headers.get("authorization"))
        if who is None:
            return json_response(401, status_object(401, "Unauthorized", "Unauthorized"))
        attrs = rbac.request_attributes(req.method, req.path, req.query)
        if attrs is not None and not who.superuser:
            decision = rbac.authorize(self.store, who, attrs)
            if not decision.allowed:
                return error_response(rbac.forbidden(who, attrs, decision.reason))
        try:
            verb, resource, route = self._route(req, who)
        except PageNotFound:  # the real mux answers unknown resources in plain text
            return Response(404, b"404 page not found\n", content_type="text/plain; charset=utf-8")
        except ApiError as e:
            return error_response(e)
        # a dry run writes nothing: counted apart, so writes() leaves it out
        self.counters.count(f"dry-run {verb}" if req.query.get("dryRun") else verb, resource)
        delay, fault = self.faults.decide(verb, resource, self.clock())
        if delay:
            await asyncio.sleep(delay)
        if fault is not None:
            self.counters.faulted[(verb, resource)] += 1
            return audit_mod.record(self.audit, self.store, req, verb, resource,
                                    error_response(fault))
        try:
            return audit_mod.record(self.audit, self.store, req, verb, resource,
                                    await route())
        except ApiError as e:
            return audit_mod.record(self.audit, self.store, req, verb, resource,
                                    error_response(e))
        except Exception as e:  # a bug in the double: answer as the apiserver would
            log.exception("sandbox API double failed on %s %s", req.method, req.target)
            return error_response(ApiError(500, "InternalError",
                                           f"Internal error occurred: {type(e).__name__}: {e}"))

    # ------------------------------------------------------------ routing

    def _route(self, req: Request, who: rbac.Identity = rbac.SUPERUSER) -> tuple[
            str, str, Callable[[], Awaitable[Response | StreamResponse]]]:
        parts = [p for p in req.path.split("/") if p]
        if parts == ["apis", "authorization.k8s.io", "v1", "selfsubjectaccessreviews"]:
            if req.method != "POST":
                raise ApiError(405, "MethodNotAllowed", f"{req.method} is not supported here")
            return "create", "selfsubjectaccessreviews", lambda: self._access_review(req, who)
        if len(parts) == 7 and parts[:3] == ["api", "v1", "namespaces"] and \
                parts[4] == "serviceaccounts" and parts[6] == "token":
            if req.method != "POST":
                raise ApiError(405, "MethodNotAllowed", f"{req.method} is not supported here")
            return "create", "serviceaccounts/token", lambda: self._token_request(
                req, parts[3], parts[5])

        def done(resp: Response) -> Callable[[], Awaitable[Response]]:
            async def fn() -> Response:
                return resp
            return fn

        if req.path in ("/healthz", "/livez", "/readyz"):
            return "discovery", "", done(Response(200, b"ok", content_type="text/plain"))
        if req.path == "/version":
            return "discovery", "", done(json_response(200, SERVER_VERSION))
        if parts[:2] == ["openapi", "v3"]:
            doc = openapi.index(self.store.types) if len(parts) == 2 else \
                openapi.group_version_doc(self.store.types, "/".join(parts[2:]))
            if doc is None:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            return "discovery", "", done(json_response(200, doc))
        if not parts or parts[0] not in ("api", "apis"):
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        if parts[0] == "api":
            if len(parts) == 1:
                return "discovery", "", done(json_response(200, self._api_versions(req)))
            group, version, rest = "", parts[1], parts[2:]
        else:
            if len(parts) == 1:
                return "discovery", "", done(json_response(200, self._group_list()))
            if len(parts) == 2:
                return "discovery", "", done(json_response(200, self._group(parts[1])))
            group, version, rest = parts[1], parts[2], parts[3:]
        if not rest:
            return "discovery", "", done(json_response(200, self._resource_list(group, version)))
        return self._resource_route(req, group, version, rest)

    def _resource_route(self, req: Request, group: str, version: str, rest: list[str]) -> tuple[
            str, str, Callable[[], Awaitable[Response | StreamResponse]]]:
        ns: str | None = None
        types = self.store.types
        if rest[0] == "namespaces" and len(rest) >= 3 and \
                types.find_type(group, version, rest[2]) is not None:
            ns, rest = rest[1], rest[2:]
        t = types.find_type(group, version, rest[0])
        if t is None:
            raise PageNotFound()
        name = rest[1] if len(rest) > 1 else None
        sub = rest[2] if len(rest) > 2 else ""
        if len(rest) > 3 or (sub and (sub != "status" or not t.has_status)):
            raise PageNotFound()
        if t.namespaced and name is None and ns is None and req.method != "GET":
            raise ApiError(405, "MethodNotAllowed", "method not allowed on an all-namespaces path")
        resource = f"{t.plural}/{sub}" if sub else t.plural
        m = req.method
        if name is None:
            if m == "GET":
                watch = req.query.get("watch", "") in ("true", "1")
                if watch:
                    return "watch", resource, lambda: self._watch(req, t, ns)
                return "list", resource, lambda: self._list(req, t, ns)
            if m == "POST":
                return "create", resource, lambda: self._create(req, t, ns)
            if m == "DELETE":
                return "delete", resource, lambda: self._delete_collection(req, t, ns)
            raise bad_request(f"{m} is not supported on a collection (a name is required)")
        if m == "GET":
            return "get", resource, lambda: self._get(req, t, ns, name)
        if m == "PUT":
            return "update", resource, lambda: self._update(req, t, ns, name, sub)
        if m == "PATCH":
            ctype = req.headers.get("content-type", "").split(";")[0].strip()
            ptype = PATCH_TYPES.get(ctype)
            if ptype is None:
                raise ApiError(415, "UnsupportedMediaType",
                               f"the body of the request was in an unknown format - accepted "
                               f"media types include: {', '.join(PATCH_TYPES)}")
            verb = "apply" if ptype == "apply" else "patch"
            return verb, resource, lambda: self._patch(req, t, ns, name, sub, ptype)
        if m == "DELETE" and not sub:
            return "delete", resource, lambda: self._delete(req, t, ns, name)
        raise ApiError(405, "MethodNotAllowed", f"{m} is not supported here")

    # ---------------------------------------------------------- discovery

    def _api_versions(self, req: Request) -> JSON:
        return {"kind": "APIVersions", "versions": ["v1"], "serverAddressByClientCIDRs": [
            {"clientCIDR": "0.0.0.0/0", "serverAddress": req.headers.get("host", "")}]}

    def _group(self, group: str) -> JSON:
        version = self.store.types.group_versions().get(group)
        if not group or version is None:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        gv = {"groupVersion": f"{group}/{version}", "version": version}
        return {"kind": "APIGroup", "apiVersion": "v1", "name": group, "versions": [gv],
                "preferredVersion": gv}

    def _group_list(self) -> JSON:
        groups = [self._group(g) for g in self.store.types.group_versions() if g]
        for g in groups:
            g.pop("kind")
            g.pop("apiVersion")
        return {"kind": "APIGroupList", "apiVersion": "v1", "groups": groups}

    def _resource_list(self, group: str, version: str) -> JSON:
        types = self.store.types.types_in(group, version)
        if not types:
            raise ApiError(404, "NotFound", "the server could not find the requested resource")
        verbs = ["create", "delete", "deletecollection", "get", "list", "patch", "update",
                 "watch"]
        resources: list[JSON] = []
        for t in types:
            res: JSON = {"name": t.plural, "singularName": t.singular, "namespaced": t.namespaced,
                         "kind": t.kind, "verbs": verbs}
            if t.short_names:
                res["shortNames"] = list(t.short_names)
            resources.append(res)
            if t.has_status:
                resources.append({"name": f"{t.plural}/status", "singularName": "",
                                  "namespaced": t.namespaced, "kind": t.kind,
                                  "verbs": ["get", "patch", "update"]})
        return {"kind": "APIResourceList", "apiVersion": "v1",
                "groupVersion": f"{group}/{version}" if group else version,
                "resources": resources}

    # ------------------------------------------- identities and reviews (rbac.py)

    async def _access_review(self, req: Request, who: rbac.Identity) -> Response:
        return json_response(201, rbac.access_review(self.store, who, _body(req)))

    async def _token_request(self, req: Request, ns: str, name: str) -> Response:
        body = _body(req) if req.body else {}
        return json_response(201, rbac.token_request(self.store, self.tokens, ns, name, body))

    # ------------------------------------------------------------- verbs

    async def _get(self, req: Request, t: ResourceType, ns: str | None, name: str) -> Response:
        obj = self.store.get(t, ns, name)
        if tables.wants_table(req.headers.get("accept", "")):
            return json_response(200, tables.table(
                t, [obj], obj["metadata"].get("resourceVersion"), _include(req)))
        return json_response(200, obj)

    async def _list(self, req: Request, t: ResourceType, ns: str | None) -> Response:
        try:
            limit = int(req.query["limit"]) if req.query.get("limit") else None
        except ValueError as e:
            raise bad_request("limit must be an integer") from e
        page = self.store.list_page(
            t, ns, req.query.get("labelSelector"), req.query.get("fieldSelector"),
            req.query.get("resourceVersion"), req.query.get("resourceVersionMatch"),
            limit, req.query.get("continue"))
        meta: JSON = {"resourceVersion": page.resource_version}
        if page.continue_token:
            meta["continue"] = page.continue_token
            if page.remaining is not None:  # left out, not null, as the apiserver does
                meta["remainingItemCount"] = page.remaining
        if tables.wants_table(req.headers.get("accept", "")):
            doc = tables.table(t, page.items, page.resource_version, _include(req))
            doc["metadata"] = meta
            return json_response(200, doc)
        return json_response(200, {"kind": t.list_kind, "apiVersion": t.api_version,
                                   "metadata": meta, "items": page.items})

    async def _watch(self, req: Request, t: ResourceType, ns: str | None) -> StreamResponse:
        bookmarks = req.query.get("allowWatchBookmarks", "") in ("true", "1")
        timeout: float | None = None
        if req.query.get("timeoutSeconds"):
            try:
                timeout = float(req.query["timeoutSeconds"])
            except ValueError as e:
                raise bad_request("timeoutSeconds must be a number") from e
        try:
            w = self.store.watch(t, ns, req.query.get("labelSelector"),
                                 req.query.get("fieldSelector"), req.query.get("resourceVersion"))
        except ApiError as e:
            if e.code != 410:
                raise
            return StreamResponse(200, _one_error(e.status()))
        as_table = tables.wants_table(req.headers.get("accept", ""))
        return StreamResponse(200, self._events(t, w, bookmarks, timeout,
                                                _include(req) if as_table else None,
                                                req.headers.get("user-agent", "")))

    async def _events(self, t: ResourceType, w: Watcher, bookmarks: bool,
                      timeout: float | None, table: str | None,
                      user_agent: str = "") -> AsyncIterator[bytes]:
        """The watch stream; `table` = includeObject when the client asked for Tables."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout if timeout is not None else None
        try:
            while True:
                wait: float | None = self.bookmark_interval if bookmarks else None
                if deadline is not None:
                    left = deadline - loop.time()
                    if left <= 0:
                        return
                    wait = left if wait is None else min(wait, left)
                try:
                    kind, obj = await asyncio.wait_for(w.queue.get(), wait)
                except TimeoutError:
                    if bookmarks and (deadline is None or loop.time() < deadline):
                        yield encode({"type": "BOOKMARK", "object": {
                            "kind": t.kind, "apiVersion": t.api_version,
                            "metadata": {"resourceVersion": str(self.store.rv)}}}) + b"\n"
                    continue
                if kind == WATCH_CLOSE:
                    return
                if kind == WATCH_ABORT:
                    raise AbortConnection()
                if table is not None:
                    obj = tables.table(t, [obj], None, table)
                elif self.audit is not None:
                    self.audit.delivered(user_agent, "watch", t.plural, [obj])
                yield encode({"type": kind, "object": obj}) + b"\n"
        finally:
            self.store.unwatch(w)

    @contextlib.contextmanager
    def _dry_run(self, req: Request) -> Iterator[None]:
        """Per-request write options: `dryRun`, `fieldValidation` (read by the store)."""
        value = req.query.get("dryRun")
        if value not in (None, "", "All"):
            raise bad_request(f'dryRun: Unsupported value: "{value}": supported values: "All"')
        validation_mode = req.query.get("fieldValidation") or "Warn"
        if validation_mode not in ("Ignore", "Warn", "Strict"):
            raise bad_request(f'fieldValidation: Unsupported value: "{validation_mode}": '
                              'supported values: "Ignore", "Warn", "Strict"')
        self.store.dry_run = value == "All"
        self.store.field_validation = validation_mode
        self.store.warnings = []
        try:
            yield
        finally:
            self.store.dry_run = False
            self.store.field_validation = "Warn"

    async def _create(self, req: Request, t: ResourceType, ns: str | None) -> Response:
        with self._dry_run(req):
            obj = self.store.create(t, ns, _body(req), _manager(req))
        return with_warnings(json_response(201, obj), self.store.warnings)

    async def _update(self, req: Request, t: ResourceType, ns: str | None, name: str,
                      sub: str) -> Response:
        with self._dry_run(req):
            obj = self.store.update(t, ns, name, _body(req), _manager(req), sub)
        return with_warnings(json_response(200, obj), self.store.warnings)

    async def _patch(self, req: Request, t: ResourceType, ns: str | None, name: str, sub: str,
                     ptype: str) -> Response:
        existed = (ns or "", name) in self.store.objects[t.key]
        body = _body(req, yaml_ok=ptype == "apply")
        manager = req.query.get("fieldManager") or (None if ptype == "apply" else _manager(req))
        force = req.query.get("force", "") in ("true", "1")
        with self._dry_run(req):
            obj = self.store.patch(t, ns, name, ptype, body, manager, force, sub)
        return with_warnings(json_response(200 if existed else 201, obj), self.store.warnings)

    async def _delete(self, req: Request, t: ResourceType, ns: str | None,
                      name: str) -> Response:
        propagation = req.query.get("propagationPolicy")
        precondition = None
        if req.body:
            opts = _body(req)
            propagation = opts.get("propagationPolicy", propagation)
            precondition = (opts.get("preconditions") or {}).get("resourceVersion")
        with self._dry_run(req):
            gone = self.store.delete(t, ns, name, propagation, precondition)
        if gone["metadata"].get("deletionTimestamp") and \
                (ns or "", name) in self.store.objects[t.key]:
            return json_response(200, gone)  # waiting for finalizers
        if t.returns_deleted:
            return json_response(200, gone)
        return json_response(200, status_object(200, "", "", {
            "name": name, "group": t.group, "kind": t.plural,
            "uid": gone["metadata"].get("uid", "")}))


    async def _delete_collection(self, req: Request, t: ResourceType,
                                 ns: str | None) -> Response:
        """deletecollection: every object the selectors match, one by one."""
        items, _ = self.store.list(t, ns, req.query.get("labelSelector"),
                                   req.query.get("fieldSelector"))
        with self._dry_run(req):
            for item in items:
                meta = item["metadata"]
                key = (meta.get("namespace", ""), meta["name"])
                if key in self.store.objects[t.key]:
                    self.store.delete(t, meta.get("namespace"), meta["name"],
                                      req.query.get("propagationPolicy"))
        return json_response(200, status_object(200, "", "", {"kind": t.plural}))


async def _one_error(status: JSON) -> AsyncIterator[bytes]:
    yield encode({"type": "ERROR", "object": status}) + b"\n"


def _body(req: Request, yaml_ok: bool = False) -> Any:
    if not req.body:
        raise bad_request("the request body is empty")
    try:
        if yaml_ok:
            return yaml.safe_load(req.body)
        return json.loads(req.body)
    except (ValueError, yaml.YAMLError) as e:
        raise bad_request(f"the request body could not be decoded: {e}") from e


def _include(req: Request) -> str:
    value = req.query.get("includeObject") or "Metadata"
    if value not in ("None", "Metadata", "Object"):
        raise bad_request(f'includeObject: Unsupported value: "{value}"')
    return value


def _manager(req: Request) -> str:
    """The field manager: the query parameter, else the User-Agent's product (as upstream)."""
    if req.query.get("fieldManager"):
        return req.query["fieldManager"]
    agent = req.headers.get("user-agent", "unknown")
    return agent.split("/")[0][:128] or "unknown"


