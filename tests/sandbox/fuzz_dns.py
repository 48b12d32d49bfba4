"""A nameserver that answers each query with whatever a test makes of it.

It imitates a cluster DNS server (CoreDNS) answering over real UDP and TCP sockets on
loopback, but the answer is the test's: ``answer(query_wire) -> bytes | None`` builds
the reply (any bytes: a well-formed message, a wrong id, a truncated or looping one,
garbage), None drops the query (a timeout). The fuzzer (tests/fuzz/test_fuzz_dns.py)
drives the guest's DNS client against it; both sockets listen on one port, so a
truncated UDP answer is retried over TCP as against a real server.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
from collections.abc import Callable

Answer = Callable[[bytes, str], bytes | None]  # (query wire, "udp" or "tcp") -> reply


class _Udp(asyncio.DatagramProtocol):
    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.DatagramTransport)
        self.transport = transport

    def datagram_received(self, data: bytes, addr: tuple[str, int]) -> None:
        reply = self.answer(data, "udp")
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply[:65507], addr)


class FuzzDnsServer:
    """``async with FuzzDnsServer(answer) as port:`` serves on 127.0.0.1:port."""

    def __init__(self, answer: Answer) -> None:
        self.answer = answer
        self.queries = 0
        self._udp: asyncio.DatagramTransport | None = None
        self._tcp: asyncio.Server | None = None

    def _count(self, wire: bytes, how: str) -> bytes | None:
        self.queries += 1
        return self.answer(wire, how)

    async def _tcp_client(self, reader: asyncio.StreamReader,
                          writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(OSError, asyncio.IncompleteReadError):
            size = struct.unpack("!H", await reader.readexactly(2))[0]
            reply = self._count(await reader.readexactly(size), "tcp")
            if reply is not None:
                writer.write(struct.pack("!H", min(len(reply), 65535)) + reply[:65535])
                await writer.drain()
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

    async def __aenter__(self) -> int:
        loop = asyncio.get_running_loop()
        for _ in range(20):  # a port free for both UDP and TCP
            self._udp, _ = await loop.create_datagram_endpoint(
                lambda: _Udp(self._count), local_addr=("127.0.0.1", 0))
            port = int(self._udp.get_extra_info("sockname")[1])
            try:
                self._tcp = await asyncio.start_server(self._tcp_client, "127.0.0.1", port,
                                                       family=socket.AF_INET)
                return port
            except OSError:
                self._udp.close()
        raise OSError("no port free for both UDP and TCP on 127.0.0.1")

    async def __aexit__(self, *exc: object) -> None:
        if self._udp is not None:
            self._udp.close()
        if self._tcp is not None:
            self._tcp.close()
            await self._tcp.wait_closed()
