"""The Service stand-in (tests/sandbox/service_proxy.py): new connections go to the
endpoints in turn, none means a connection closed at once, an established one keeps
its backend until that backend goes."""

from __future__ import annotations

import http.server
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.sandbox.service_proxy import ServiceProxy


class _Named(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = self.server.name.encode()  # type: ignore[attr-defined]
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def backends() -> Iterator[list[http.server.ThreadingHTTPServer]]:
    servers = []
    for name in ("a", "b"):
        srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Named)
        srv.name = name  # type: ignore[attr-defined]
        threading.Thread(target=srv.serve_forever, daemon=True).start()
        servers.append(srv)
    yield servers
    for srv in servers:
        srv.shutdown()
        srv.server_close()


def port(srv: http.server.ThreadingHTTPServer) -> int:
    return int(srv.server_address[1])


def test_connections_go_to_the_endpoints_in_turn(
        backends: list[http.server.ThreadingHTTPServer]) -> None:
    with ServiceProxy() as svc:
        with pytest.raises(httpx.HTTPError):  # no endpoint: closed at once, no hang
            httpx.get(svc.url, timeout=2)
        for srv in backends:
            svc.add(port(srv))
        seen = {httpx.get(svc.url, timeout=2).text for _ in range(4)}
        assert seen == {"a", "b"}
        svc.remove(port(backends[0]))
        assert {httpx.get(svc.url, timeout=2).text for _ in range(3)} == {"b"}
        assert svc.endpoints() == [port(backends[1])]


def test_an_established_connection_keeps_its_backend_until_it_goes() -> None:
    listener = socket.create_server(("127.0.0.1", 0))
    with ServiceProxy() as svc:
        svc.add(listener.getsockname()[1])
        client = socket.create_connection(("127.0.0.1", svc.port), timeout=5)
        upstream, _ = listener.accept()
        svc.remove(listener.getsockname()[1])  # out of the Service: the connection stays
        client.sendall(b"ping")
        assert upstream.recv(4) == b"ping"
        upstream.sendall(b"pong")
        assert client.recv(4) == b"pong"
        upstream.close()  # the backend goes: the client sees the end
        assert client.recv(4) == b""
        client.close()
    listener.close()
