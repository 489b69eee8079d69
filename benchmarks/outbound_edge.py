"""The outbound edge: where the first content chunk's bytes wait between the server's `send` call and
the wire. Prints ONE JSON object.

asyncio's `transport.write()` calls send(2) at once when the transport's buffer is empty, so bytes
wait in the server process only when the transport already holds some (its socket full). Three parts:

- `served`: `phaselens serve --model tiny` (the reference server, its `InboundProtocol` on) with each
  connection's `transport.write` observed, under `phaselens bench` at 1, 8 and 16 streams (the
  issue's load). Per request, at the first content chunk's write: the transport's buffered bytes
  before and after it, and the bytes the kernel had not yet sent ahead of it (`SIOCOUTQNSD`). Baseline: the same figures over every write of the run.
- `slow_reader`: uvicorn with phaselens' `InboundProtocol` and a one-route app that writes `pre_bytes`
  of body before a 212-byte first chunk, to a client with a small `SO_RCVBUF` that sleeps 200 ms
  before reading. The same figures, `send`'s own time, and when the client saw the chunk (one process,
  one monotonic clock).
- `cost_ns`: per call, wall and CPU, of what a per-request check would add on the event loop:
  `get_write_buffer_size()`, the `SIOCOUTQNSD` / `SIOCOUTQ` ioctls, a `TCP_INFO` getsockopt; baseline
  an empty call.

    .venv/bin/python benchmarks/outbound_edge.py [--concurrency 1,8,16] [--requests 48]
"""

from __future__ import annotations

import argparse
import asyncio
import atexit
import fcntl
import json
import os
import re
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time
from collections.abc import Callable
from typing import Any

from phaselens.common.quantile import quantile

CONTENT = re.compile(rb'"(text|content)":"[^"]')  # an SSE chunk that carries output (the reference server's)
NO_EXPORT = {"OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none", "OTEL_LOGS_EXPORTER": "none"}
SLOW_READER_ROWS = ((2048, 0), (2048, 64 * 1024), (2048, 1 << 20), (0, 8 << 20))  # (SO_RCVBUF, pre_bytes)
PAUSE_S = 0.2
SIOCOUTQNSD = 0x894B  # linux/sockios.h; not in Python's termios
FIRST = re.compile(rb"FIRSTy{199}\n\n")  # the slow reader's first chunk, read whole


def kernel_queue_bytes(fd: int, request: int = SIOCOUTQNSD) -> int:
    """Bytes in the socket's send queue not yet sent (`SIOCOUTQNSD`), or with `SIOCOUTQ` also those
    sent and not yet acknowledged (on loopback: already in the client's receive queue)."""
    return int(struct.unpack("i", fcntl.ioctl(fd, request, b"\0" * 4))[0])


def observe_writes(transport: Any, on_write: Callable[[bytes, int, int, int], None]) -> None:
    """Replace `transport.write` by one that reports (data, transport bytes before, after, kernel
    queue before) for each write."""
    write = transport.write
    fd = transport.get_extra_info("socket").fileno()

    def observed(data: bytes) -> None:
        before, queued = transport.get_write_buffer_size(), kernel_queue_bytes(fd)
        write(data)
        on_write(bytes(data), before, transport.get_write_buffer_size(), queued)

    transport.write = observed


def serve_probed(out: str, argv: list[str]) -> int:
    """`phaselens <argv>` with every connection's writes observed; the figures go to `out` at exit."""
    from phaselens.cli import main
    from phaselens.instrumentation.server import inbound

    firsts: list[tuple[int, int, int]] = []
    writes = {"count": 0, "transport_after_max": 0, "transport_before_max": 0, "kernel_unsent_max": 0}
    made = inbound.InboundProtocol.connection_made

    def connection_made(self: Any, transport: Any) -> None:
        armed = [False]

        def on_write(data: bytes, before: int, after: int, queued: int) -> None:
            writes["count"] += 1
            writes["transport_before_max"] = max(writes["transport_before_max"], before)
            writes["transport_after_max"] = max(writes["transport_after_max"], after)
            writes["kernel_unsent_max"] = max(writes["kernel_unsent_max"], queued)
            if data.startswith(b"HTTP/1.1 "):
                armed[0] = True
            elif armed[0] and CONTENT.search(data):
                armed[0] = False
                firsts.append((before, after, queued))

        observe_writes(transport, on_write)
        made(self, transport)

    inbound.InboundProtocol.connection_made = connection_made  # type: ignore[method-assign]
    atexit.register(lambda: _dump(out, {"first_chunks": firsts, "writes": writes}))
    return main(argv)


def _dump(path: str, value: object) -> None:
    with open(path, "w") as f:
        json.dump(value, f)


def served(concurrency: int, requests: int) -> dict[str, Any]:
    env = {**os.environ, **NO_EXPORT}
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "writes.json")
        argv = [sys.executable, __file__, "--serve-probed", out, "serve", "--model", "tiny", "--port", "0"]
        server = subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, text=True)
        try:
            url = _ready_url(server)
            bench = [sys.executable, "-m", "phaselens", "bench", "--url", url, "--model", "tiny"]
            bench += ["--concurrency", str(concurrency), "--requests", str(requests)]
            bench += ["--input-len", "uniform:32:256", "--output-len", "24", "--ignore-eos", "--quiet"]
            subprocess.run(bench, env=env, check=True, timeout=600, capture_output=True)
        finally:
            server.terminate()
            server.wait(60)
        with open(out) as f:
            seen = json.load(f)
    firsts = seen["first_chunks"]
    queued = sorted(q for _, _, q in firsts)
    return {
        "concurrency": concurrency,
        "requests_observed": len(firsts),
        "first_chunk_transport_before_max": max((b for b, _, _ in firsts), default=None),
        "first_chunk_transport_after_max": max((a for _, a, _ in firsts), default=None),
        "first_chunk_kernel_unsent_ahead_bytes_p50_max": [quantile(queued, 0.5), queued[-1]] if queued else None,
        "every_write_baseline": seen["writes"],
    }


def _ready_url(server: subprocess.Popen[str]) -> str:
    assert server.stdout is not None
    for line in server.stdout:
        if line.startswith("READY server "):
            return line.split()[-1]
    raise SystemExit(f"the server exited before READY (rc {server.wait()})")


def slow_reader() -> list[dict[str, Any]]:
    import uvicorn
    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    from phaselens.instrumentation.server.inbound import InboundStamps, inbound_protocol

    state: dict[str, Any] = {}

    class Probed(inbound_protocol(AutoHTTPProtocol, InboundStamps(time.monotonic_ns))):  # type: ignore[misc]
        def connection_made(self, transport: Any) -> None:
            state["transport"] = transport
            super().connection_made(transport)

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        transport = state["transport"]
        pre = int(scope["path"].strip("/"))
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        if pre:
            await send({"type": "http.response.body", "body": b"x" * pre, "more_body": True})
        before = transport.get_write_buffer_size()
        queued = kernel_queue_bytes(transport.get_extra_info("socket").fileno())
        called = time.monotonic_ns()
        await send({"type": "http.response.body", "body": b"data: FIRST" + b"y" * 199 + b"\n\n", "more_body": True})
        returned, after = time.monotonic_ns(), transport.get_write_buffer_size()
        state.update(before=before, after=after, queued=queued, called=called, returned=returned)
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    listener = socket.create_server(("127.0.0.1", 0))
    config = uvicorn.Config(app, log_level="warning", http=Probed, lifespan="off")
    threading.Thread(target=uvicorn.Server(config).run, kwargs={"sockets": [listener]}, daemon=True).start()
    time.sleep(1.0)
    rows = []
    for rcvbuf, pre in SLOW_READER_ROWS:
        seen_ts = _read_slowly(listener.getsockname()[1], pre, rcvbuf)
        time.sleep(0.05)
        called = state["called"]
        rows.append(
            {
                "so_rcvbuf": rcvbuf or "default",
                "pre_bytes": pre,
                "transport_before": state["before"],
                "transport_after": state["after"],
                "kernel_unsent_ahead_bytes": state["queued"],
                "send_ms": (state["returned"] - called) / 1e6,
                "client_saw_after_call_ms": (seen_ts - called) / 1e6,
            }
        )
    return rows


def _read_slowly(port: int, pre: int, rcvbuf: int) -> int:
    """One request; sleep PAUSE_S before reading; the monotonic ns the first chunk was read whole."""
    with socket.socket() as client:
        if rcvbuf:
            client.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        client.connect(("127.0.0.1", port))
        client.sendall(f"GET /{pre} HTTP/1.1\r\nhost: bench\r\n\r\n".encode())
        time.sleep(PAUSE_S)
        got, seen_ts = bytearray(), 0
        while not got.endswith(b"0\r\n\r\n"):
            data = client.recv(1 << 16)
            if not data:
                break
            got += data
            if not seen_ts and FIRST.search(got, max(0, len(got) - len(data) - len(FIRST.pattern))):
                seen_ts = time.monotonic_ns()
        return seen_ts


def cost_ns(calls: int = 200_000) -> dict[str, list[float]]:
    """[wall, CPU] ns per call on a connected asyncio transport."""

    async def measure() -> dict[str, list[float]]:
        server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
        _, writer = await asyncio.open_connection("127.0.0.1", server.sockets[0].getsockname()[1])
        transport = writer.transport
        sock = transport.get_extra_info("socket")
        checks: dict[str, Callable[[], object]] = {
            "empty_call_baseline": lambda: None,
            "get_write_buffer_size": transport.get_write_buffer_size,
            "ioctl_siocoutqnsd": lambda: kernel_queue_bytes(sock.fileno()),
            "ioctl_siocoutq": lambda: kernel_queue_bytes(sock.fileno(), termios.TIOCOUTQ),
            "getsockopt_tcp_info": lambda: sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 232),
        }
        result = {name: _per_call(check, calls) for name, check in checks.items()}
        writer.close()
        server.close()
        return result

    return asyncio.run(measure())


def _per_call(check: Callable[[], object], calls: int) -> list[float]:
    cpu, wall = time.process_time_ns(), time.perf_counter_ns()
    for _ in range(calls):
        check()
    return [round((time.perf_counter_ns() - wall) / calls, 1), round((time.process_time_ns() - cpu) / calls, 1)]


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--serve-probed":
        raise SystemExit(serve_probed(sys.argv[2], sys.argv[3:]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", default="1,8,16")
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    result = {
        "served": [served(int(c), args.requests) for c in args.concurrency.split(",")],
        "slow_reader": slow_reader(),
        "cost_ns": cost_ns(),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    main()
