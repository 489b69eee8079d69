"""A lean HTTP/1.1 streaming transport for httpx: one network read in, one body piece out.

httpx's default transport (httpcore → h11 → anyio) costs the traced client most of its CPU per
streamed SSE chunk (measured: 271 → 109 µs per chunk for the whole client at 2,100 chunks/s); at
thousands of chunks per second that CPU is the load generator's limit, and its queueing delays every
receive stamp. This transport plugs into `httpx.AsyncClient(transport=…)`, so the client's API,
headers, cookies and error classes stay httpx's, and does only what a streaming client needs: an
`asyncio.BufferedProtocol` per connection (one reused receive buffer), keep-alive pooling (LIFO idle
list per origin, a cap on open connections), `Content-Length`, chunked and read-to-close bodies, TLS
through `ssl=`, httpx's connect/read/write/pool timeouts, and httpx's exception classes. No HTTP/2,
no proxies, no protocol upgrades (101 is an error).

Every network read is stamped (`clock_ns`) in `buffer_updated`, when the event loop hands the bytes
over, before any other task's work can delay it; on a plain TCP connection also with the kernel's
receive stamp of its bytes, peeked in `get_buffer` just before the loop reads them (`kernel_stamps`;
0 when the kernel gave none, or over TLS, where the socket's bytes are not yet the payload's); the
read then takes only the bytes the peek saw, so bytes arriving in between get a read and a stamp of
their own. The
response carries its body stream under `extensions[RECEIPTS]`; `stream.stamped()` yields (receive
stamp, payload) per network read, and `stream.arrived_ts` is the kernel stamp of the last one;
`stream.written_ts` is when the request's first bytes were handed to the transport (asyncio sends
at once when the socket buffer has room; stamped just before, so the send itself is never counted
twice, as the client's and as the server's time) and `stream.connect_ns` the network's part of opening its
new connection (the kernel's handshake round trip over plain TCP, else the whole connect).
"""

from __future__ import annotations

import asyncio
import collections
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

import httpx

from phaselens.common.clocks import NOT_STAMPED, MonoClock, MonoTs, perf_counter_ts
from phaselens.instrumentation.hotpath.kernel_stamps import KernelStamper, handshake_rtt_ns

RECEIPTS = "phaselens.receipts"  # response extension: the body stream, with `stamped()`
MAX_HEAD_BYTES = 64 * 1024
MAX_CHUNK_LINE_BYTES = 4096
_PAUSE_BYTES = 1 << 20  # stop reading a connection whose unread bytes pass this (back-pressure)
_RECV_BYTES = 256 * 1024
_HEX_DIGITS = b"0123456789abcdefABCDEF"
_NO_BODY_STATUS = frozenset({204, 304})
_Origin = tuple[str, str, int]  # (scheme, host, port): the connections one idle list pools


class _Connection(asyncio.BufferedProtocol):
    """One TCP (or TLS) connection; received bytes wait here, each read with its receive stamp."""

    def __init__(self, origin: _Origin, clock_ns: MonoClock, recv_buffer: memoryview, kernel_stamps: bool = True):
        self.origin = origin
        self._clock_ns = clock_ns
        self._recv = recv_buffer  # shared by the connections of one transport: copied out at once
        self.transport: asyncio.Transport | None = None
        self._kernel_stamps = kernel_stamps
        self._stamper: KernelStamper | None = None
        self._arrived_ts = NOT_STAMPED  # the kernel's receive stamp of the bytes being read (0: none)
        self.connect_ns = 0  # the network's part of opening this connection; taken by its first request
        self.write_ts = NOT_STAMPED  # the request's first write handed to the transport (stamped just before it)
        self._pieces: collections.deque[tuple[MonoTs, bytes, MonoTs]] = (
            collections.deque()
        )  # (stamp, bytes, kernel stamp)
        self._unread = 0
        self._waiter: asyncio.Future[None] | None = None
        self._paused = False
        self._drained: asyncio.Future[None] | None = None  # set while the transport's write buffer is full
        self._deadline = 0.0  # loop time by which the awaited read must arrive
        self._timer: asyncio.TimerHandle | None = None
        self.closed = False
        self.error: Exception | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream connection's (create_connection)
        sock = transport.get_extra_info("socket")
        if self._kernel_stamps and sock is not None and transport.get_extra_info("sslcontext") is None:
            self._stamper = KernelStamper(sock.fileno(), self._clock_ns, latest=True)

    def get_buffer(self, sizehint: int) -> memoryview:
        # asyncio's default recv() allocates max_size (256 KiB) per read; a reused buffer does not
        if self._stamper is None:
            self._arrived_ts = NOT_STAMPED
            return self._recv
        self._arrived_ts, peeked = self._stamper.pending()
        # the read takes only the bytes its stamp dates: bytes that arrive between the peek and the
        # loop's recv wait for the next read and its own stamp (a later chunk read with an earlier
        # chunk's stamp would make client_late_est name a wait the client never had)
        return self._recv[:peeked] if self._arrived_ts and peeked else self._recv

    def buffer_updated(self, nbytes: int) -> None:
        self._pieces.append((self._clock_ns(), bytes(self._recv[:nbytes]), self._arrived_ts))
        self._unread += nbytes
        if self._unread > _PAUSE_BYTES and not self._paused:
            self._paused = True
            assert self.transport is not None  # bytes came through it
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> None:
        self.closed = True
        self._wake()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed, self.error = True, exc
        if self._stamper is not None:
            self._stamper.close()
        self._wake()
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)

    def pause_writing(self) -> None:
        self._drained = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._drained is not None and not self._drained.done():
            self._drained.set_result(None)
        self._drained = None

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def unread_bytes(self) -> int:
        return self._unread

    def unread(self, stamp_ts: MonoTs, data: bytes, arrived_ts: MonoTs) -> None:
        """Give back bytes read too far (a body's first bytes arrive with the head)."""
        self._pieces.appendleft((stamp_ts, data, arrived_ts))
        self._unread += len(data)

    async def read(self, timeout_s: float | None, request: httpx.Request) -> tuple[MonoTs, bytes, MonoTs]:
        """(receive stamp, bytes, kernel stamp) of the oldest unread network read; (0, b"", 0) at
        end of stream."""
        while (piece := self.pop(request)) is None:
            await self.wait(timeout_s, request)
        return piece

    def pop(self, request: httpx.Request) -> tuple[MonoTs, bytes, MonoTs] | None:
        """`read` without waiting: None when nothing has arrived yet."""
        if not self._pieces:
            if not self.closed:
                return None
            if isinstance(self.error, OSError):
                raise httpx.ReadError(str(self.error) or type(self.error).__name__, request=request)
            return NOT_STAMPED, b"", NOT_STAMPED
        piece = self._pieces.popleft()
        self._unread -= len(piece[1])
        if self._paused and self._unread <= _PAUSE_BYTES and not self.closed:
            self._paused = False
            assert self.transport is not None  # bytes came through it
            self.transport.resume_reading()
        return piece

    async def wait(self, timeout_s: float | None, request: httpx.Request) -> None:
        """Until bytes arrive or the connection ends (httpx.ReadTimeout after `timeout_s`)."""
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        if timeout_s is not None:
            # one timer per connection, moved lazily: no timer heap push and cancel per read
            self._deadline = loop.time() + timeout_s
            if self._timer is not None and self._timer.when() > self._deadline:
                self._timer.cancel()
                self._timer = None
            if self._timer is None:
                self._timer = loop.call_at(self._deadline, self._check_deadline)
        try:
            await waiter
        except TimeoutError:
            raise httpx.ReadTimeout(f"no data for {timeout_s} s", request=request) from None
        finally:
            self._waiter = None

    def _check_deadline(self) -> None:
        self._timer = None
        if self._waiter is None or self._waiter.done():
            return
        loop = asyncio.get_running_loop()
        if loop.time() < self._deadline:
            self._timer = loop.call_at(self._deadline, self._check_deadline)
        else:
            self._waiter.set_exception(TimeoutError())

    async def write(self, data: bytes, timeout_s: float | None, request: httpx.Request) -> None:
        if self.closed:
            raise httpx.WriteError("connection closed", request=request)
        # the first write of a request, stamped before it: asyncio sends at once, and the server may
        # take the bytes before we resume (its inbound term starts at its first bytes' arrival)
        if not self.write_ts:
            self.write_ts = self._clock_ns()
        assert self.transport is not None  # a connection is pooled only once made
        self.transport.write(data)
        if self._drained is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._drained), timeout_s)
            except TimeoutError:
                raise httpx.WriteTimeout(f"write blocked for {timeout_s} s", request=request) from None

    def close(self) -> None:
        self.closed = True
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None:
            self.transport.close()


@dataclass(slots=True)
class _Head:
    version: bytes
    status: int
    reason: bytes
    headers: list[tuple[bytes, bytes]]

    def values(self, name: bytes) -> list[bytes]:
        return [v for k, v in self.headers if k.lower() == name]


def _parse_head(raw: bytes, request: httpx.Request) -> _Head:
    """Status line and header fields of a response head (its final CRLF CRLF cut off)."""
    lines = raw.split(b"\r\n")
    version, _, rest = lines[0].partition(b" ")
    code, _, reason = rest.partition(b" ")
    if version not in (b"HTTP/1.1", b"HTTP/1.0") or len(code) != 3 or not code.isdigit():
        raise httpx.RemoteProtocolError(f"malformed status line {lines[0][:80]!r}", request=request)
    headers = []
    for line in lines[1:]:
        name, sep, value = line.partition(b":")
        if not sep or not name or name != name.strip() or line[:1] in (b" ", b"\t"):
            raise httpx.RemoteProtocolError(f"malformed header line {line[:80]!r}", request=request)
        headers.append((name, value.strip(b" \t")))
    return _Head(version, int(code), reason, headers)


def _hex_size(field: bytes) -> int | None:
    """The chunk size written in `field` (hex digits only); None when it is anything else."""
    return int(field, 16) if field and not field.strip(_HEX_DIGITS) else None


@dataclass(slots=True)
class ChunkedDecoder:
    """Incremental decoder of the chunked transfer coding (RFC 9112 §7.1); `feed` → payload bytes."""

    done: bool = False
    extra: bool = False  # bytes followed the last chunk: the connection cannot be reused
    _buf: bytes = b""
    _left: int = 0  # payload bytes still due in the current chunk
    _crlf: bool = False  # the CRLF that ends a chunk's payload is due
    _trailers: bool = False  # past the last chunk: trailer lines until a blank one

    def feed(self, data: bytes) -> bytes:
        if not (self._buf or self._left or self._crlf or self._trailers):
            # the common read: whole chunks `size CRLF payload CRLF`, decoded without the state machine
            end = data.find(b"\r\n")
            size = _hex_size(data[:end]) if 0 < end <= 16 else None
            if size and data[end + 2 + size : end + 4 + size] == b"\r\n" and len(data) == end + 4 + size:
                return data[end + 2 : end + 2 + size]
        buf, pos, out = self._buf + data if self._buf else data, 0, []
        while not self.done:
            if self._left:
                piece = buf[pos : pos + self._left]
                out.append(piece)
                pos += len(piece)
                self._left -= len(piece)
                if self._left:
                    break
                self._crlf = True
            if self._crlf:
                if len(buf) - pos < 2:
                    break
                if buf[pos : pos + 2] != b"\r\n":
                    raise ValueError("chunk payload not followed by CRLF")
                pos, self._crlf = pos + 2, False
            end = buf.find(b"\r\n", pos)
            if end < 0:
                if len(buf) - pos > MAX_CHUNK_LINE_BYTES:
                    raise ValueError("chunk size line too long")
                break
            line, pos = buf[pos:end], end + 2
            if self._trailers:
                self.done = not line
                continue
            size = _hex_size(line.split(b";", 1)[0].strip(b" \t"))
            if size is None:
                raise ValueError(f"bad chunk size line {line[:40]!r}")
            self._left = size
            self._trailers = self._left == 0
        self._buf = buf[pos:]
        self.extra = self.done and bool(self._buf)
        return out[0] if len(out) == 1 else b"".join(out)


@dataclass(slots=True, eq=False)
class _Body(httpx.AsyncByteStream):
    """The response body; returns its connection to the pool when closed after a complete read."""

    pool: StreamingTransport
    conn: _Connection
    request: httpx.Request
    framing: str  # "chunked" | "length" | "close" | "none"
    length: int = 0  # for "length": bytes still due
    reusable: bool = True
    read_timeout_s: float | None = None
    arrived_ts: MonoTs = NOT_STAMPED  # the kernel's receive stamp of the read `stamped()` yielded last (0: none)
    written_ts: MonoTs = NOT_STAMPED  # the request's first bytes handed to the transport (stamped just before)
    connect_ns: int = 0  # the network's part of the connect this request waited for; 0 on a kept-alive one
    complete: bool = False
    released: bool = False
    decoder: ChunkedDecoder = field(default_factory=ChunkedDecoder)

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for _, payload in self.stamped():
            yield payload

    async def stamped(self) -> AsyncIterator[tuple[MonoTs, bytes]]:
        """(receive stamp ns, payload bytes) per network read that carried body bytes."""
        conn, request = self.conn, self.request
        while not self.complete:
            piece = conn.pop(request)  # a buffered read needs no coroutine call (the per-chunk path)
            if piece is None:
                await conn.wait(self.read_timeout_s, request)
                continue
            stamp, data, arrived = piece
            if not data:
                self._at_eof()
                return
            payload = self._decode(data)
            if payload:
                self.arrived_ts = arrived
                yield stamp, payload

    def _decode(self, data: bytes) -> bytes:
        if self.framing == "chunked":
            try:
                payload = self.decoder.feed(data)
            except ValueError as exc:
                raise httpx.RemoteProtocolError(str(exc), request=self.request) from None
            self.complete, self.reusable = self.decoder.done, self.reusable and not self.decoder.extra
            return payload
        if self.framing == "length":
            payload = data[: self.length]
            self.length -= len(payload)
            self.complete, self.reusable = self.length == 0, self.reusable and len(payload) == len(data)
            return payload
        return data  # "close": everything until the server closes

    def _at_eof(self) -> None:
        if self.framing != "close":
            raise httpx.RemoteProtocolError(
                f"peer closed connection without sending complete message body ({self.framing})", request=self.request
            )
        self.complete, self.reusable = True, False

    async def aclose(self) -> None:
        if not self.released:
            self.released = True
            self.pool.release(self.conn, self.complete and self.reusable)


class StreamingTransport(httpx.AsyncBaseTransport):
    """httpx transport: HTTP/1.1 with keep-alive, at most `max_connections` open connections."""

    def __init__(
        self,
        max_connections: int = 4096,
        ssl_context: ssl.SSLContext | None = None,
        clock_ns: MonoClock = perf_counter_ts,
        kernel_stamps: bool = True,
    ):
        self.max_connections = max_connections
        self.kernel_stamps = kernel_stamps
        self._ssl = ssl_context
        self._clock_ns = clock_ns
        self._recv = memoryview(bytearray(_RECV_BYTES))
        self._idle: dict[_Origin, list[_Connection]] = {}
        self._slots: asyncio.Semaphore | None = None  # made on first use, inside the running loop
        self._closed = False

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        timeouts = request.extensions.get("timeout", {})
        conn = await self._acquire(request, timeouts)
        connect_ns, conn.connect_ns = conn.connect_ns, 0
        try:
            conn.write_ts = NOT_STAMPED
            await self._send(conn, request, timeouts.get("write"))
            written_ts = conn.write_ts
            head, body_start = await self._read_head(conn, request, timeouts.get("read"))
            body = self._body(conn, request, head, timeouts.get("read"))
        except BaseException:
            self.release(conn, False)
            raise
        body.written_ts, body.connect_ns = written_ts, connect_ns
        if body_start is not None:
            conn.unread(*body_start)
            body.reusable = body.reusable and body.framing != "none"  # bytes beyond an empty body
        return httpx.Response(
            head.status,
            headers=head.headers,
            stream=body,
            extensions={"http_version": head.version, "reason_phrase": head.reason, RECEIPTS: body},
        )

    async def aclose(self) -> None:
        self._closed = True
        for conns in self._idle.values():
            for conn in conns:
                conn.close()
        self._idle.clear()

    def release(self, conn: _Connection, reusable: bool) -> None:
        """Give back a connection's slot; keep it for the next request if it can carry one."""
        if reusable and not conn.closed and not self._closed:
            self._idle.setdefault(conn.origin, []).append(conn)
        else:
            conn.close()
        assert self._slots is not None  # the connection took a slot in _acquire
        self._slots.release()

    async def _acquire(self, request: httpx.Request, timeouts: dict[str, float | None]) -> _Connection:
        if self._closed:
            raise RuntimeError("the transport is closed")
        if self._slots is None:
            self._slots = asyncio.Semaphore(self.max_connections)
        if self._slots.locked():
            try:
                await asyncio.wait_for(self._slots.acquire(), timeouts.get("pool"))
            except TimeoutError:
                raise httpx.PoolTimeout("no free connection", request=request) from None
        else:
            await self._slots.acquire()
        url = request.url
        origin = (url.scheme, url.host, url.port or (443 if url.scheme == "https" else 80))
        idle = self._idle.get(origin)
        while idle:
            conn = idle.pop()  # the most recent: the least likely to have been closed by the server
            if not conn.closed and not conn.unread_bytes:  # bytes on an idle connection: out of step
                return conn
            conn.close()
        try:
            return await self._connect(origin, request, timeouts.get("connect"))
        except BaseException:
            self._slots.release()
            raise

    async def _connect(self, origin: _Origin, request: httpx.Request, timeout_s: float | None) -> _Connection:
        scheme, host, port = origin
        tls = None
        if scheme == "https":
            if self._ssl is None:  # built on first use: loading the CA bundle takes ~50 ms
                self._ssl = httpx.create_ssl_context(trust_env=False)
            tls = self._ssl
        loop = asyncio.get_running_loop()
        start_ts = self._clock_ns()
        try:
            async with asyncio.timeout(timeout_s):
                _, conn = await loop.create_connection(
                    lambda: _Connection(origin, self._clock_ns, self._recv, self.kernel_stamps),
                    host,
                    port,
                    ssl=tls,
                    server_hostname=host if tls else None,
                )
        except TimeoutError:
            raise httpx.ConnectTimeout(f"connect to {host}:{port} took over {timeout_s} s", request=request) from None
        except OSError as exc:
            raise httpx.ConnectError(str(exc) or type(exc).__name__, request=request) from None
        conn.connect_ns = self._connect_network_ns(conn, self._clock_ns() - start_ts)
        return conn

    def _connect_network_ns(self, conn: _Connection, elapsed_ns: int) -> int:
        """The network's part of a connect: over plain TCP the kernel's handshake round trip (the rest
        of the connect is this client noticing it late, its own time), else the whole connect."""
        assert conn.transport is not None  # connection_made ran
        sock = conn.transport.get_extra_info("socket")
        plain = self.kernel_stamps and sock is not None and conn.origin[0] == "http"
        rtt = handshake_rtt_ns(sock) if plain else None
        return elapsed_ns if rtt is None else min(rtt, elapsed_ns)

    async def _send(self, conn: _Connection, request: httpx.Request, timeout_s: float | None) -> None:
        lines = [b"%s %s HTTP/1.1\r\n" % (request.method.encode(), request.url.raw_path)]
        lines += [b"%s: %s\r\n" % (k, v) for k, v in request.headers.raw]
        lines.append(b"\r\n")
        if isinstance(request.stream, httpx.ByteStream):  # a body in memory goes out with the head
            await conn.write(b"".join(lines) + await request.aread(), timeout_s, request)
            return
        assert isinstance(request.stream, httpx.AsyncByteStream)  # as httpx's own async transport asserts
        chunked = b"chunked" in request.headers.get("transfer-encoding", "").encode().lower()
        await conn.write(b"".join(lines), timeout_s, request)
        async for part in request.stream:
            if part:
                await conn.write(b"%x\r\n%s\r\n" % (len(part), part) if chunked else part, timeout_s, request)
        if chunked:
            await conn.write(b"0\r\n\r\n", timeout_s, request)

    async def _read_head(
        self, conn: _Connection, request: httpx.Request, timeout_s: float | None
    ) -> tuple[_Head, tuple[MonoTs, bytes, MonoTs] | None]:
        """The final response head (1xx interim responses skipped) and the bytes read past it."""
        buf, stamp, arrived = b"", NOT_STAMPED, NOT_STAMPED
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                if len(buf) > MAX_HEAD_BYTES:
                    raise httpx.RemoteProtocolError("response head too long", request=request)
                stamp, data, arrived = await conn.read(timeout_s, request)
                if not data:
                    raise httpx.RemoteProtocolError("Server disconnected without sending a response.", request=request)
                buf += data
                continue
            head, buf = _parse_head(buf[:end], request), buf[end + 4 :]
            if head.status == 101:
                raise httpx.RemoteProtocolError("protocol upgrade is not supported", request=request)
            if head.status >= 200:
                return head, ((stamp, buf, arrived) if buf else None)

    def _body(self, conn: _Connection, request: httpx.Request, head: _Head, timeout_s: float | None) -> _Body:
        """Body framing by RFC 9112 §6.3; keep-alive only for HTTP/1.1 without `Connection: close`."""
        tokens = {
            t.strip().lower()
            for v in head.values(b"connection") + request.headers.get_list("connection")
            for t in (v.split(b",") if isinstance(v, bytes) else v.encode().split(b","))
        }
        reusable = head.version == b"HTTP/1.1" and b"close" not in tokens
        body = _Body(self, conn, request, "close", reusable=reusable, read_timeout_s=timeout_s)
        if request.method == "HEAD" or head.status in _NO_BODY_STATUS:
            body.framing, body.complete = "none", True
        elif codings := head.values(b"transfer-encoding"):
            if codings[-1].split(b",")[-1].strip().lower() == b"chunked":
                body.framing = "chunked"
        elif lengths := {v.strip() for v in head.values(b"content-length")}:
            if len(lengths) != 1 or not next(iter(lengths)).isdigit():
                raise httpx.RemoteProtocolError(f"bad content-length {sorted(lengths)}", request=request)
            body.framing, body.length = "length", int(next(iter(lengths)))
            if body.length == 0:
                body.framing, body.complete = "none", True
        if body.framing == "close":
            body.reusable = False
        return body
