"""The lean HTTP/1.1 transport under httpx, against raw asyncio servers on loopback that write exact
bytes: framing (Content-Length, chunked in any split, read-to-close, no body), keep-alive reuse and
its limits, errors and timeouts as httpx's exception classes, request bodies, receive stamps; and the
traced client over it reading a compressed stream (httpx decodes, the client stamps)."""

from __future__ import annotations

import asyncio
import gzip
import socket
import time
from typing import Self

import httpx
import pytest

from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.instrumentation.client.transport import RECEIPTS, ChunkedDecoder, StreamingTransport
from phaselens.loadgen.scripted_server import completion_chunk
from phaselens.reference_server.serving.sse import DONE_EVENT

CHUNKED_BODY = b"4;ext=1\r\nWiki\r\n5\r\npedia\r\nE\r\n in\r\n\r\nchunks.\r\n0\r\nTrailer: x\r\n\r\n"
CHUNKED_PAYLOAD = b"Wikipedia in\r\n\r\nchunks."


class RawServer:
    """Loopback server: `respond(head, body, connection_no)` returns the pieces to write (bytes, or a
    float: seconds to sleep; None: close). Records each request and the number of connections."""

    def __init__(self, respond):
        self.respond, self.requests, self.connections = respond, [], 0

    async def __aenter__(self) -> Self:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc) -> None:
        self.server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        number = self.connections
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = next(
                    (
                        int(line.split(b":")[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    ),
                    0,
                )
                body = await reader.readexactly(length) if length else await _chunked_request_body(reader, head)
                self.requests.append((head, body))
                for piece in self.respond(head, body, number):
                    if piece is None:
                        writer.close()
                        return
                    if isinstance(piece, float):
                        await asyncio.sleep(piece)
                    else:
                        writer.write(piece)
                        await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.CancelledError):
            writer.close()  # the client went away, or the test is over


async def _chunked_request_body(reader: asyncio.StreamReader, head: bytes) -> bytes:
    if b"transfer-encoding: chunked" not in head.lower():
        return b""
    body = b""
    while size := int((await reader.readuntil(b"\r\n")).strip(), 16):
        body += (await reader.readexactly(size + 2))[:-2]
    await reader.readuntil(b"\r\n")
    return body


def run(respond, exchange, **transport_kw):
    """`exchange(client, server)` against a RawServer; returns its result and the server."""

    async def main():
        async with RawServer(respond) as server:
            transport = StreamingTransport(**transport_kw)
            async with httpx.AsyncClient(transport=transport, timeout=httpx.Timeout(2.0)) as client:
                return await exchange(client, server), server

    return asyncio.run(main())


def get_bodies(n):
    async def exchange(client, server):
        return [(r.status_code, r.content) for r in [await client.get(server.url + "/x") for _ in range(n)]]

    return exchange


def test_content_length_bodies_reuse_one_connection():
    reply = lambda head, body, no: [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhello"]  # noqa: E731
    bodies, server = run(reply, get_bodies(3))
    assert bodies == [(200, b"hello")] * 3 and server.connections == 1
    assert all(
        head.startswith(b"GET /x HTTP/1.1\r\n") and b"\r\nhost: 127.0.0.1:" in head.lower()
        for head, _ in server.requests
    )


@pytest.mark.parametrize("piece", [1, 2, 3, 7, 100])
def test_chunked_body_in_any_split(piece):
    wire = b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + CHUNKED_BODY
    pieces = [wire[i : i + piece] for i in range(0, len(wire), piece)]
    reply = lambda head, body, no: [p for part in pieces for p in (part, 0.0)]  # noqa: E731
    bodies, server = run(reply, get_bodies(2))
    assert bodies == [(200, CHUNKED_PAYLOAD)] * 2 and server.connections == 1


def test_chunked_decoder_every_two_way_split():
    for cut in range(len(CHUNKED_BODY) + 1):
        decoder = ChunkedDecoder()
        out = decoder.feed(CHUNKED_BODY[:cut]) + decoder.feed(CHUNKED_BODY[cut:])
        assert (out, decoder.done, decoder.extra) == (CHUNKED_PAYLOAD, True, False), cut


@pytest.mark.parametrize("bad", [b"zz\r\nab\r\n", b"0x2\r\nab\r\n", b"2\r\nabXY", b"2\r\n" + b"1" * 5000])
def test_chunked_decoder_rejects_bad_framing(bad):
    with pytest.raises(ValueError):
        ChunkedDecoder().feed(bad + b"\r\n0\r\n\r\n")


def test_connection_close_and_http10_are_not_reused():
    replies = {
        1: b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 1\r\n\r\na",
        2: b"HTTP/1.0 200 OK\r\nContent-Length: 1\r\n\r\nb",
        3: b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nc",
    }
    bodies, server = run(lambda head, body, no: [replies[no]], get_bodies(4))
    assert bodies == [(200, b"a"), (200, b"b"), (200, b"c"), (200, b"c")] and server.connections == 3


def test_read_to_close_no_body_and_interim_responses():
    replies = {
        1: [b"HTTP/1.1 200 OK\r\n\r\nuntil ", 0.01, b"close", None],
        2: [b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 204 No Content\r\n\r\n"],
    }
    bodies, server = run(lambda head, body, no: replies[min(no, 2)], get_bodies(3))
    assert bodies == [(200, b"until close"), (204, b""), (204, b"")] and server.connections == 2


def test_idle_connection_closed_by_the_server_is_replaced():
    reply = lambda head, body, no: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 0.05, None]  # noqa: E731

    async def exchange(client, server):
        first = await client.get(server.url)
        await asyncio.sleep(0.2)  # the server has closed the idle connection by now
        return [first.content, (await client.get(server.url)).content]

    bodies, server = run(reply, exchange)
    assert bodies == [b"ok", b"ok"] and server.connections == 2


@pytest.mark.parametrize(
    "reply, match",
    [
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", None], "complete message body"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc", None], "complete message body"),
        ([b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\nnothex\r\n"], "chunk size"),
        ([b"SMTP ready\r\n\r\n"], "status line"),
        ([b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n"], "header line"),
        ([b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab"], "content-length"),
        ([None], "without sending a response"),
    ],
)
def test_broken_responses_raise_remote_protocol_error(reply, match):
    async def exchange(client, server):
        with pytest.raises(httpx.RemoteProtocolError, match=match):
            await client.get(server.url)
        return True

    assert run(lambda head, body, no: reply, exchange)[0]


def test_read_timeout_and_connect_errors_are_httpx_errors():
    async def exchange(client, server):
        with pytest.raises(httpx.ReadTimeout):
            await client.get(server.url, timeout=httpx.Timeout(2.0, read=0.1))
        return True

    assert run(lambda head, body, no: [b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nhe", 1.0], exchange)[0]

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: refused
        port = s.getsockname()[1]

        async def refused():
            async with httpx.AsyncClient(transport=StreamingTransport()) as client:
                await client.get(f"http://127.0.0.1:{port}/")

        with pytest.raises(httpx.ConnectError):
            asyncio.run(refused())


def test_pool_limit_queues_requests_and_times_out():
    reply = lambda head, body, no: [0.1, b"HTTP/1.1 200 OK\r\nContent-Length: 1\r\n\r\nz"]  # noqa: E731

    async def exchange(client, server):
        both = await asyncio.gather(client.get(server.url), client.get(server.url))
        with pytest.raises(httpx.PoolTimeout):
            async with client.stream("GET", server.url):
                await client.get(server.url, timeout=httpx.Timeout(2.0, pool=0.05))
        return [r.content for r in both]

    bodies, server = run(reply, exchange, max_connections=1)
    assert bodies == [b"z", b"z"] and server.connections == 1


def test_request_bodies_in_memory_and_streamed():
    reply = lambda head, body, no: [b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)]  # noqa: E731

    async def parts():
        for part in (b"one ", b"", b"two"):
            yield part

    async def exchange(client, server):
        fixed = await client.post(server.url + "/p?q=1", json={"a": "é"})
        streamed = await client.post(server.url, content=parts())
        return fixed.content, streamed.content

    (fixed, streamed), server = run(reply, exchange)
    assert fixed == '{"a":"é"}'.encode() and streamed == b"one two"
    assert server.requests[0][0].startswith(b"POST /p?q=1 HTTP/1.1\r\n")
    assert b"transfer-encoding: chunked" in server.requests[1][0].lower()


def test_each_network_read_is_stamped_when_it_arrives():
    written: list[int] = []

    def reply(head, body, no):
        def stamp_then(data):
            written.append(time.perf_counter_ns())
            return data

        yield b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
        for i in range(3):
            yield 0.03
            yield stamp_then(b"2\r\nc%d\r\n" % i)
        yield b"0\r\n\r\n"

    async def exchange(client, server):
        async with client.stream("GET", server.url) as response:
            return [piece async for piece in response.extensions[RECEIPTS].stamped()]

    pieces, _ = run(reply, exchange)
    assert [p for _, p in pieces] == [b"c0", b"c1", b"c2"]
    assert all(0 <= (stamp - w) / 1e6 < 20 for (stamp, _), w in zip(pieces, written, strict=False))


def test_traced_client_reads_a_compressed_stream():
    body = gzip.compress(completion_chunk("a") + completion_chunk("b", finish="stop") + DONE_EVENT)
    head = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nContent-Encoding: gzip\r\nContent-Length: %d\r\n\r\n"

    async def main():
        async with RawServer(lambda h, b, no: [head % len(body) + body]) as server:
            async with TracedClient(server.url) as client:
                return await client.stream("completions", {"model": "m", "prompt": "x"})

    r = asyncio.run(main())
    assert r.ok and r.saw_done and r.chunk_tokens == [1, 1] and r.finish_reasons == ["stop"]


def test_idle_connection_with_stray_bytes_is_not_reused():
    reply = lambda head, body, no: [b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok", 0.02, b"stray"]  # noqa: E731

    async def exchange(client, server):
        first = await client.get(server.url)
        await asyncio.sleep(0.1)  # the stray bytes have arrived on the idle connection
        return [first.content, (await client.get(server.url)).content]

    bodies, server = run(reply, exchange)
    assert bodies == [b"ok", b"ok"] and server.connections == 2
