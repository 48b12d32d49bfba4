"""Lists and watches over the lean HTTP path (``http11``), as plain JSON mappings.

``ListWatcher`` uses these when its client allows the lean path: every object the
agent caches arrives through them, and through lightkube each one was decoded into
a resource object and turned back into a dict (``plain``), which was most of an
informer's CPU per event. The URLs and parameters are still built by lightkube's
request builder, so both paths ask the same question.

The semantics are lightkube's: a list is paged by ``limit``/``continue`` and
returns the last page's resourceVersion; a watch that the server ends cleanly is
resumed from the last version seen, and an ``ERROR`` event raises with its Status.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Mapping
from typing import Any

import msgspec

from host_agent.kube import http11
from host_agent.kube.objects import Obj


class LeanError(Exception):
    """A refused list or watch: ``status`` (0: no answer) and the API's Status if any."""

    def __init__(self, message: str, status: int = 0,
                 api_status: Mapping[str, Any] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.api_status = dict(api_status) if api_status is not None else None


def _status_body(body: bytes) -> tuple[str, Obj | None]:
    try:
        decoded = msgspec.json.decode(body)
    except msgspec.DecodeError:
        return body[:200].decode("utf-8", "replace"), None
    if isinstance(decoded, dict) and decoded.get("kind") == "Status":
        return str(decoded.get("message", "")), decoded
    return str(decoded)[:200], None


async def list_all(pool: http11.Http11Pool, path: str, params: Mapping[str, str],
                   page: int, view: Callable[[Obj], Obj]) -> tuple[list[Obj], str]:
    """Every object at ``path`` through ``view``, and the list's resourceVersion.

    The next page is asked for before this page's objects go through ``view``, so
    the server builds it while the agent reduces this one: at 10,000 VMIs (20
    pages) the two had taken turns, and the first sync waited on each in full
    (tests/bench ``sync_profile``, issue 27). A page not wanted any more (a failure,
    a cancel) is cancelled by the task group that owns it.
    """
    items: list[Obj] = []
    query = {**params, "limit": str(page)}
    failure: Exception | None = None
    version = ""
    async with asyncio.TaskGroup() as tg:
        pending = tg.create_task(_page_or_error(pool, path, dict(query)))
        try:
            while True:
                answer = await pending
                if isinstance(answer, Exception):
                    raise answer
                page_items, meta = answer
                cont = meta.get("continue")
                if cont:
                    query["continue"] = cont
                    pending = tg.create_task(_page_or_error(pool, path, dict(query)))
                    await asyncio.sleep(0)  # lets the request go out before the work below
                items.extend(view(o) for o in page_items if isinstance(o, dict))
                if not cont:
                    version = str(meta.get("resourceVersion") or "")
                    break
        except Exception as exc:  # raised as itself below, not in a group
            pending.cancel()
            failure = exc
    if failure is not None:
        raise failure
    return items, version


async def _page_or_error(pool: http11.Http11Pool, path: str,
                         query: Mapping[str, str]) -> tuple[list[Any], Obj] | Exception:
    """``_page``, its failure returned rather than raised (which would cancel the group)."""
    try:
        return await _page(pool, path, query)
    except Exception as exc:
        return exc


async def _page(pool: http11.Http11Pool, path: str,
                query: Mapping[str, str]) -> tuple[list[Any], Obj]:
    """One page of a list: its items (as they came) and its list metadata."""
    answer = await pool.request("GET", path, params=query,
                                headers={"Accept": "application/json"})
    if answer.status != 200:
        text, status = _status_body(answer.body)
        raise LeanError(f"{answer.status}: {text}", answer.status, status)
    try:
        body = msgspec.json.decode(answer.body)
        meta = body.get("metadata") or {}
        page_items = body.get("items") or []
    except (msgspec.DecodeError, AttributeError) as exc:
        raise LeanError(f"a list answer that is not a list: {exc}") from exc
    if not isinstance(meta, dict) or not isinstance(page_items, list):
        raise LeanError("a list answer whose metadata or items have the wrong type")
    return page_items, meta


async def watch(pool: http11.Http11Pool, path: str, params: Mapping[str, str],
                idle: float) -> AsyncGenerator[tuple[str, Obj], None]:
    """(type, object) from ``params["resourceVersion"]`` on, resumed when the server ends
    a stream cleanly; ``TimeoutError`` when a stream is silent for ``idle`` seconds."""
    query = dict(params)
    while True:
        stream = pool.lines(path, query)
        try:
            while True:
                try:
                    async with asyncio.timeout(idle):
                        line = await stream.__anext__()
                except StopAsyncIteration:
                    break
                except http11.StatusError as exc:
                    text, status = _status_body(exc.body)
                    raise LeanError(f"{exc.status}: {text}", exc.status, status) from exc
                if not line.strip():
                    continue
                try:
                    event = msgspec.json.decode(line)
                    kind, obj = event["type"], event["object"]
                except (msgspec.DecodeError, KeyError, TypeError) as exc:
                    raise LeanError(f"a watch line that is not an event: {exc}") from exc
                if kind == "ERROR":
                    code = obj.get("code") if isinstance(obj, dict) else None
                    raise LeanError(f"{code}: {obj.get('message', '')}"
                                    if isinstance(obj, dict) else str(obj),
                                    code if isinstance(code, int) else 0,
                                    obj if isinstance(obj, dict) else None)
                if not isinstance(obj, dict):
                    raise LeanError(f"a watch event whose object is not an object: {obj!r}")
                rv = (obj.get("metadata") or {}).get("resourceVersion")
                if isinstance(rv, str) and rv:
                    query["resourceVersion"] = rv
                yield kind, obj
        finally:
            await stream.aclose()
