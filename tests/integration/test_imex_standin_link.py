"""The IMEX stand-in's link framing (``LineLink``) over real loopback sockets: lines
split across reads arrive whole and in order, a line past ``MAX_LINE`` ends the link with
the reason named, and a missing handshake line is a timeout, not a hang."""

from __future__ import annotations

import asyncio

import pytest

from tests.sandbox.imex_standin import MAX_LINE, LineLink


async def _pair() -> tuple[LineLink, asyncio.StreamWriter, asyncio.Server]:
    """A LineLink dialled from a plain socket's side: the test writes raw bytes at it."""
    got: asyncio.Future[asyncio.StreamWriter] = asyncio.get_running_loop().create_future()

    async def accept(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        got.set_result(w)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, link = await asyncio.get_running_loop().create_connection(LineLink, "127.0.0.1", port)
    return link, await got, server


def test_lines_split_across_reads_arrive_whole_and_in_order() -> None:
    async def go() -> list[bytes]:
        link, raw, server = await _pair()
        seen: list[bytes] = []
        raw.write(b'{"type":"hello"}\n{"a":')
        await raw.drain()
        first = await link.next_line(5)  # the handshake line, queued
        link.start(lambda _l, line: seen.append(line))
        for chunk in (b"1}\n", b'{"b"', b":2}\n{", b'"c":3}\n'):
            raw.write(chunk)
            await raw.drain()
            await asyncio.sleep(0.05)  # separate reads on the link's side
        raw.close()
        why = await asyncio.wait_for(link.closed, 5)
        server.close()
        assert isinstance(why, ConnectionError) and "closed" in str(why)
        return [first, *seen]

    assert asyncio.run(go()) == [b'{"type":"hello"}\n', b'{"a":1}\n', b'{"b":2}\n',
                                 b'{"c":3}\n']


def test_a_line_past_the_limit_ends_the_link_naming_why() -> None:
    async def go() -> BaseException:
        link, raw, server = await _pair()
        link.start(lambda _l, _line: None)
        raw.write(b"x" * (MAX_LINE + 4096))  # no newline: a peer that never frames
        await raw.drain()
        why = await asyncio.wait_for(link.closed, 5)
        raw.close()
        server.close()
        return why

    why = asyncio.run(go())
    assert isinstance(why, ValueError) and "line too long" in str(why)


def test_a_missing_handshake_line_is_a_timeout() -> None:
    async def go() -> None:
        link, raw, server = await _pair()
        try:
            with pytest.raises(TimeoutError):
                await link.next_line(0.2)
            assert not link.closed.done()  # the caller decides to drop it, not the link
        finally:
            link.close()
            raw.close()
            server.close()

    asyncio.run(go())
