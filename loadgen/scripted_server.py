"""A scripted OpenAI-compatible SSE server with exactly known timings, for testing a harness.

It speaks just enough HTTP/1.1 (keep-alive, Content-Length request bodies, chunked responses) over
asyncio streams, with TCP_NODELAY, so that each scripted write leaves at once. A handler maps a request
to a `Reply`: a status and a list of `Step(delay_ms, data)`; every write is stamped with
`time.perf_counter_ns()` (CLOCK_MONOTONIC on Linux, shared by all processes of the machine), so a
test can compare the client's stamps with the server's.

Run standalone (the default handler streams `max_tokens` chunks, `--interval-ms` apart, each chunk's
text being its send stamp in ns — for measuring the client's timestamp error):
    python -m phaselens.loadgen.scripted_server --port 0 --interval-ms 10
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Self

from phaselens.common.clocks import MonoTs, perf_counter_ts
from phaselens.reference_server.serving.sse import DONE_EVENT, encode_event


def completion_chunk(text: str, finish: str | None = None, usage: dict | None = None) -> bytes:
    obj: dict[str, object] = {
        "id": "cmpl-scripted",
        "object": "text_completion",
        "model": "scripted",
        "choices": [{"index": 0, "text": text, "finish_reason": finish}],
    }
    if usage is not None:
        obj["usage"] = usage
    return encode_event(obj)


def chat_chunk(
    content: str | None = None, reasoning: str | None = None, role: str | None = None, finish: str | None = None
) -> bytes:
    delta = {k: v for k, v in (("role", role), ("content", content), ("reasoning_content", reasoning)) if v is not None}
    return encode_event(
        {
            "id": "chatcmpl-scripted",
            "object": "chat.completion.chunk",
            "model": "scripted",
            "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
        }
    )


def usage_chunk(prompt_tokens: int, completion_tokens: int, reasoning_tokens: int | None = None) -> bytes:
    usage: dict[str, object] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }
    if reasoning_tokens is not None:
        usage["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    return encode_event({"id": "cmpl-scripted", "model": "scripted", "choices": [], "usage": usage})


@dataclass(slots=True)
class Step:
    """Wait `delay_ms`, then write `data` (bytes, or a function of the send stamp returning bytes)."""

    delay_ms: float
    data: bytes | Callable[[int], bytes]


@dataclass(slots=True)
class Reply:
    status: int = 200
    steps: list[Step] = field(default_factory=list)
    body: bytes = b""  # for a non-200 reply
    abort: bool = False  # close the connection after the steps, without ending the response


@dataclass(slots=True)
class ScriptedRequest:
    path: str
    headers: dict[str, str]
    body: dict
    received_ts: MonoTs
    sent_ts: list[MonoTs] = field(default_factory=list)  # stamp of each step's write


Handler = Callable[[ScriptedRequest], Awaitable[Reply]]


class ScriptedServer:
    """`async with ScriptedServer(handler) as server:` → `server.url`; `server.requests` records all."""

    def __init__(self, handler: Handler, host: str = "127.0.0.1", port: int = 0):
        self.handler, self.host, self.port = handler, host, port
        self.requests: list[ScriptedRequest] = []
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task] = set()

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    async def __aenter__(self) -> Self:
        self._server = await asyncio.start_server(self._connection, self.host, self.port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc) -> None:
        self._server.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._tasks.add(asyncio.current_task())
        try:
            while request := await _read_request(reader):
                self.requests.append(request)
                if not await self._respond(request, await self.handler(request), writer):
                    break
        except (ConnectionError, asyncio.IncompleteReadError, asyncio.CancelledError):
            pass  # the client went away, or the server is closing
        finally:
            self._tasks.discard(asyncio.current_task())
            writer.close()

    async def _respond(self, request: ScriptedRequest, reply: Reply, writer: asyncio.StreamWriter) -> bool:
        """Write the reply; False when the connection must close."""
        if reply.status != 200:
            writer.write(
                b"HTTP/1.1 %d Error\r\ncontent-type: application/json\r\ncontent-length: %d\r\n\r\n"
                % (reply.status, len(reply.body))
                + reply.body
            )
            await writer.drain()
            return True
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
        for step in reply.steps:
            if step.delay_ms > 0:
                await asyncio.sleep(step.delay_ms / 1e3)
            now = perf_counter_ts()
            data = step.data(now) if callable(step.data) else step.data
            writer.write(b"%x\r\n%s\r\n" % (len(data), data))
            request.sent_ts.append(now)
            await writer.drain()
        if reply.abort:
            return False
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        return True


async def _read_request(reader: asyncio.StreamReader) -> ScriptedRequest | None:
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return None
    received = perf_counter_ts()
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1]
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:] if line)}
    body = await reader.readexactly(int(headers.get("content-length", "0")))
    return ScriptedRequest(path=path, headers=headers, body=json.loads(body) if body else {}, received_ts=received)


def stamped_stream(interval_ms: float) -> Handler:
    """Handler streaming `max_tokens` completion chunks `interval_ms` apart; each chunk's text is its
    send stamp (perf_counter_ns), then a usage chunk and [DONE]."""

    async def handler(request: ScriptedRequest) -> Reply:
        n = int(request.body.get("max_tokens", 16))
        steps = [Step(interval_ms, lambda now: completion_chunk(str(now))) for _ in range(n)]
        steps += [Step(0, usage_chunk(1, n) + DONE_EVENT)]
        return Reply(steps=steps)

    return handler


async def _serve(args) -> None:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with ScriptedServer(stamped_stream(args.interval_ms), port=args.port) as server:
        print(f"READY scripted-server {server.url}", flush=True)
        await stop.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--interval-ms", type=float, default=10.0)
    asyncio.run(_serve(parser.parse_args()))


if __name__ == "__main__":
    main()
