"""The event loop's work at a request's receipt: the incoming trace context, before and after the
direct W3C path (instrumentation/server/incoming.py). Prints ONE JSON object.

Over one request's ASGI scope as vLLM's API server receives it from an OpenAI client (9 headers, a
W3C traceparent, an X-Request-ID): `before`, the headers decoded into a carrier and
`propagate.extract` over it (what `ServerTelemetry.open_request` did); `after`,
`IncomingExtractor.extract`; `open_request`, the whole receipt now (ids and sampling decided, the
handle made). CPU per call: thread CPU time over `--calls` calls, the best of `--repeats`, the two
paths alternated. `--callgrind`: instructions per call instead, each path counted alone by
callgrind over `--calls` calls after a warm-up (valgrind needed).

    .venv/bin/python benchmarks/incoming_extract.py [--calls 20000] [--repeats 7] [--callgrind]
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry import propagate
from opentelemetry.sdk.trace import TracerProvider

from benchmarks.instrumentation_overhead import reduce_instructions
from phaselens.instrumentation.server.incoming import IncomingExtractor, headers_carrier
from phaselens.instrumentation.server.telemetry import ServerTelemetry

HEADERS = (
    ("host", "127.0.0.1:8000"), ("accept-encoding", "gzip, deflate"), ("connection", "keep-alive"),
    ("accept", "application/json"), ("content-type", "application/json"), ("user-agent", "AsyncOpenAI/Python 1.99"),
    ("traceparent", "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"), ("x-request-id", "bench-1"),
    ("content-length", "212"),
)  # fmt: skip
SCOPE = {
    "type": "http", "method": "POST", "path": "/v1/completions", "server": ("127.0.0.1", 8000),
    "client": ("127.0.0.1", 50000), "headers": [(k.encode(), v.encode()) for k, v in HEADERS],
}  # fmt: skip


def paths(telemetry: ServerTelemetry) -> dict:
    extractor = IncomingExtractor()
    return {
        "before": lambda: propagate.extract(headers_carrier(SCOPE)),
        "after": lambda: extractor.extract(SCOPE),
        "open_request": lambda: telemetry.open_request(dict(SCOPE), managed=True),
    }


def cpu_ns_per_call(calls: int, repeats: int, telemetry: ServerTelemetry) -> dict:
    best = dict.fromkeys(paths(telemetry), float("inf"))
    for _ in range(repeats):
        for name, call in paths(telemetry).items():
            start = time.thread_time_ns()
            for _ in range(calls):
                call()
            best[name] = min(best[name], (time.thread_time_ns() - start) / calls)
    return {f"{name}_cpu_us_per_call": round(ns / 1000, 2) for name, ns in best.items()}


def callgrind_child(calls: int, telemetry: ServerTelemetry) -> None:
    """Under callgrind: one warm-up then one counted `functools.reduce` per path (see callgrind_counts)."""
    for call in paths(telemetry).values():
        for _ in range(100):
            call()
        functools.reduce(lambda _, __: call(), range(calls), None)


def callgrind_counts(calls: int) -> dict:
    counted = reduce_instructions(__file__, ["--calls", str(calls)])
    if counted is None:
        return {"skipped": "valgrind is not installed"}
    counts, _ = counted
    names = ("before", "after", "open_request")  # paths()' order
    return {f"{name}_instructions_per_call": round(n / calls) for name, n in zip(names, counts, strict=True)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--callgrind", action="store_true")
    parser.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.callgrind and not args.callgrind_child:
        print(json.dumps(callgrind_counts(args.calls)))
        return
    telemetry = ServerTelemetry(TracerProvider(), builder="thread")  # an SDK provider: its sampler decides, as in vLLM
    try:
        if args.callgrind_child:
            callgrind_child(args.calls, telemetry)
        else:
            print(json.dumps(cpu_ns_per_call(args.calls, args.repeats, telemetry)))
    finally:
        telemetry.shutdown()


if __name__ == "__main__":
    main()
