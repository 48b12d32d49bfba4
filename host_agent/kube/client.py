"""The Kubernetes API as the host agent uses it, over lightkube (all I/O is here).

Kinds are lightkube generic resources, so every object reaches the pure
modules as the plain JSON mapping the API sent (no model conversion, no
field renaming): VMIs (kubevirt.io/v1), Services (v1) and EndpointSlices
(discovery.k8s.io/v1).

``ListWatcher`` lists (returning the list's resourceVersion) and watches
from a resourceVersion with bookmarks. Errors are translated at this
boundary: ``Gone`` for 410 (the caller relists), ``KubeError`` for anything
else (the caller backs off and resumes), each chained to the client's
exception and keeping the HTTP status. A watch that stays silent longer than
``idle_timeout`` is treated as dead (a half-open connection never closes by
itself).

lightkube's public ``watch()`` has no way to ask for bookmarks, so the watch
request is built with the client's own request builder plus
``allowWatchBookmarks=true``; everything else (auth, TLS, decoding, resume
bookkeeping) stays lightkube's.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator, Callable, Mapping
from pathlib import Path
from typing import Any, Final

import httpx2
from lightkube import ALL_NS, ApiError, AsyncClient, KubeConfig
from lightkube.core.exceptions import ConfigError
from lightkube.core.resource import NamespacedResource
from lightkube.generic_resource import create_namespaced_resource
from lightkube.resources.core_v1 import Service as Service
from lightkube.types import on_error_raise

from host_agent.crd.imexensemble import GROUP as CRD_GROUP
from host_agent.crd.imexensemble import KIND as CRD_KIND
from host_agent.crd.imexensemble import PLURAL as CRD_PLURAL
from host_agent.crd.imexensemble import VERSION as CRD_VERSION
from host_agent.kube import http11, lean_listwatch
from host_agent.kube.api_requests import classify
from host_agent.kube.objects import Obj
from host_agent.settings import HostSettings

# Service uses lightkube's typed model: a *generic* core-group class can be
# created only once per process (lightkube looks it up under "/v1" but files
# it under "v1"), so a second generic "Service" anywhere in the process (a
# test harness, a plugin) would make importing this module fail. Its fields
# are all optional, so a BOOKMARK (metadata only) parses. EndpointSlice stays
# generic: the typed model requires addressType and endpoints, which a
# BOOKMARK event does not carry, and named groups do not have that lookup bug.
VirtualMachineInstance = create_namespaced_resource(
    "kubevirt.io", "v1", "VirtualMachineInstance", "virtualmachineinstances"
)
EndpointSlice = create_namespaced_resource(
    "discovery.k8s.io", "v1", "EndpointSlice", "endpointslices"
)

ImexEnsemble = create_namespaced_resource(CRD_GROUP, CRD_VERSION, CRD_KIND, CRD_PLURAL)
Event = create_namespaced_resource("events.k8s.io", "v1", "Event", "events")

ALL_NAMESPACES: Final = ALL_NS
#: Objects per list call (client-go's reflector uses the same page size).
LIST_PAGE: Final = 500


class KubeError(Exception):
    """A failed call to the Kubernetes API.

    ``status`` is the HTTP code (0: no answer). ``api_status`` is the API's own
    ``metav1.Status`` as it sent it (None: no answer, or a body that is not a Status),
    so a caller can tell a 409 ``AlreadyExists`` from a 409 ``Conflict`` by ``reason``
    and read ``details`` without parsing the message.
    """

    def __init__(self, message: str, status: int = 0,
                 api_status: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.api_status: Obj | None = dict(api_status) if api_status else None

    def _field(self, name: str) -> Any:
        return self.api_status.get(name) if self.api_status is not None else None

    @property
    def reason(self) -> str | None:
        """The Status's machine-readable reason (``NotFound``, ``Conflict``, ...)."""
        value = self._field("reason")
        return value if isinstance(value, str) and value else None

    @property
    def api_message(self) -> str | None:
        """The Status's human-readable message."""
        value = self._field("message")
        return value if isinstance(value, str) and value else None

    @property
    def details(self) -> Mapping[str, Any] | None:
        """The Status's details (name, group, kind, causes)."""
        value = self._field("details")
        return value if isinstance(value, Mapping) else None


class Gone(KubeError):
    """410: the resourceVersion is too old (history compacted); relist."""


class AlreadyExists(KubeError):
    """409 on create: an object of that name exists (one our informers may not see)."""


class KubeConfigError(KubeError):
    """No usable Kubernetes client configuration."""


def status_of(exc: BaseException) -> int:
    if isinstance(exc, ApiError) and exc.status is not None and exc.status.code:
        return int(exc.status.code)
    if isinstance(exc, httpx2.HTTPStatusError):
        return exc.response.status_code
    return 0


def _as_status(body: object) -> Obj | None:
    """``body`` if it is a ``metav1.Status`` (``kind: Status``), else None."""
    if isinstance(body, Mapping) and body.get("kind") == "Status":
        return dict(body)
    return None


def _api_status_of(exc: BaseException) -> Obj | None:
    if isinstance(exc, ApiError) and exc.status is not None:
        return _as_status({"kind": "Status", **plain(exc.status)})
    if isinstance(exc, httpx2.HTTPStatusError):
        try:  # a watch's response is a stream whose body may not have been read
            return _as_status(exc.response.json())
        except (ValueError, httpx2.ResponseNotRead, httpx2.StreamError):
            return None
    return None


def translate(exc: BaseException, what: str) -> KubeError:
    """Our error for a client exception (call as ``raise translate(e, ...) from e``)."""
    status = status_of(exc)
    api_status = _api_status_of(exc)
    detail = str(exc) or type(exc).__name__
    if status == 410:
        return Gone(f"{what}: 410 Gone ({detail})", status, api_status)
    if status == 409:
        return AlreadyExists(f"{what}: 409 Conflict ({detail})", status, api_status)
    return KubeError(f"{what}: {status or type(exc).__name__}: {detail}", status, api_status)


def load_config(kubeconfig: str | None) -> KubeConfig:
    """``--kubeconfig`` if given, else in-cluster, else $KUBECONFIG / ~/.kube/config."""
    try:
        if kubeconfig:
            return KubeConfig.from_file(kubeconfig)
        return KubeConfig.from_env()
    except (ConfigError, OSError, ValueError, KeyError) as exc:
        where = kubeconfig or (
            "in-cluster service account, $KUBECONFIG or "
            + str(Path(os.environ.get("HOME", "~")) / ".kube" / "config")
        )
        raise KubeConfigError(
            f"cannot load a Kubernetes configuration from {where}: {exc}"
        ) from exc


def token_file(settings: HostSettings) -> str | None:
    """The bearer-token file the client reads (and reads again on a 401), if the
    configuration names one: the in-cluster service account's, or a kubeconfig user's
    ``tokenFile``."""
    single = load_config(settings.kubeconfig).get()
    user = single.user if single is not None else None
    return user.token_file if user is not None else None


def make_client(settings: HostSettings) -> AsyncClient:
    client = AsyncClient(
        load_config(settings.kubeconfig),
        field_manager=settings.field_manager,
        timeout=httpx2.Timeout(10.0),
    )
    set_user_agent(client, settings.user_agent)
    return client


def set_user_agent(client: AsyncClient, user_agent: str) -> None:
    """Every request of ``client`` says who sent it (the audit log's userAgent).

    lightkube has no parameter for it; its HTTP client is two levels down and
    its headers are the per-client defaults every request starts from.
    """
    transport_client = getattr(getattr(client, "_client", None), "_client", None)
    headers = getattr(transport_client, "headers", None)
    if headers is None:
        raise KubeConfigError("cannot set the User-Agent: lightkube's client layout changed")
    headers["User-Agent"] = user_agent


RequestCount = Callable[[str, str, str], None]


class _CountingTransport(httpx2.AsyncBaseTransport):
    """Counts each request by (verb, resource, code) as its answer starts (a watch's too),
    ``error`` when none came; a cancelled request (a watch stopped on shutdown) is not
    counted."""

    def __init__(self, inner: httpx2.AsyncBaseTransport, count: RequestCount) -> None:
        self._inner = inner
        self._count = count

    async def handle_async_request(self, request: httpx2.Request) -> httpx2.Response:
        verb, resource = classify(request.method, request.url.path, dict(request.url.params),
                                  request.headers.get("content-type"))
        try:
            response = await self._inner.handle_async_request(request)
        except Exception:
            self._count(verb, resource, "error")
            raise
        self._count(verb, resource, str(response.status_code))
        return response

    async def aclose(self) -> None:
        await self._inner.aclose()


def count_requests(client: AsyncClient, count: RequestCount) -> None:
    """Every request of ``client`` is counted (``imex_host_agent_api_requests_total``).

    lightkube has no hook for it; its HTTP client's transports (the default one and any
    proxy mounts) are wrapped in place, as ``set_user_agent`` sets its headers.
    """
    transport_client = getattr(getattr(client, "_client", None), "_client", None)
    inner = getattr(transport_client, "_transport", None)
    if not isinstance(inner, httpx2.AsyncBaseTransport):
        raise KubeConfigError("cannot count API requests: lightkube's client layout changed")
    if isinstance(inner, _CountingTransport):
        return
    transport_client._transport = _CountingTransport(inner, count)  # type: ignore[union-attr]
    mounts = getattr(transport_client, "_mounts", {})
    for pattern, mounted in list(mounts.items()):
        if isinstance(mounted, httpx2.AsyncBaseTransport):
            mounts[pattern] = _CountingTransport(mounted, count)


def plain(obj: object) -> Obj:
    """Raw JSON of a generic (dict-like) or typed lightkube object."""
    if isinstance(obj, Mapping):
        return dict(obj)
    to_dict = getattr(obj, "to_dict", None)
    return dict(to_dict()) if callable(to_dict) else {}


class ListWatcher:
    """List and watch one kind in one namespace (or all), with fixed selectors."""

    def __init__(
        self,
        client: AsyncClient,
        resource: type[NamespacedResource],
        *,
        namespace: str = ALL_NS,
        labels: Mapping[str, Any] | None = None,
        fields: Mapping[str, Any] | None = None,
        timeout_seconds: int = 290,
        idle_timeout: float | None = None,
    ) -> None:
        self._client = client
        self._res = resource
        self._ns = namespace
        self._labels = dict(labels) if labels else None
        self._fields = dict(fields) if fields else None
        self._timeout = timeout_seconds
        self._idle = idle_timeout if idle_timeout is not None else timeout_seconds + 60.0
        self.kind = resource.__name__
        self.scope = "all namespaces" if namespace == ALL_NS else f"namespace {namespace}"

    async def list(self, view: Callable[[Obj], Obj]) -> tuple[list[Obj], str]:
        """Every object (through ``view``) and the list's resourceVersion (to watch from).

        Paged (``LIST_PAGE`` objects per call, as client-go's reflector does) and
        each object reduced to ``view`` as its page arrives: at 10,000 VMIs a single
        unpaged list held every full object at once, most of the agent's peak RSS.
        """
        what = f"list {self.kind} in {self.scope}"
        lean = http11.for_client(self._client)
        if lean is not None:
            br = self._client._client.prepare_request(
                "list", res=self._res, namespace=self._ns, params=self._selectors())
            try:
                return await lean_listwatch.list_all(lean, "/" + br.url, br.params,
                                                     LIST_PAGE, view)
            except Exception as exc:
                raise _from_lean(exc, what) from exc
        try:
            it = self._client.list(
                self._res, namespace=self._ns, labels=self._labels, fields=self._fields,
                chunk_size=LIST_PAGE,
            )
            items = [view(plain(o)) async for o in it]
            rv = it.resourceVersion
        except Exception as exc:
            raise translate(exc, what) from exc
        return items, rv

    def _selectors(self) -> dict[str, Any]:
        from lightkube.core.selector import build_selector

        return {
            "labelSelector": build_selector(self._labels) if self._labels else None,
            "fieldSelector": (
                build_selector(self._fields, for_fields=True) if self._fields else None
            ),
        }

    async def watch(self, resource_version: str) -> AsyncIterator[tuple[str, Obj]]:
        """Events after ``resource_version`` (ADDED/MODIFIED/DELETED/BOOKMARK), forever.

        A stream the server ends cleanly is resumed inside the client from the
        last version seen; errors end the iteration with KubeError/Gone.
        """
        generic = self._client._client  # lightkube's request builder and watch loop
        params: dict[str, Any] = {
            "timeoutSeconds": self._timeout,
            "resourceVersion": resource_version,
            "allowWatchBookmarks": "true",
            **self._selectors(),
        }
        request = generic.prepare_request(
            "list", res=self._res, namespace=self._ns, watch=True, params=params
        )
        lean = http11.for_client(self._client)
        if lean is not None:
            async for event in self._lean_watch(lean, "/" + request.url, request.params):
                yield event
            return
        stream = generic.watch(request, on_error=on_error_raise).__aiter__()
        try:
            while True:
                try:
                    async with asyncio.timeout(self._idle):
                        event, obj = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError as exc:
                    raise KubeError(
                        f"watch {self.kind} in {self.scope}: silent for {self._idle:.0f} s"
                    ) from exc
                except Exception as exc:
                    raise translate(exc, f"watch {self.kind} in {self.scope}") from exc
                yield event, plain(obj)
        finally:
            await stream.aclose()

    async def _lean_watch(self, lean: http11.Http11Pool, path: str,
                          params: Mapping[str, Any]) -> AsyncIterator[tuple[str, Obj]]:
        stream = lean_listwatch.watch(lean, path, params, self._idle)
        what = f"watch {self.kind} in {self.scope}"
        try:
            while True:
                try:
                    event = await stream.__anext__()
                except StopAsyncIteration:
                    return
                except TimeoutError as exc:
                    raise KubeError(f"{what}: silent for {self._idle:.0f} s") from exc
                except Exception as exc:
                    raise _from_lean(exc, what) from exc
                yield event
        finally:
            await stream.aclose()


def _from_lean(exc: BaseException, what: str) -> KubeError:
    """Our error for a failure on the lean path (as ``translate`` is for lightkube's)."""
    if not isinstance(exc, lean_listwatch.LeanError):
        return translate(exc, what)
    cls = Gone if exc.status == 410 else AlreadyExists if exc.status == 409 else KubeError
    return cls(f"{what}: {exc}", exc.status, exc.api_status)


def _status_message(resp: Any) -> tuple[str, Obj | None]:
    """The text a failed raw call is reported with, and the Status it sent (if any)."""
    try:
        body = resp.json()
    except ValueError:
        return str(resp.text)[:200], None
    if isinstance(body, Mapping) and isinstance(body.get("message"), str):
        return str(body["message"]), _as_status(body)
    return str(body)[:200], _as_status(body)


async def api_call(
    client: AsyncClient,
    method: str,
    path: str,
    *,
    body: object = None,
    params: Mapping[str, str] | None = None,
    content_type: str = "application/json",
    timeout: float | None = None,
    what: str | None = None,
) -> Obj | None:
    """One raw request on the client's connection (auth, TLS, User-Agent included).

    For the calls lightkube has no words for: preconditions on delete, a
    merge patch that carries a resourceVersion, Leases as plain JSON; and for the
    writes the agent makes most, which take the lean path (``http11``) when the
    configuration allows. Returns the decoded body (None for 404 on GET); raises
    KubeError with the status, its message starting with ``what`` (default: the
    method and path). ``body`` is JSON-encoded unless it is bytes already.
    """
    transport = getattr(getattr(client, "_client", None), "_client", None)
    if transport is None:
        raise KubeConfigError("lightkube's client layout changed: no HTTP client to call")
    headers = {"Accept": "application/json"}
    data: bytes | None = None
    if isinstance(body, bytes):
        data = body
    elif body is not None:
        data = json.dumps(body, separators=(",", ":")).encode()
    if data is not None:
        headers["Content-Type"] = content_type
    what = what or f"{method} {path}"
    lean = http11.for_client(client)
    try:
        if lean is not None:
            resp: http11.Response = await _lean_call(lean, transport, method, path, data,
                                               params, headers, timeout)
        else:
            resp = await transport.request(
                method, path, content=data, params=dict(params or {}), headers=headers,
                **({"timeout": timeout} if timeout is not None else {}),
            )
    except Exception as exc:
        raise translate(exc, what) from exc
    if method == "GET" and resp.status_code == 404:
        return None
    if resp.status_code >= 300:
        code = resp.status_code
        cls = Gone if code == 410 else KubeError
        text, api_status = _status_message(resp)
        raise cls(f"{what}: {code}: {text}", code, api_status)
    try:
        out = resp.json()
    except ValueError:
        return {}
    return out if isinstance(out, dict) else {}


async def _lean_call(lean: http11.Http11Pool, transport: Any, method: str, path: str,
                     data: bytes | None, params: Mapping[str, str] | None,
                     headers: Mapping[str, str], timeout: float | None) -> http11.LeanResponse:
    """``http11``'s request, counted as the full stack's ``_CountingTransport`` counts."""
    counter = getattr(transport, "_transport", None)
    count = counter._count if isinstance(counter, _CountingTransport) else None
    if count is not None:
        verb, resource = classify(method, path, dict(params or {}),
                                  headers.get("Content-Type"))
    try:
        answer = await lean.request(method, path, body=data, params=params, headers=headers,
                                    timeout=timeout)
    except Exception:
        if count is not None:
            count(verb, resource, "error")
        raise
    if count is not None:
        count(verb, resource, str(answer.status))
    return http11.LeanResponse(answer.status, answer.body)
