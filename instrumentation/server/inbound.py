"""The server's inbound edge: when a request's bytes reached the server's kernel, and when the event
loop handed them to the HTTP protocol, both before the ASGI app (and so `received`) sees it.

    inbound     = received − arrived = kernel_wait + dispatch        (server clock, exact)
    kernel_wait = read − arrived     the bytes waited in the kernel for the event loop (a busy or
                                     GIL-starved loop; a new connection's accept is inside it)
    dispatch    = received − read    HTTP parsing, the server's task start, middleware before ours

`arrived` is the kernel's receive stamp of the request's first bytes (`kernel_stamps`), `read` the
loop's hand-over, both taken in `get_buffer` / `buffer_updated` of `InboundProtocol`, a buffered
wrapper around the server's own HTTP protocol (uvicorn's h11 or httptools protocol: `Config(http=…)`
takes the class made by `inbound_protocol`). The stamps wait in `InboundStamps`, keyed by the
connection's peer address, until the ingress middleware takes them for the request it opens
(`take`, with ASGI's `scope["client"]`).

Which read is a request's first: HTTP/1.1 sends a connection's requests one after another, so the
first read after uvicorn has parsed the whole of the previous request (its `cycle.more_body` false,
nothing of a later one in hand) starts the next one, whether the client waited for the previous
response to end (keep-alive) or sent it earlier (pipelining: for instance at the last content
chunk, before the response's final empty body message; the request's wait for that end is then in
`dispatch`). A body's later reads come before that point, so they never count. Unobserved (no
stamps, never another request's): a request whose first bytes share a read with the previous
request's last ones (that read's stamps date the earlier bytes), and, once uvicorn holds requests
waiting behind the open one, any read until every request so far has been answered (a waiting
request that holds no stamps would otherwise take a later request's).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from phaselens.common.clocks import NOT_STAMPED, MonoClock, MonoTs
from phaselens.instrumentation.hotpath.kernel_stamps import KernelStamper

_log = logging.getLogger(__name__)
_RECV_BYTES = 256 * 1024  # asyncio's own read size for a plain protocol
Peer = tuple[Any, ...]
_NOT_STARTED = object()  # no read of the connection started a request yet


class InboundStamps:
    """(arrived_ts, read_ts) of the read that started the request a peer's connection opens next;
    written and read on the event loop."""

    __slots__ = ("_pending", "clock_ns")

    def __init__(self, clock_ns: MonoClock) -> None:
        self.clock_ns = clock_ns
        self._pending: dict[Peer, tuple[MonoTs, MonoTs]] = {}

    def started(self, peer: Peer, arrived_ts: MonoTs, read_ts: MonoTs, *, idle: bool) -> bool:
        """A read that starts a request; False when it is not kept. On an `idle` connection (every
        request so far answered, so taken) a leftover is no one's and gives way; otherwise one
        still untaken keeps its place (its pipelined successor is then unobserved)."""
        if not idle and peer in self._pending:
            return False
        self._pending[peer] = (arrived_ts, read_ts)
        return True

    def take(self, peer: Any) -> tuple[MonoTs, MonoTs]:
        """The stamps of the request from `peer` (ASGI `scope["client"]`): (0, 0) when unobserved."""
        if not peer:
            return NOT_STAMPED, NOT_STAMPED
        return self._pending.pop(tuple(peer), (NOT_STAMPED, NOT_STAMPED))

    def discard(self, peer: Any) -> None:
        """`take` for a request the caller does not trace: its stamps go to no other request."""
        if peer:
            self._pending.pop(tuple(peer), None)

    def closed(self, peer: Peer) -> None:
        self._pending.pop(peer, None)

    def __len__(self) -> int:
        return len(self._pending)


class InboundProtocol(asyncio.BufferedProtocol):
    """Wraps one connection's HTTP protocol (`inner`, uvicorn's): stamps the read that starts each
    request, then hands the bytes on."""

    inner_class: type[asyncio.Protocol]
    stamps: InboundStamps

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.inner = self.inner_class(*args, **kwargs)
        self._buffer = memoryview(bytearray(_RECV_BYTES))
        self._stamper: KernelStamper | None = None
        self._peer: Peer = ()
        self._arrived_ts = NOT_STAMPED
        # uvicorn's cycle whose successor's first read is settled (stamped, or unobservable)
        self._started_after: object = _NOT_STARTED
        self._lost = False  # a request began that may hold no stamps and has not yet taken

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        sock = transport.get_extra_info("socket")
        # without uvicorn's parser state the requests' first reads are not known: no stamps
        self._peer = tuple(peer) if isinstance(peer, (tuple, list)) and _uvicorn_http(self.inner) else ()
        if sock is not None and self._peer:
            self._stamper = KernelStamper(sock.fileno(), self.stamps.clock_ns)
        self.inner.connection_made(transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        stamper = self._stamper
        self._arrived_ts = stamper.arrived_ts() if stamper is not None else NOT_STAMPED
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._peer:
            self._read_parser_state(self._before_read)
        self.inner.data_received(bytes(self._buffer[:nbytes]))
        if self._peer:
            self._read_parser_state(self._after_read)

    def _before_read(self, inner: Any) -> None:
        cycle = inner.cycle  # the request uvicorn parsed last (None before the first)
        if cycle is not self._started_after and (cycle is None or _parsed_up_to(inner, cycle)):
            self._started_after = cycle
            idle = cycle is None or cycle.response_complete
            if idle or not self._lost:
                stamps = self.stamps
                self._lost = not stamps.started(self._peer, self._arrived_ts, stamps.clock_ns(), idle=idle)

    def _after_read(self, inner: Any) -> None:
        cycle = inner.cycle
        if cycle is not None and not cycle.more_body and _next_request_began(inner, cycle):
            # requests waiting behind this one, some perhaps unobserved: until the connection is
            # idle again, a read is not stamped, lest one of them take a later request's stamps
            self._lost = True

    def _read_parser_state(self, step: Callable[[Any], None]) -> None:
        """Run `step` on uvicorn's private parser state; where that state has another shape (a
        uvicorn version this was not written for) the connection goes unstamped instead of failing."""
        try:
            step(self.inner)
        except AttributeError as exc:
            self.stamps.closed(self._peer)
            self._peer = ()
            _log.warning("inbound stamps off for a connection: uvicorn's parser state has changed (%s)", exc)

    def eof_received(self) -> bool | None:
        return self.inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._stamper is not None:
            self._stamper.close()
        self.stamps.closed(self._peer)
        self.inner.connection_lost(exc)

    def pause_writing(self) -> None:
        self.inner.pause_writing()

    def resume_writing(self) -> None:
        self.inner.resume_writing()


def _uvicorn_http(inner: asyncio.Protocol) -> bool:
    """Whether `inner` shows the parser state read here (uvicorn's h11 or httptools protocol)."""
    return hasattr(inner, "cycle") and (hasattr(inner, "conn") or hasattr(inner, "pipeline"))


def _parsed_up_to(inner: Any, cycle: Any) -> bool:
    """Whether uvicorn has parsed the whole of `cycle`'s request and holds no byte of a later one:
    its next byte starts a request."""
    return not cycle.more_body and not _next_request_began(inner, cycle)


def _next_request_began(inner: Any, cycle: Any) -> bool:
    """Whether uvicorn holds bytes of a request after `cycle`'s: h11 keeps them unparsed in its
    buffer until the response ends (pipelining); httptools queues the parsed ones and opens a
    request's scope at its first byte."""
    conn = getattr(inner, "conn", None)
    if conn is not None:
        return bool(conn.trailing_data[0])
    return bool(inner.pipeline) or inner.scope is not cycle.scope


def inbound_protocol(inner: type[asyncio.Protocol], stamps: InboundStamps) -> type[InboundProtocol]:
    """A protocol class (same constructor as `inner`) whose connections stamp into `stamps`."""
    return type(f"Inbound{inner.__name__}", (InboundProtocol,), {"inner_class": inner, "stamps": stamps})
