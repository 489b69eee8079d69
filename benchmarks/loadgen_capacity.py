"""How much streaming load one core of the load generator drives while its clock stays honest.

A scripted SSE server runs in its own process (pinned to another core when there is one) and streams
each request's chunks `interval_ms` apart, every chunk carrying its write stamp (perf_counter_ns =
CLOCK_MONOTONIC, one clock for every process of the machine). The load generator (this process,
pinned to one core) runs open-loop Poisson arrivals through the traced client, spans on (batch
processor, discarding exporter), and climbs a ladder of levels. At each level:
    schedule lag     = actual send − intended send                              (p99 < 5 ms to pass)
    timestamp error  = client receive stamp − server write stamp of each chunk  (p99 < 1 ms to pass)
                       (loopback delivery + the client's event-loop delay: an upper bound on how late
                       the client stamps a chunk)
    chunk rate       = content chunks received / (last chunk − first send)
    peak streams     = most requests in flight at once (from sent/done stamps)
    CPU per chunk    = this process's CPU time / chunks (robust to a busy machine: one core could
                       drive about 1e6 / that many chunks per second)
Two ladders: `chunks` (short 10 ms-interval streams: chunk rate grows) and `streams` (slow 200 ms
streams: concurrency grows), each climbed until a request fails or p99 lag passes 100 ms; each
level's arrivals last at least twice a request's duration. Reported: the highest passing level. Baselines, same run:
the highest passing chunk level again with tracing off (no-op tracer), which prices the spans; and a reference
client (bare asyncio protocol, a regex for the stamps, no HTTP/SSE/JSON layers, no spans) at the target levels
(24 streams ≈ 2,100 chunks/s; 256 streams): the noise floor of lag and timestamp error on this machine now.
Targets: ≥ 2,000 chunks/s and ≥ 256 concurrent streams.

    python benchmarks/loadgen_capacity.py [--quick] [--no-pin]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.trace import NoOpTracerProvider

from phaselens.common.quantile import quantile
from phaselens.instrumentation.client.traced_client import TracedClient
from phaselens.loadgen import runner
from phaselens.loadgen.arrivals import GammaArrivals
from phaselens.loadgen.workloads import LengthDist, SyntheticWorkload

LAG_P99_MS = 5.0
ERROR_P99_MS = 1.0
STOP_LAG_P99_MS = 100.0


class Discard(SpanExporter):
    def export(self, spans):
        return SpanExportResult.SUCCESS


@dataclass(slots=True)
class Ladder:
    name: str
    interval_ms: float
    chunks: int  # per request
    streams: tuple[int, ...]  # target concurrency of each level: rate = streams / request duration
    reference_streams: int  # the level the reference client also drives (the target's level)


def start_server(interval_ms: float, core: int | None) -> tuple[subprocess.Popen, str]:
    pin = (lambda: os.sched_setaffinity(0, {core})) if core is not None else None
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaselens.loadgen.scripted_server", "--interval-ms", str(interval_ms)],
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=pin,
    )
    line = proc.stdout.readline().split()
    if line[:2] != ["READY", "scripted-server"]:
        proc.kill()
        raise RuntimeError(f"scripted server did not start: {line}")
    return proc, line[2]


def p99(values: list[float]) -> float | None:
    return quantile(sorted(values), 0.99)


class _RawStream(asyncio.Protocol):
    """The reference client: one request on a bare asyncio connection, each read stamped and
    scanned for the server's write stamps; no HTTP or SSE layers, no spans (the noise floor)."""

    def __init__(self, request: bytes, done: asyncio.Future):
        self.request, self.done, self.errors_ms = request, done, []

    def connection_made(self, transport) -> None:
        transport.write(self.request)
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        now = time.perf_counter_ns()
        self.errors_ms += [(now - int(stamp)) / 1e6 for stamp in _STAMP.findall(data)]
        if data.endswith(b"0\r\n\r\n"):
            self.transport.close()

    def connection_lost(self, exc) -> None:
        if not self.done.done():
            self.done.set_result(self.errors_ms)


_STAMP = re.compile(rb'"text": "(\d+)"')


async def measure_raw(url: str, ladder: Ladder, streams: int, duration_s: float) -> dict:
    """The same level driven by the reference client: what this machine allows at all."""
    request_s = ladder.chunks * ladder.interval_ms / 1e3
    rate, duration_s = streams / request_s, max(duration_s, 2 * request_s)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "bench", "prompt": "x", "max_tokens": ladder.chunks, "stream": True}).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: %s\r\ncontent-type: application/json\r\n"
        b"content-length: %d\r\n\r\n%s" % (url.encode(), len(body), body)
    )
    loop = asyncio.get_running_loop()
    cpu_s = time.process_time()
    start, lags, pending = time.perf_counter_ns() + 2_000_000, [], []
    for offset_s in GammaArrivals(rate, seed=streams).offsets_s():
        if offset_s >= duration_s:
            break
        intended = start + int(offset_s * 1e9)
        await asyncio.sleep(max(intended - time.perf_counter_ns(), 0) / 1e9)
        lags.append((time.perf_counter_ns() - intended) / 1e6)
        done = loop.create_future()
        await loop.create_connection(lambda done=done: _RawStream(request, done), host, int(port))
        pending.append(done)
    errors = [e for per_request in await asyncio.gather(*pending) for e in per_request]
    cpu_s = time.process_time() - cpu_s
    return {
        "target_streams": streams,
        "requests": len(pending),
        "chunks": len(errors),
        "client_cpu_us_per_chunk": round(cpu_s / len(errors) * 1e6, 1) if errors else None,
        "lag_p99_ms": p99(lags),
        "ts_error_p50_ms": quantile(sorted(errors), 0.5),
        "ts_error_p99_ms": p99(errors),
    }


async def measure(url: str, ladder: Ladder, streams: int, duration_s: float, provider) -> dict:
    request_s = ladder.chunks * ladder.interval_ms / 1e3
    rate, duration_s = streams / request_s, max(duration_s, 2 * request_s)
    plan = runner.RunPlan("completions", "bench", arrivals=GammaArrivals(rate, seed=streams), duration_s=duration_s)
    work = SyntheticWorkload(LengthDist.parse("4"), LengthDist("fixed", ladder.chunks), seed=0)
    cpu_s = time.process_time()
    async with TracedClient(url, tracer_provider=provider, keep_text=True, timeout_s=60) as client:
        run = await runner.run(plan, client, work.requests())
    cpu_s = time.process_time() - cpu_s
    ok = [r for r in run.results if r.ok]
    errors = [(c - int(t)) / 1e6 for r in ok for c, t in zip(r.chunk_ts, r.chunk_text, strict=False)]
    chunks = sum(len(r.chunk_ts) for r in ok)
    span_ns = max((r.last_chunk_ts or r.done_ts for r in ok), default=0) - min((r.sent_ts for r in ok), default=0)
    edges = sorted([(r.sent_ts, 1) for r in run.results] + [(r.done_ts, -1) for r in run.results])
    peak, live = 0, 0
    for _, step in edges:
        live += step
        peak = max(peak, live)
    lag = p99([r.schedule_lag_ms for r in run.results])
    err = p99(errors)
    return {
        "target_streams": streams,
        "rate_rps": round(rate, 2),
        "requests": len(run.results),
        "failed": len(run.results) - len(ok),
        "peak_streams": peak,
        "chunks_per_s": round(chunks / (span_ns / 1e9), 1) if span_ns > 0 else 0.0,
        "client_cpu_us_per_chunk": round(cpu_s / chunks * 1e6, 1) if chunks else None,
        "lag_p99_ms": lag,
        "ts_error_p50_ms": quantile(sorted(errors), 0.5),
        "ts_error_p99_ms": err,
        "passed": bool(ok) and len(ok) == len(run.results) and lag < LAG_P99_MS and err < ERROR_P99_MS,
    }


def climb(ladder: Ladder, duration_s: float, core: int | None) -> tuple[list[dict], dict | None, dict]:
    server, url = start_server(ladder.interval_ms, core)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(Discard()))
    levels: list[dict] = []
    try:
        for streams in ladder.streams:
            levels.append(asyncio.run(measure(url, ladder, streams, duration_s, provider)))
            print(json.dumps({ladder.name: levels[-1]}), file=sys.stderr)
            if levels[-1]["failed"] or levels[-1]["lag_p99_ms"] > STOP_LAG_P99_MS:
                break  # the client is saturated: higher levels only measure the overload
        best = max((lv for lv in levels if lv["passed"]), key=lambda lv: lv["target_streams"], default=None)
        baseline = (
            asyncio.run(measure(url, ladder, best["target_streams"], duration_s, NoOpTracerProvider()))
            if best
            else None
        )
        reference = asyncio.run(measure_raw(url, ladder, ladder.reference_streams, duration_s))
    finally:
        provider.shutdown()
        server.terminate()
        server.wait(timeout=10)
    return levels, baseline, reference


def main() -> None:
    parser = argparse.ArgumentParser(description="load generator capacity on one core")
    parser.add_argument("--quick", action="store_true", help="short levels (about 30 s in all)")
    parser.add_argument("--no-pin", action="store_true", help="let the OS place client and server (busy machine)")
    args = parser.parse_args()
    cores = sorted(os.sched_getaffinity(0))
    client_core, server_core = cores[0], (cores[1] if len(cores) > 1 else None)
    if args.no_pin:
        client_core = server_core = None
    else:
        os.sched_setaffinity(0, {client_core})
    duration = 1.5 if args.quick else 5.0
    chunk_ladder = Ladder("chunks", 10.0, 40, (4, 8, 16, 24, 32, 48, 64, 96, 128), reference_streams=24)
    stream_ladder = Ladder("streams", 200.0, 10, (64, 128, 256, 384, 512, 768, 1024), reference_streams=256)
    chunk_levels, chunk_baseline, chunk_reference = climb(chunk_ladder, duration, server_core)
    stream_levels, _, stream_reference = climb(stream_ladder, duration, server_core)
    best = lambda levels, key: max((lv[key] for lv in levels if lv["passed"]), default=0)  # noqa: E731
    result = {
        "benchmark": "loadgen_capacity",
        "quick": args.quick,
        "client_core": client_core,
        "server_core": server_core,
        "criteria": {"lag_p99_ms_below": LAG_P99_MS, "ts_error_p99_ms_below": ERROR_P99_MS},
        "max_chunks_per_s": best(chunk_levels, "chunks_per_s"),
        "max_concurrent_streams": best(stream_levels, "peak_streams"),
        "client_cpu_us_per_chunk": chunk_levels[-1]["client_cpu_us_per_chunk"],
        "targets": {"chunks_per_s": 2000, "concurrent_streams": 256},
        "baseline_tracing_off_at_best_chunk_level": chunk_baseline,
        "reference_client": {"chunks": chunk_reference, "streams": stream_reference},
        "levels": {"chunks": chunk_levels, "streams": stream_levels},
    }
    result["meets_targets"] = result["max_chunks_per_s"] >= 2000 and result["max_concurrent_streams"] >= 256
    print(json.dumps(result))


if __name__ == "__main__":
    main()
