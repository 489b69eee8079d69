"""A TCP proxy on loopback that holds every chunk `delay_ms` in each direction: a network of known
one-way delay between a client and a server on one machine (no network namespace needed).

Per direction of each connection, a reader thread reads as bytes come (so a chunk is not merged with
the ones behind it) with `recvmsg`, taking the kernel's receive stamp (SO_TIMESTAMPNS,
CLOCK_REALTIME); a sender thread sends each chunk at stamp + delay. On a busy machine a thread wakes
late, so the proxy also records what it really held each chunk, from the kernel's receive stamp to
the start of the send (`held_ms[direction]`): the truth to compare with.
`with DelayProxy(host, port, delay_ms) as proxy:` → `proxy.url`.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
import time
from typing import Self

from phaselens.instrumentation.hotpath.kernel_stamps import SCM_TIMESTAMPNS, SO_TIMESTAMPNS

UP, DOWN = "up", "down"  # client → server, server → client
_CMSG_BYTES = socket.CMSG_SPACE(16)


class DelayProxy:
    def __init__(self, upstream_host: str, upstream_port: int, delay_ms: float) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay_ns = int(delay_ms * 1e6)
        self.held_ms: dict[str, list[float]] = {UP: [], DOWN: []}
        self._listener = socket.socket()
        self._listener.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen()
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = []
        self._threads: list[threading.Thread] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> Self:
        self._spawn(self._accept)
        return self

    def __exit__(self, *exc) -> None:
        for sock in [self._listener, *self._sockets]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        for thread in self._threads:
            thread.join(10)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name="delay-proxy", daemon=True)
        self._threads.append(thread)
        thread.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            server.setsockopt(socket.SOL_SOCKET, SO_TIMESTAMPNS, 1)
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._sockets += [client, server]
            self._spawn(self._pipe, client, server, UP)
            self._spawn(self._pipe, server, client, DOWN)

    def _pipe(self, source: socket.socket, sink: socket.socket, direction: str) -> None:
        chunks: queue.SimpleQueue[tuple[int, bytes]] = queue.SimpleQueue()
        self._spawn(self._send, chunks, sink, direction)
        while True:
            try:
                data, ancillary, _, _ = source.recvmsg(65536, _CMSG_BYTES)
            except OSError:
                data = b""
            chunks.put((_stamp(ancillary) or time.clock_gettime_ns(time.CLOCK_REALTIME), data))
            if not data:
                return

    def _send(self, chunks: queue.SimpleQueue, sink: socket.socket, direction: str) -> None:
        while True:
            arrived, data = chunks.get()
            if not data:
                with contextlib.suppress(OSError):
                    sink.shutdown(socket.SHUT_WR)
                return
            time.sleep(max(0, arrived + self.delay_ns - time.clock_gettime_ns(time.CLOCK_REALTIME)) / 1e9)
            self.held_ms[direction].append((time.clock_gettime_ns(time.CLOCK_REALTIME) - arrived) / 1e6)
            try:
                sink.sendall(data)
            except OSError:
                return


def _stamp(ancillary) -> int:
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == SCM_TIMESTAMPNS:
            sec, nsec = struct.unpack_from("qq", data)
            return sec * 1_000_000_000 + nsec
    return 0
