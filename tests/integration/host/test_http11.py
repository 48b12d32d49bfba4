"""The lean HTTP/1.1 path (host_agent/kube/http11.py) over real sockets on loopback.

A scripted server answers each request with bytes the test chooses, so the framing
cases (Content-Length, chunked, close-delimited, a kept-alive connection the server
dropped, malformed answers) are exercised as a real server sends them. The API double
then checks that api_call really takes this path, with auth, and counts it.
"""

from __future__ import annotations

import asyncio
import http.server
import itertools
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from lightkube import AsyncClient, KubeConfig

from host_agent.kube import http11, lean_listwatch
from host_agent.kube.client import KubeError, api_call, count_requests
from host_agent.kube.writers import SliceWriter
from tests.sandbox.kube_api.fixtures import (  # noqa: F401
    KubeApiHandle,
    kube_api_fixture,
    lightkube_client_fixture,
)

pytestmark = pytest.mark.timeout(30)

Script = Callable[[int, bytes], bytes | None]
"""(request number on this connection, request head) -> raw answer; None: close."""


class Scripted:
    """A loopback server that reads each request head (and body) and answers per script."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.heads: list[bytes] = []
        self.connections = 0
        self.server: asyncio.Server | None = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        n = 0
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.decode().split("\r\n"):
                    if line.lower().startswith("content-length:"):
                        length = int(line.split(":", 1)[1])
                await reader.readexactly(length)
                self.heads.append(head)
                answer = self.script(n, head)
                n += 1
                if answer is None:
                    break
                writer.write(answer)
                await writer.drain()
                if b"Connection: close" in answer:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    async def __aenter__(self) -> http11.Http11Pool:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self.server.sockets[0].getsockname()[1]
        return http11.Http11Pool("http", "127.0.0.1", port, "", ssl_context=None,
                                 bearer=lambda again: "Bearer t2" if again else "Bearer t1",
                                 user_agent="imex-host-agent/test", timeout=5.0)

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()


def ok(body: bytes, extra: str = "") -> bytes:
    return (f"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n{extra}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


async def test_keep_alive_reuses_one_connection_and_sends_the_head_it_should() -> None:
    srv = Scripted(lambda n, head: ok(b'{"n": %d}' % n))
    async with srv as pool:
        first = await pool.request("PATCH", "/api/v1/namespaces/d/services/s", body=b"{}",
                                   params={"fieldManager": "m", "force": "true"},
                                   headers={"Content-Type": "application/merge-patch+json"})
        second = await pool.request("GET", "/api/v1/namespaces/d/services/s")
        await pool.aclose()
    assert (first.status, first.body, second.body) == (200, b'{"n": 0}', b'{"n": 1}')
    assert srv.connections == 1
    lines = srv.heads[0].decode().split("\r\n")
    assert lines[0] == "PATCH /api/v1/namespaces/d/services/s?fieldManager=m&force=true HTTP/1.1"
    assert "Authorization: Bearer t1" in lines
    assert "User-Agent: imex-host-agent/test" in lines
    assert "Content-Length: 2" in lines
    assert "Content-Type: application/merge-patch+json" in lines


async def test_a_chunked_answer_is_joined_and_trailers_are_read() -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"4;ext=1\r\n{\"a\"\r\n5\r\n: 10}\r\n0\r\nX-Trailer: y\r\n\r\n")
    srv = Scripted(lambda n, head: chunked)
    async with srv as pool:
        one = await pool.request("GET", "/x")
        two = await pool.request("GET", "/x")  # the connection was left at a clean boundary
        await pool.aclose()
    assert one.body == two.body == b'{"a": 10}'
    assert srv.connections == 1


async def test_connection_close_is_honoured_and_a_close_delimited_body_read() -> None:
    srv = Scripted(lambda n, head: b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\n{}")
    async with srv as pool:
        # the server closes after each answer, which ends the body
        answers = [await pool.request("GET", "/x") for _ in range(3)]
    assert [a.body for a in answers] == [b"{}"] * 3
    assert srv.connections == 3


async def test_a_kept_connection_the_server_dropped_is_retried_on_a_new_one() -> None:
    # the server answers once per connection, then drops it without a word: the next
    # request on the kept connection reads nothing and goes out again on a fresh one
    srv = Scripted(lambda n, head: ok(b"{}") if n == 0 else None)
    async with srv as pool:
        await pool.request("GET", "/x")
        await asyncio.sleep(0)
        second = await pool.request("PATCH", "/x", body=b"{}")
    assert second.status == 200
    assert srv.connections == 2


async def test_a_401_reads_the_token_again_once() -> None:
    def script(n: int, head: bytes) -> bytes:
        if b"Bearer t1" in head:
            return b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 2\r\n\r\n{}"
        return ok(b'{"ok": true}')

    srv = Scripted(script)
    async with srv as pool:
        answer = await pool.request("GET", "/x")
    assert answer.body == b'{"ok": true}'
    assert [b"Bearer t1" in h for h in srv.heads] == [True, False]


@pytest.mark.parametrize(("raw", "says"), [
    (b"SMTP ready\r\n\r\n", "not an HTTP/1.1 status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed response header"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: -5\r\n\r\n", "bad Content-Length"),
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "bad chunk size"),
])
async def test_a_malformed_answer_is_an_error_naming_what_is_wrong(raw: bytes, says: str
                                                                   ) -> None:
    srv = Scripted(lambda n, head: raw)
    async with srv as pool:
        with pytest.raises(http11.ProtocolError, match=says):
            await pool.request("GET", "/x")


async def test_an_answer_that_never_comes_times_out() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read()  # never answers
        writer.close()

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    pool = http11.Http11Pool("http", "127.0.0.1", port, "", ssl_context=None,
                             bearer=lambda again: None, user_agent="t", timeout=5.0)
    try:
        with pytest.raises(TimeoutError):
            await pool.request("GET", "/x", timeout=0.3)
    finally:
        await pool.aclose()
        server.close()


async def test_api_call_takes_the_lean_path_against_the_double_and_is_counted(
        client: AsyncClient) -> None:
    counted: list[tuple[str, str, str]] = []
    count_requests(client, lambda verb, resource, code: counted.append((verb, resource, code)))
    lean = http11.for_client(client)
    assert lean is not None, "a token kubeconfig without a proxy must take the lean path"
    body = {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": "e-imex-x", "namespace": "default",
                         "labels": {"kubernetes.io/service-name": "e-imex"}},
            "addressType": "IPv4", "endpoints": [{"addresses": ["10.0.0.1"]}]}
    rv = await SliceWriter(client, "test").apply_slice(body)
    assert rv
    got = await api_call(client, "GET",
                         "/apis/discovery.k8s.io/v1/namespaces/default/endpointslices/e-imex-x")
    assert got is not None and got["endpoints"][0]["addresses"] == ["10.0.0.1"]
    assert await api_call(client, "GET", "/api/v1/namespaces/default/services/nope") is None
    with pytest.raises(KubeError) as err:
        await SliceWriter(client, "test").apply_slice(body, resource_version=rv + "1")
    assert err.value.status == 409
    assert str(err.value).startswith("apply EndpointSlice default/e-imex-x: 409: ")
    assert [c[2] for c in counted] == ["201", "200", "404", "409"]  # apply created it
    assert lean._idle, "the connection is kept for the next call"


def test_a_proxy_or_an_exec_plugin_keeps_the_full_stack(tmp_path: Path,
                                                        kube_api: KubeApiHandle,
                                                        monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    monkeypatch.setenv("HTTPS_PROXY", "http://127.0.0.1:9")
    monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")
    proxied = AsyncClient(KubeConfig.from_file(kube_api.kubeconfig_path), trust_env=True)
    assert http11.for_client(proxied) is None
    monkeypatch.delenv("HTTPS_PROXY")
    monkeypatch.delenv("HTTP_PROXY")
    exec_config = KubeConfig.from_dict({
        "clusters": [{"name": "c", "cluster": {"server": "https://127.0.0.1:6443"}}],
        "users": [{"name": "u", "user": {"exec": {
            "apiVersion": "client.authentication.k8s.io/v1", "command": "true"}}}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x"})
    assert http11.for_client(AsyncClient(exec_config)) is None


async def test_a_watch_stream_is_split_into_events_across_chunks_and_410_is_gone() -> None:
    def chunk(data: bytes) -> bytes:
        return b"%x\r\n%s\r\n" % (len(data), data)

    events = (b'{"type":"ADDED","object":{"metadata":{"name":"a","resourceVersion":"7"}}}\n'
              b'{"type":"BOOKMARK","object":{"metadata":{"resourceVersion":"9"}}}\n'
              b'{"type":"ERROR","object":{"kind":"Status","code":410,"reason":"Expired",'
              b'"message":"too old resource version: 5 (9)"}}\n')
    cut = [0, 30, 31, 100, 170, len(events)]  # boundaries inside lines and at a newline
    body = b"".join(chunk(events[a:b]) for a, b in itertools.pairwise(cut)) + b"0\r\n\r\n"
    srv = Scripted(lambda n, head: b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
                   + body)
    got: list[tuple[str, dict[str, Any]]] = []
    async with srv as pool:
        with pytest.raises(lean_listwatch.LeanError) as err:
            async for event in lean_listwatch.watch(pool, "/api/v1/services",
                                                    {"watch": "true", "resourceVersion": "5"},
                                                    idle=5.0):
                got.append(event)
        await pool.aclose()
    assert [(t, o["metadata"]["resourceVersion"]) for t, o in got] == [("ADDED", "7"),
                                                                     ("BOOKMARK", "9")]
    assert err.value.status == 410
    assert err.value.api_status is not None and err.value.api_status["reason"] == "Expired"
    assert b"watch=true&resourceVersion=5" in srv.heads[0]


async def test_a_watch_the_server_ends_is_resumed_from_the_last_version_seen() -> None:
    def script(n: int, head: bytes) -> bytes:
        if b"resourceVersion=5" in head:  # the first stream: one event, then a clean end
            line = b'{"type":"ADDED","object":{"metadata":{"resourceVersion":"8"}}}\n'
            return (b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: %d\r\n\r\n"
                    % len(line)) + line
        return b"HTTP/1.1 403 Forbidden\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}"

    srv = Scripted(script)
    async with srv as pool:
        with pytest.raises(lean_listwatch.LeanError) as err:
            async for _ in lean_listwatch.watch(pool, "/api/v1/services",
                                                {"resourceVersion": "5"}, idle=5.0):
                pass
    assert err.value.status == 403
    assert b"resourceVersion=8" in srv.heads[1], "the resume starts after the event seen"


async def test_a_list_is_paged_with_continue_against_the_double(client: AsyncClient) -> None:
    for i in range(5):
        await api_call(client, "POST", "/api/v1/namespaces/default/configmaps",
                       body={"apiVersion": "v1", "kind": "ConfigMap",
                             "metadata": {"name": f"cm{i}", "namespace": "default"}})
    lean = http11.for_client(client)
    assert lean is not None
    items, rv = await lean_listwatch.list_all(lean, "/api/v1/namespaces/default/configmaps",
                                              {}, 2, lambda o: o)
    assert sorted(o["metadata"]["name"] for o in items) == [f"cm{i}" for i in range(5)]
    assert rv.isdigit()


class _PagedHandler(http.server.BaseHTTPRequestHandler):
    """Three pages of one object each, on a server thread of its own (not the test's
    loop), so a request the client sends is seen while the client is still busy."""

    protocol_version = "HTTP/1.1"
    seen: list[str] = []

    def do_GET(self) -> None:
        type(self).seen.append(self.path)
        query = parse_qs(urlsplit(self.path).query)
        n = int(query.get("continue", ["0"])[0])
        meta: dict[str, Any] = {"resourceVersion": "9"}
        if n < 2:
            meta["continue"] = str(n + 1)
        body = json.dumps({"kind": "ConfigMapList", "metadata": meta,
                           "items": [{"metadata": {"name": f"cm{n}"}}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


async def test_the_next_page_is_asked_for_before_this_page_is_reduced() -> None:
    """list_all sends the request for page N+1 before ``view`` runs over page N, so the
    server builds the next page while the agent reduces this one (issue 27: the two
    had taken turns through a 20-page list of 10,000 VMIs)."""
    _PagedHandler.seen = []
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PagedHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    pool = http11.Http11Pool("http", "127.0.0.1", server.server_address[1], "",
                             ssl_context=None, bearer=lambda again: None,
                             user_agent="imex-host-agent/test", timeout=5.0)
    asked_before_reduced: list[int] = []

    def view(obj: dict[str, Any]) -> dict[str, Any]:
        # the server thread records a request as it reads it; give it up to 5 s
        want = min(int(obj["metadata"]["name"][2:]) + 2, 3)
        deadline = time.monotonic() + 5.0
        while len(_PagedHandler.seen) < want and time.monotonic() < deadline:
            time.sleep(0.01)
        asked_before_reduced.append(len(_PagedHandler.seen))
        return obj

    try:
        items, rv = await lean_listwatch.list_all(pool, "/api/v1/configmaps", {}, 1, view)
    finally:
        await pool.aclose()
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
    assert [o["metadata"]["name"] for o in items] == ["cm0", "cm1", "cm2"] and rv == "9"
    assert asked_before_reduced == [2, 3, 3], "page 2 (3) was asked for before page 1 (2)"
    assert all("limit=1" in p for p in _PagedHandler.seen)


async def test_a_failed_page_fails_the_list_and_a_failed_view_cancels_the_next_page(
) -> None:
    def script(n: int, head: bytes) -> bytes:
        if b"continue=" not in head:
            return ok(b'{"metadata":{"continue":"c1","resourceVersion":"3"},'
                      b'"items":[{"metadata":{"name":"a"}}]}')
        return b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 2\r\n\r\n{}"

    def broken(obj: dict[str, Any]) -> dict[str, Any]:
        raise ValueError("a bug in a view")

    def pages() -> list[asyncio.Task[Any]]:
        return [t for t in asyncio.all_tasks()
                if getattr(t.get_coro(), "__name__", "") == "_page_or_error"]

    srv = Scripted(script)
    async with srv as pool:
        with pytest.raises(lean_listwatch.LeanError) as err:
            await lean_listwatch.list_all(pool, "/api/v1/configmaps", {}, 5, lambda o: o)
        assert err.value.status == 500
        with pytest.raises(ValueError):
            await lean_listwatch.list_all(pool, "/api/v1/configmaps", {}, 5, broken)
        assert not pages(), "the next page is not left running"
