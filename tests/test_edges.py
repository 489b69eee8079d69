"""The budget's edges on real loopback sockets: the kernel's receive stamp (`kernel_stamps`), the
server's inbound edge under uvicorn (`inbound`: a request that waits in the kernel while the event
loop is blocked), and the client's read of the first content bytes (`client_transport`, `client`)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Callable

import pytest
import uvicorn
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from phaselens.instrumentation import names
from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.instrumentation.client.transport import _Connection
from phaselens.instrumentation.hotpath.kernel_stamps import KernelStamper, enable_kernel_stamps
from phaselens.instrumentation.server.inbound import inbound_protocol
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from phaselens.loadgen.metrics import client_bottleneck
from phaselens.loadgen.report import client_bottleneck_note
from phaselens.loadgen.scripted_server import Reply, ScriptedServer, Step, completion_chunk, usage_chunk
from phaselens.reference_server.serve import bind
from phaselens.reference_server.serving.sse import DONE_EVENT

BLOCK_S = 0.3  # how long the server's event loop (or the client's) is blocked


def _pair() -> tuple[socket.socket, socket.socket, socket.socket]:
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    enable_kernel_stamps(listener)
    listener.listen()
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    return listener, sender, receiver


def _stamping_on(sender: socket.socket, receiver: socket.socket, stamper: KernelStamper) -> bool:
    """Wait (≤ 5 s) until packets carry a receive stamp: the kernel turns stamping on lazily, a
    moment after the first ask (a just-bound listener's)."""
    deadline = time.monotonic() + 5
    while True:
        sender.sendall(b"x")
        time.sleep(0.01)
        stamped = stamper.arrived_ts()
        receiver.recv(64)
        if stamped or time.monotonic() > deadline:
            return bool(stamped)


def test_the_kernel_stamp_dates_the_pending_bytes_without_consuming_them():
    listener, sender, receiver = _pair()
    stamper = KernelStamper(receiver.fileno(), time.monotonic_ns)
    try:
        assert stamper.available and stamper.arrived_ts() == 0  # nothing pending: not observed
        assert _stamping_on(sender, receiver, stamper), "the kernel gave no receive stamp"
        before = time.monotonic_ns()
        sender.sendall(b"request")
        after = time.monotonic_ns()
        time.sleep(0.05)
        arrived = stamper.arrived_ts()
        # loopback delivers inside the send call; the realtime → monotonic move costs microseconds
        assert before - 1_000_000 <= arrived <= after + 1_000_000
        assert time.monotonic_ns() - arrived >= 50_000_000
        assert receiver.recv(64) == b"request"  # the peek left the bytes for the real reader
    finally:
        stamper.close()
        for s in (sender, receiver, listener):
            s.close()


def test_a_client_read_takes_only_the_bytes_its_kernel_stamp_dates():
    """Bytes that arrive between the client's peek (`get_buffer`) and the event loop's recv are not
    in that read: it would date them with the earlier packet's stamp, and the late-client estimate
    would then name a later chunk's send gap as a wait the client never had. Driven as asyncio's
    selector transport drives a buffered protocol: get_buffer, recv_into, buffer_updated."""
    listener, sender, receiver = _pair()
    conn = _Connection(("http", "127.0.0.1", 0), time.monotonic_ns, memoryview(bytearray(1 << 16)))
    try:
        conn.connection_made(_SocketOnly(receiver))
        assert _stamping_on(sender, receiver, conn._stamper), "the kernel gave no receive stamp"
        sender.sendall(b"first content chunk")
        time.sleep(0.02)
        buf = conn.get_buffer(-1)
        peeked_at = time.monotonic_ns()
        sender.sendall(b"a later chunk")  # after the peek, before the loop's recv
        conn.buffer_updated(receiver.recv_into(buf))
        _, first, first_arrived = conn.pop(None)
        assert first == b"first content chunk"
        conn.buffer_updated(receiver.recv_into(conn.get_buffer(-1)))
        _, second, second_arrived = conn.pop(None)
        assert second == b"a later chunk"
        assert first_arrived < peeked_at <= second_arrived  # each read dated by its own packet
    finally:
        conn._stamper.close()
        for s in (sender, receiver, listener):
            s.close()


class _SocketOnly:
    """The one thing `_Connection.connection_made` asks of its transport: the socket, over plain TCP."""

    def __init__(self, sock: socket.socket) -> None:
        self._extra = {"socket": sock, "sslcontext": None}

    def get_extra_info(self, name: str):
        return self._extra[name]


async def _answer_ok(send) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
    await send({"type": "http.response.body", "body": b"ok"})


class BlockingApp:
    """/block holds the event loop for BLOCK_S (set `blocking` first); anything else answers at once."""

    def __init__(self) -> None:
        self.blocking = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] == "/block":
            self.blocking.set()
            time.sleep(BLOCK_S)  # the loop's thread is busy: nothing is read meanwhile
        await _answer_ok(send)


@contextlib.contextmanager
def _inbound_uvicorn(app, http=AutoHTTPProtocol):
    """`app` under phaselens's ingress middleware, served by uvicorn with its HTTP protocol `http`
    wrapped by `InboundProtocol` in a thread; yields the address and `roots(count)`: the first
    `count` SERVER spans' attributes (a request closes just after its last byte went)."""
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    telemetry = ServerTelemetry(provider, MeterProvider(), builder="thread")
    sock = bind("127.0.0.1", 0)  # it asks for receive stamps: wait until the kernel gives them
    listener, sender, receiver = _pair()
    stamper = KernelStamper(receiver.fileno(), time.monotonic_ns)
    try:
        assert _stamping_on(sender, receiver, stamper), "the kernel gave no receive stamp"
    finally:
        stamper.close()
        for s in (sender, receiver, listener):
            s.close()
    config = uvicorn.Config(
        telemetry.asgi(app), log_level="warning", access_log=False, http=inbound_protocol(http, telemetry.inbound)
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.started

    def roots(count: int) -> list[dict]:
        deadline = time.monotonic() + 10
        while True:
            assert telemetry.flush(10)
            spans = [s for s in exporter.get_finished_spans() if s.kind == SpanKind.SERVER]
            if len(spans) >= count or time.monotonic() > deadline:
                return [dict(s.attributes) for s in sorted(spans, key=lambda s: s.start_time)]
            time.sleep(0.01)

    try:
        yield sock.getsockname(), roots
    finally:
        server.should_exit = True
        thread.join(10)
        telemetry.shutdown()
        sock.close()


@pytest.fixture()
def inbound_server():
    app = BlockingApp()
    with _inbound_uvicorn(app) as (address, roots):
        yield address, app, roots


def _get(conn: socket.socket, path: str) -> None:
    conn.sendall(f"GET {path} HTTP/1.1\r\nhost: test\r\n\r\n".encode())


def _read_until(conn: socket.socket, enough: Callable[[bytes], bool]) -> bytes:
    """What `conn` receives until `enough` says it holds what was awaited."""
    data = b""
    while not enough(data):
        chunk = conn.recv(4096)
        assert chunk, data
        data += chunk
    return data


def _response(conn: socket.socket) -> bytes:
    return _read_answers(conn, 1)


def _read_answers(conn: socket.socket, count: int) -> bytes:
    """`count` answers of "ok" (and whatever came before them)."""
    return _read_until(conn, lambda data: data.count(b"ok") >= count)


def _read_up_to_done(conn: socket.socket) -> bytes:
    return _read_until(conn, lambda data: DONE_EVENT in data)


def test_a_request_waiting_in_the_kernel_for_a_blocked_event_loop_is_inbound_time(inbound_server):
    address, app, roots = inbound_server
    first = socket.create_connection(address)
    _get(first, "/block")
    assert app.blocking.wait(10)
    second = socket.create_connection(address)  # accepted only once the loop runs again
    _get(second, "/fast")
    assert b" 200 " in _response(first) and b" 200 " in _response(second)
    time.sleep(BLOCK_S)  # a keep-alive request much later: its own stamps, not the connection's first
    _get(second, "/fast")
    _response(second)
    for conn in (first, second):
        conn.close()
    blocked, waited, later = roots(3)
    for root in (blocked, waited, later):
        inbound = root[names.PL_INBOUND_MS]
        kernel_wait, dispatch = root[names.PL_INBOUND_KERNEL_WAIT_MS], root[names.PL_INBOUND_DISPATCH_MS]
        assert kernel_wait >= 0 and dispatch >= 0
        assert inbound == pytest.approx(kernel_wait + dispatch, abs=1e-3)
    # the request sent while the loop was held waited in the kernel most of the hold
    assert waited[names.PL_INBOUND_KERNEL_WAIT_MS] >= 0.5 * BLOCK_S * 1e3
    assert waited[names.PL_INBOUND_KERNEL_WAIT_MS] > 10 * blocked[names.PL_INBOUND_KERNEL_WAIT_MS]
    assert later[names.PL_INBOUND_MS] < 0.5 * BLOCK_S * 1e3


class HeldEndApp:
    """/stream sends an SSE body up to `[DONE]`, then holds its final empty body message (the one
    that ends the chunked response) until the client has sent its next request and a loop turn
    later (so the server has read it); anything else answers "ok" at once."""

    def __init__(self) -> None:
        self.next_sent = threading.Event()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        await receive()
        if scope["path"] != "/stream":
            await _answer_ok(send)
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        for event in (b"data: {}\n\n", DONE_EVENT):
            await send({"type": "http.response.body", "body": event, "more_body": True})
        deadline = time.monotonic() + 10
        while not self.next_sent.is_set() and time.monotonic() < deadline:
            await asyncio.sleep(0.001)
        # a timer, not sleep(0): the loop's select runs first, so the pending request is read now
        await asyncio.sleep(0.005)
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _http_protocols() -> list:
    """uvicorn's HTTP protocols here: h11 always; httptools (vLLM's API server's) where installed."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return [H11Protocol]
    return [H11Protocol, HttpToolsProtocol]


@pytest.mark.parametrize("http", _http_protocols(), ids=lambda c: c.__name__)
def test_a_request_sent_before_the_previous_response_ended_has_its_own_inbound(http):
    """A kept-alive client may send its next request as soon as it has read `[DONE]`, before the
    server's final empty body message (HTTP/1.1 lets it: pipelining). That request's bytes are read
    while the response is still open; they are still its first bytes, and its inbound is its own:
    from its own send, through the wait for the previous response to end, to its ASGI call."""
    app = HeldEndApp()
    with _inbound_uvicorn(app, http) as (address, roots):
        conn = socket.create_connection(address)
        _get(conn, "/stream")
        assert not _read_up_to_done(conn).endswith(b"0\r\n\r\n")  # the response is still open
        sent_ns = time.monotonic_ns()
        _get(conn, "/after")
        app.next_sent.set()
        data = _response(conn)
        answered_ns = time.monotonic_ns()
        conn.close()
        assert data.count(b" 200 OK") == 1 and b"0\r\n\r\n" in data  # the first response's end, then the second
        streamed, after = roots(2)
    assert names.PL_INBOUND_MS in streamed
    inbound, dispatch = after.get(names.PL_INBOUND_MS), after.get(names.PL_INBOUND_DISPATCH_MS)
    assert inbound is not None and dispatch is not None, after
    assert inbound == pytest.approx(after[names.PL_INBOUND_KERNEL_WAIT_MS] + dispatch, abs=1e-3)
    # its own bytes: inside its own send → answer (the first request's stamps are older than `sent_ns`);
    # one clock (this process's monotonic clock, the server's too), ±1 ms for the kernel stamp's move
    assert 0 < inbound <= (answered_ns - sent_ns) / 1e6 + 1.0
    # the server held the first response's end ≥ 5 ms after it read the request: its wait, in dispatch
    assert dispatch >= 4.0


@pytest.mark.parametrize("http", _http_protocols(), ids=lambda c: c.__name__)
def test_body_reads_and_pipelined_requests_never_lend_a_request_their_stamps(http):
    """A request body read apart from its head is not the next request's first read; of two
    requests pipelined in one write (one read), the first has that read's stamps and the second is
    unobserved (no inbound, no dispatch: never the first one's stamps); the connection's next
    request has its own again."""
    with _inbound_uvicorn(HeldEndApp(), http) as (address, roots):
        conn = socket.create_connection(address)
        conn.sendall(b"POST /post HTTP/1.1\r\nhost: test\r\ncontent-length: 4\r\n\r\n")
        time.sleep(BLOCK_S)  # the body comes in its own read
        conn.sendall(b"body")
        _read_answers(conn, 1)
        time.sleep(BLOCK_S)
        conn.sendall(b"GET /a HTTP/1.1\r\nhost: test\r\n\r\nGET /b HTTP/1.1\r\nhost: test\r\n\r\n")
        _read_answers(conn, 2)
        time.sleep(BLOCK_S)
        _get(conn, "/c")
        _read_answers(conn, 1)
        conn.close()
        post, first, second, later = roots(4)
    assert [r["url.path"] for r in (post, first, second, later)] == ["/post", "/a", "/b", "/c"]
    # the POST's inbound ends at its ASGI call, before its body came; the others' own waits are
    # sub-millisecond here: a stamp from an earlier read would hold one of the BLOCK_S gaps
    for root in (post, first, later):
        assert 0 <= root[names.PL_INBOUND_MS] < 0.5 * BLOCK_S * 1e3, root
    assert names.PL_INBOUND_MS not in second and names.PL_INBOUND_DISPATCH_MS not in second, second


@pytest.mark.parametrize("http", _http_protocols(), ids=lambda c: c.__name__)
def test_requests_sent_ahead_never_take_each_others_stamps(http):
    """Two requests sent ahead while a response is open (separate writes, BLOCK_S apart): the first
    has its own stamps, its wait behind the open response in `dispatch`; the second has its own or
    none (its read is stamped only once every earlier request was answered), never the first's."""
    app = HeldEndApp()
    with _inbound_uvicorn(app, http) as (address, roots):
        conn = socket.create_connection(address)
        _get(conn, "/stream")
        _read_up_to_done(conn)
        _get(conn, "/a")
        time.sleep(BLOCK_S)
        _get(conn, "/b")
        app.next_sent.set()
        _read_answers(conn, 2)
        conn.close()
        streamed, first, second = roots(3)
    assert [r["url.path"] for r in (first, second)] == ["/a", "/b"]
    assert names.PL_INBOUND_MS in streamed
    # /a waited BLOCK_S behind the open response; /b's own wait is a few ms, the first's stamps
    # would give it more than BLOCK_S
    assert first[names.PL_INBOUND_DISPATCH_MS] >= 0.9 * BLOCK_S * 1e3, first
    assert second.get(names.PL_INBOUND_DISPATCH_MS, 0) < 0.5 * BLOCK_S * 1e3, second
    assert second.get(names.PL_INBOUND_MS, 0) < 0.5 * BLOCK_S * 1e3, second


def test_a_parser_state_of_another_shape_leaves_the_connection_unstamped_not_broken(caplog):
    """The first-read rule reads uvicorn's private parser state (here h11's `trailing_data`). Where
    a version has it in another shape, the connection's requests are served, unstamped (no inbound,
    never a guess), with a warning — never a broken connection."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class Reshaped(h11.Connection):
        @property
        def trailing_data(self):
            raise AttributeError("trailing_data")

    class ReshapedH11(H11Protocol):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.conn = Reshaped(h11.SERVER)

    with _inbound_uvicorn(BlockingApp(), ReshapedH11) as (address, roots):
        conn = socket.create_connection(address)
        for path in ("/a", "/b"):
            _get(conn, path)
            assert _response(conn).startswith(b"HTTP/1.1 200 OK")
        conn.close()
        first, second = roots(2)
    assert [r["url.path"] for r in (first, second)] == ["/a", "/b"]
    assert not any(names.PL_INBOUND_MS in r or names.PL_INBOUND_DISPATCH_MS in r for r in (first, second))
    assert "inbound stamps off for a connection" in caplog.text


def _stream_in_a_thread(steps: list[Step]):
    """A scripted server on its own event loop in a thread (the client's loop may then block); its
    requests (with their write stamps) are listed as they come."""
    started, stop = threading.Event(), threading.Event()
    box: dict = {}

    async def handler(request):
        return Reply(steps=list(steps))

    async def main():
        async with ScriptedServer(handler) as server:
            box["url"], box["requests"] = server.url, server.requests
            started.set()
            while not stop.is_set():
                await asyncio.sleep(0.01)

    thread = threading.Thread(target=lambda: asyncio.run(main()), daemon=True)
    thread.start()
    assert started.wait(10)
    return box["url"], stop, thread, box["requests"]


def _blocked_and_idle(steps: list[Step], block_after_s: float):
    """One completions stream from a client whose event loop blocks for BLOCK_S `block_after_s`
    after sending, then one from an idle client, against the same scripted server."""
    url, stop, thread, _ = _stream_in_a_thread(steps)
    body = {"model": "m", "prompt": "p", "max_tokens": 2}

    async def blocked_client():
        async with TracedClient(url, tracer_provider=TracerProvider()) as client:
            task = asyncio.create_task(client.stream("completions", body))
            await asyncio.sleep(block_after_s)
            time.sleep(BLOCK_S)  # this client's event loop is busy: what arrives waits in its kernel
            return await task

    async def idle_client():
        async with TracedClient(url, tracer_provider=TracerProvider()) as client:
            return await client.stream("completions", body)

    try:
        return asyncio.run(blocked_client()), asyncio.run(idle_client())
    finally:
        stop.set()
        thread.join(10)


def test_the_clients_own_lateness_is_client_read_not_network():
    first_chunk_ms = 60
    steps = [
        Step(first_chunk_ms, completion_chunk("Hi")),
        Step(5, completion_chunk("!", finish="stop") + usage_chunk(3, 2) + DONE_EVENT),
    ]
    blocked, idle = _blocked_and_idle(steps, 0.02)  # the request is out; the first chunk comes at ~60 ms
    assert blocked.ok and idle.ok
    assert blocked.ttft_ms >= BLOCK_S * 1e3
    # held by the client, not the wire: most of the hold (the rest covers the server thread's late sleeps)
    assert blocked.read_ms >= 0.25 * BLOCK_S * 1e3
    assert blocked.ttft_ms - blocked.read_ms >= first_chunk_ms - 1  # the wire part: the server's script
    assert 0 <= idle.read_ms < idle.ttft_ms
    # sent → the request's bytes handed over, the new connection's connect left out (network time)
    assert 0 <= idle.send_ms < idle.ttft_ms - first_chunk_ms + 1
    # bench says so at the end of a run whose client was its own bottleneck, and only then
    blocked_run, idle_run = client_bottleneck([blocked]), client_bottleneck([idle])
    assert blocked_run["bottleneck"] and blocked_run["client_p90_ms"] >= blocked.read_ms
    assert idle_run["share"] < blocked_run["share"], (idle_run, blocked_run)
    assert "the client was a bottleneck" in client_bottleneck_note({"client_bottleneck": blocked_run})
    quiet = {**blocked_run, "share": 0.05, "bottleneck": False}  # a client far below the line says nothing
    assert client_bottleneck_note({"client_bottleneck": quiet}) is None


def test_the_clients_lateness_at_the_streams_end_is_client_end_read_not_network():
    """The same at the stream's end: the last content chunk waits in the kernel while the client's
    loop is busy (`end_read`), and only the wire's part stays in the end-to-end time beside it."""
    first_chunk_ms, last_chunk_ms = 10, 60
    steps = [
        Step(first_chunk_ms, completion_chunk("Hi")),
        Step(last_chunk_ms, completion_chunk("!", finish="stop") + usage_chunk(3, 2) + DONE_EVENT),
    ]
    blocked, idle = _blocked_and_idle(steps, 0.04)  # the first chunk is read; the last one comes at ~70 ms
    assert blocked.ok and idle.ok
    assert blocked.ttft_ms < 0.5 * BLOCK_S * 1e3 and blocked.e2e_ms >= BLOCK_S * 1e3  # held between the two
    assert blocked.end_read_ms >= 0.5 * BLOCK_S * 1e3
    assert blocked.e2e_ms - blocked.end_read_ms >= first_chunk_ms + last_chunk_ms - 1  # the server's script
    assert 0 <= idle.end_read_ms < idle.e2e_ms - (first_chunk_ms + last_chunk_ms) + 1


def test_a_client_late_to_see_its_connect_done_counts_that_as_its_own_time():
    """The kernel completes a TCP handshake without the client; a client whose event loop is busy
    notices it late. Only the handshake's round trip (the kernel's TCP_INFO sample, µs on loopback)
    is the network's: the rest of the connect is `client_send`, not the residual's."""
    url, stop, thread, _ = _stream_in_a_thread([Step(5, completion_chunk("Hi", finish="stop") + DONE_EVENT)])

    async def run():
        async with TracedClient(url, tracer_provider=TracerProvider()) as client:
            task = asyncio.create_task(client.stream("completions", {"model": "m", "prompt": "p", "max_tokens": 1}))
            for _ in range(3):  # until the connect is in flight (create_connection awaits the handshake)
                await asyncio.sleep(0)
            time.sleep(BLOCK_S)  # meanwhile the kernel completes the handshake
            return await task

    try:
        result = asyncio.run(run())
    finally:
        stop.set()
        thread.join(10)
    assert result.ok
    assert result.connect_ns < 0.05 * BLOCK_S * 1e9, result.connect_ns  # the round trip, not the hold
    assert result.send_ms >= 0.9 * BLOCK_S * 1e3, result.send_ms


def test_a_late_client_says_when_its_first_chunk_read_was_coalesced():
    """TCP merges packets that wait in the receive queue and stamps the merged bytes with the newest
    packet's arrival, so a client late enough to find the next chunk behind the first content chunk
    reads both with the later stamp: its `read_ms` understates its wait (the rest stays in the
    residual). The client knows it happened (later events in the same read) and says so."""
    first_chunk_ms, next_chunk_ms = 60, 80
    url, stop, thread, requests = _stream_in_a_thread(
        [
            Step(first_chunk_ms, completion_chunk("Hi")),
            Step(next_chunk_ms, completion_chunk("!", finish="stop") + usage_chunk(3, 2) + DONE_EVENT),
        ]
    )

    async def run(block_s: float):
        async with TracedClient(url, tracer_provider=TracerProvider()) as client:
            task = asyncio.create_task(client.stream("completions", {"model": "m", "prompt": "p", "max_tokens": 2}))
            await asyncio.sleep(0.02)
            time.sleep(block_s)  # 0.3 s: both chunks arrive meanwhile (at ~60 and ~140 ms)
            return await task

    try:
        late, prompt = asyncio.run(run(BLOCK_S)), asyncio.run(run(0.0))
    finally:
        stop.set()
        thread.join(10)
    assert late.ok and prompt.ok
    assert late.read_coalesced and not prompt.read_coalesced
    # the late read carries the second chunk's stamp: what it hides is the 80 ms between them
    assert late.ttft_ms - late.read_ms >= first_chunk_ms + next_chunk_ms - 1
    # the prompt read's kernel stamp is its first chunk's: after that write, before the next one's
    # (one clock; the kernel stamps a loopback packet inside the send call, ±1 ms for its clock move)
    srv = [(t - prompt.sent_ts) / 1e6 for t in requests[1].sent_ts]
    assert srv[0] - 1 <= prompt.ttft_ms - prompt.read_ms < srv[1] and srv[0] >= first_chunk_ms
