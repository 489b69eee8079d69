"""Instrumentation overhead on the serving-loop thread: phaselens stamps vs tracing off vs a naive
OpenTelemetry span per token. Prints ONE JSON object.

A null engine (no model) keeps B requests in flight for S steps; each request lives L decode steps,
then finishes, is closed (handed to the span builder) and replaced. Per step it calls, for every
request, `token()` (or the new request's enqueued/scheduled/prefill_chunk/first_token), then the
step observer once. Four loops in the same run:

- off:     observer.NULL_REQUEST / NULL_STEP (what a loop pays with tracing off)
- thread:  phaselens handles, with the span builder thread running concurrently and exporting
           through the counting batch processor into an exporter that OTLP-encodes each batch and
           discards it (real SDK + real protobuf encoding; only the network is left out)
- fast:    the same handles, records shipped to the span-builder process (the default path), which
           describes the same spans and encodes them to OTLP in C (PHASELENS_SPAN_BACKEND=fast),
           exported with the real OTLP/HTTP exporter to a loopback sink process
- sdk:     the same, the child making SDK ReadableSpans and encoding them with the SDK
           (PHASELENS_SPAN_BACKEND=sdk: a user's own provider and processors take this path)
- naive:   one SDK span per token (start_span + end on the loop thread), same provider

Figures: loop-thread ns per request per decode step ((on − off) / (S·B), the builder paused so the
stamps are measured alone); the same per request over its L steps; opening a request (receipt
stamp, context extraction, the sampling decision and root ids), which runs on the event-loop
thread, reported apart; builder µs per request (spans,
metrics and OTLP encoding, off the loop); throughput loss % = 1 − off/on wall time with a stand-in
model step (`--model-step-us` of hashing, which releases the GIL as torch kernels do) and the
builder running, so it competes for the GIL and the CPUs as in a real server; and the naive
version's ns per token. Process builder: the child's CPU µs per request (its share of step spans
included), from the CPU time it reports, and the shipper thread's CPU µs per request in the serving
process (packing and writing, under its GIL).

Rounds: per path and round, a run with tracing off and one with it on, the order alternated
(off-on, on-off, ...: a drift of the machine's load cancels), each `--steps` long. Each figure
is taken per pair, and its median over the rounds is reported with a distribution-free confidence
interval (`median_ci`: order statistics, exact coverage given) and every round's value. Throughput
loss % = 1 − off/on wall time of the pair (`throughput_loss_pct_median`; `throughput_loss_pct`:
the fastest run of each; `throughput_loss_pct_step_p50`: from the pair's median step time).

Deterministic figures beside the wall-clock ones (a shared 2-core machine moves throughput by more
than the effect): CPU µs per request of the serving process, tracing off and on, and their
difference per pair (process CPU time over the run and, when on, its flush, less the model stand-in's
own CPU, which is the same work either way and the noisiest part; divided by the requests closed);
the loop thread's own time per request-step with the model running, on over off (the stamps plus
any wait for the GIL while the shipper or the report reader holds it); the span-builder child's CPU
(the CPU time it reports); and instruction counts under valgrind's callgrind
(`--callgrind`, on by default where valgrind is installed; they count the same on a busy machine):
the loop's stamps per request-step (phaselens handles − tracing off, the builder paused), the
builder per request (the child's work: frames → records → spans → OTLP bytes, fast vs SDK, metrics
into a metric reader as with the default OTEL_METRICS_EXPORTER=otlp, network left out)
and the shipper's packing per request (`wire.pack` into the retention, as a drain does; the
write left out). Targets: ≤ 1 µs per request per step; ≤ 1 % throughput loss
at B = 64 (median of rounds); default path: builder ≤ 100 µs CPU per request (≤ 20 µs per span),
shipper ≤ 20 µs per request.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.sdk.version import __version__ as otel_sdk_version

from phaselens.common.quantile import quantile
from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.observer import FINISH_LENGTH, NULL_REQUEST, NULL_STEP, NullRequest
from phaselens.instrumentation.hotpath.records import RequestRecord, StepStats
from phaselens.instrumentation.pipeline.builder import SpanBuilder
from phaselens.instrumentation.pipeline.emitter import SpanEmitter
from phaselens.instrumentation.pipeline.genai_metrics import GenAiServerMetrics
from phaselens.instrumentation.pipeline.histograms import HistogramReader
from phaselens.instrumentation.pipeline.otel_setup import add_counting_processor
from phaselens.instrumentation.pipeline.otlp_fast import FastEmitter, request_encoder
from phaselens.instrumentation.pipeline.span_processor import BatchSettings, CountingBatchSpanProcessor
from phaselens.instrumentation.process import retention, wire
from phaselens.instrumentation.server.telemetry import ServerTelemetry

PATHS = ("fast", "sdk", "thread")  # fast: the default (process builder, C encoder)

SCOPE = {"type": "http", "method": "POST", "path": "/v1/completions", "headers": [], "server": ("127.0.0.1", 8000)}


class EncodingDiscardExporter(SpanExporter):
    """OTLP-encodes every batch (the exporter's CPU cost) and throws the bytes away."""

    def __init__(self) -> None:
        self.bytes = 0

    def export(self, spans) -> SpanExportResult:
        self.bytes += len(encode_spans(spans).SerializeToString())
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class ModelStandIn:
    """A fixed amount of GIL-releasing work per step (sha256 over a buffer), calibrated once."""

    def __init__(self, step_us: float) -> None:
        self.buffer = b"\0" * (1 << 20)
        self.length = 0
        if step_us > 0:
            started = time.perf_counter_ns()
            for _ in range(20):
                hashlib.sha256(self.buffer).digest()
            ns_per_byte = (time.perf_counter_ns() - started) / (20 * len(self.buffer))
            self.length = int(step_us * 1000 / ns_per_byte)
            self.buffer = b"\0" * self.length

        self.stamps: list[int] = []
        self.cpu_ns = 0  # this thread's CPU in step(): taken out of the serving process's CPU figures

    def step(self) -> None:
        if self.length:
            started = time.thread_time_ns()
            hashlib.sha256(self.buffer).digest()
            self.stamps.append(time.perf_counter_ns())
            self.cpu_ns += time.thread_time_ns() - started

    def take_step_quantiles_ms(self) -> tuple[float, float]:
        """p50 and p99 of full step times (loop + model) since the last call."""
        gaps = sorted(b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False))
        self.stamps = []
        return quantile(gaps, 0.5) / 1e6, quantile(gaps, 0.99) / 1e6


def make_providers() -> tuple[TracerProvider, MeterProvider, EncodingDiscardExporter]:
    exporter = EncodingDiscardExporter()
    provider = TracerProvider()
    add_counting_processor(provider, exporter)
    return provider, MeterProvider(), exporter


class NaiveRequest(NullRequest):
    """Tracing the naive way: the request's context, and a span per token."""

    __slots__ = ("context",)

    def __init__(self, context) -> None:
        self.context = context


def open_requests(open_request, batch: int, steps: int, life: int) -> tuple[list, list]:
    """The B requests in flight at the start, and the ones that replace them as they finish."""
    live = [[open_request(), 0] for _ in range(batch)]
    return live, [open_request() for _ in range(steps * batch // life + batch)]


def run_engine(
    open_request, close, per_token, step_observer, batch: int, steps: int, life: int, model: ModelStandIn, opened=None
) -> int:
    """The null engine; returns loop-thread ns for `steps` steps (request opening excluded; `opened`:
    requests opened beforehand by open_requests)."""
    live, spare = opened or open_requests(open_request, batch, steps, life)
    reqs = [item[0] for item in live]
    elapsed = 0
    for _ in range(steps):
        started = time.perf_counter_ns()
        for item in live:
            req = item[0]
            if item[1] == 0:
                req.enqueued()
                req.scheduled()
                req.prefill_chunk(started, started, 16, 0)
                req.first_token()
            else:
                per_token(req)
            item[1] += 1
            if item[1] == life:
                req.finished(FINISH_LENGTH)
                close(req)
                item[0], item[1] = spare.pop(), 0
        step_observer.step(StepStats(started, started, 0, batch, 1, 2), reqs)
        reqs = [item[0] for item in live]
        elapsed += time.perf_counter_ns() - started
        model.step()
    return elapsed


def measure_off(args, model, steps: int | None = None) -> int:
    return run_engine(
        lambda: NULL_REQUEST,
        lambda req: None,
        lambda req: req.token(),
        NULL_STEP,
        args.batch,
        steps or args.steps,
        args.life,
        model,
    )


def measure_off_short(args, model) -> int:
    return measure_off(args, model, args.naive_steps)


def measure_on(args, model, telemetry) -> int:
    return run_engine(
        lambda: telemetry.request(dict(SCOPE)),
        lambda req: req.complete(args.life, FINISH_LENGTH),
        lambda req: req.token(),
        telemetry.step_observer,
        args.batch,
        args.steps,
        args.life,
        model,
    )


def measure_naive(args, model) -> int:
    from opentelemetry import trace

    tracer = make_providers()[0].get_tracer("naive")

    def per_token(req):
        tracer.start_span("token", context=req.context).end()

    def open_request():
        return NaiveRequest(trace.set_span_in_context(tracer.start_span("request")))

    return run_engine(
        open_request, lambda req: None, per_token, NULL_STEP, args.batch, args.naive_steps, args.life, model
    )


def measure_open_request_ns(telemetry, count: int) -> float:
    """Event-loop thread: stamp `received`, extract context, decide sampling and the root ids."""
    started = time.perf_counter_ns()
    handles = [telemetry.request(dict(SCOPE)) for _ in range(count)]
    elapsed = time.perf_counter_ns() - started
    for handle in handles:
        handle.complete(0, FINISH_LENGTH)
    return elapsed / count


def measure_builder_us(args, count: int) -> float:
    """Builder-thread cost of one request (all its spans + metrics), measured by flushing a backlog."""
    provider, meter_provider, _ = make_providers()
    telemetry = ServerTelemetry(provider, meter_provider, poll_interval_s=3600, queue_capacity=count + 1)
    time.sleep(0.05)  # the builder sleeps: the backlog is built in one flush below
    for _ in range(count):
        req = telemetry.request(dict(SCOPE))
        req.enqueued()
        req.scheduled()
        req.prefill_chunk(0, 0, 16, 0)
        req.first_token()
        for _ in range(args.life - 1):
            req.token()
        req.finished(FINISH_LENGTH)
        req.complete(args.life, FINISH_LENGTH)
    started = time.perf_counter_ns()
    telemetry.shutdown()  # builds all pending requests, then flushes the exporter
    return (time.perf_counter_ns() - started) / count / 1000


def paused_telemetry(capacity: int, builder: str) -> ServerTelemetry:
    """Telemetry whose builder sleeps through the run: the loop's own stamping cost, alone."""
    provider, meter_provider, _ = make_providers()
    telemetry = ServerTelemetry(
        provider, meter_provider, poll_interval_s=3600, queue_capacity=capacity, builder=builder
    )
    time.sleep(0.05)
    return telemetry


SINK = """
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
class Sink(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keeps the connection, as a collector does
    def do_POST(self):
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self.send_response(200); self.send_header("content-length", "0"); self.end_headers()
    def log_message(self, *args): pass
server = ThreadingHTTPServer(("127.0.0.1", 0), Sink)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


def start_otlp_sink() -> tuple[subprocess.Popen, str]:
    """A loopback OTLP/HTTP endpoint in its own process that accepts and discards every export; it
    stands for a remote collector, so it runs at the lowest priority (nice 19)."""
    sink = subprocess.Popen([sys.executable, "-c", SINK], stdout=subprocess.PIPE, preexec_fn=lambda: os.nice(19))
    return sink, f"http://127.0.0.1:{int(sink.stdout.readline())}"


def process_builder_env(endpoint: str) -> None:
    """The span-builder process exports real OTLP/HTTP (protobuf) to the sink, spans and (as by
    default, every OTEL_METRIC_EXPORT_INTERVAL) metrics."""
    os.environ.update(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "otlp",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        }
    )


def timed(run) -> int:
    started = time.perf_counter_ns()
    run()
    return time.perf_counter_ns() - started


def live_telemetry(path: str, provider: TracerProvider, meter_provider: MeterProvider) -> ServerTelemetry:
    """The serving side of a path; a process path's child reads PHASELENS_SPAN_BACKEND when spawned."""
    if path == "thread":
        return ServerTelemetry(provider, meter_provider)
    os.environ[names.ENV_SPAN_BACKEND] = names.SPAN_BACKEND_FAST if path == "fast" else names.SPAN_BACKEND_SDK
    return ServerTelemetry(provider, meter_provider, builder="process")


def measured(run, model: ModelStandIn, after=lambda: None) -> dict:
    """One timed run: wall ns of `run()`; this process's CPU ns over it and `after()` (an on run's
    flush: the shipping of its records), less the model stand-in's own CPU (the sha256 is the same
    work either way and moves by more than the effect on a shared machine); the loop thread's own
    ns (run_engine's, without the model steps); the full steps' p50 and p99."""
    model_cpu_ns = model.cpu_ns
    cpu_start_ns, start_ts = time.process_time_ns(), time.perf_counter_ns()
    loop_ns = run()
    wall_ns = time.perf_counter_ns() - start_ts
    after()
    cpu_ns = time.process_time_ns() - cpu_start_ns - (model.cpu_ns - model_cpu_ns)
    return {"wall": wall_ns, "cpu": cpu_ns, "loop": loop_ns, "quantiles": model.take_step_quantiles_ms()}


def median_ci(values: list[float], confidence: float = 0.95) -> dict:
    """The median and a distribution-free confidence interval for it: the order statistics x(j) and
    x(n+1-j) (1-based), j the largest with P(Binomial(n, ½) < j) ≤ (1 − confidence)/2 (at least 1);
    `coverage` = 1 − 2·P(Binomial(n, ½) < j), the interval's exact level."""
    ordered, n = sorted(values), len(values)
    below = [sum(math.comb(n, i) for i in range(j)) / 2**n for j in range(n // 2 + 2)]  # P(X < j)
    j = max([1] + [k for k in range(1, n // 2 + 1) if below[k] <= (1 - confidence) / 2])
    return {
        "median": statistics.median(ordered),
        "ci": [ordered[j - 1], ordered[n - j]],
        "coverage": round(1 - 2 * below[j], 4),
        "rounds": [round(v, 3) for v in values],
    }


def mode_figures(args, tokens: int, off_ns: int, off: list[dict], on: dict, telemetry: ServerTelemetry) -> dict:
    """One path's figures. Stamps: the loop with the builder paused, no model, over tracing off.
    With the model: `off` and `on["with_model"]` are the path's pairs of runs (order alternated),
    each figure per pair, then its median and the median's confidence interval."""
    per_step_ns = (min(on["stamps"]) - off_ns) / tokens
    requests = args.steps * args.batch // args.life
    pairs = list(zip(off, on["with_model"], strict=True))
    return {
        "loop_ns_per_request_step": min(on["stamps"]) / tokens,
        "overhead_ns_per_request_step": per_step_ns,
        "overhead_ns_per_request_total": per_step_ns * args.life,
        "event_loop_us_per_request_open": measure_open_request_ns(telemetry, 500) / 1000,
        "throughput_loss_pct_median": median_ci([100 * (1 - a["wall"] / b["wall"]) for a, b in pairs]),
        # the same from the pair's median step (loop + model): robust to the scheduler's pauses, blind
        # to what holds up only a few steps (a shipper's drain every SHIP_INTERVAL_S)
        "throughput_loss_pct_step_p50": median_ci(
            [100 * (1 - a["quantiles"][0] / b["quantiles"][0]) for a, b in pairs]
        ),
        "throughput_loss_pct": 100 * (1 - min(a["wall"] for a in off) / min(b["wall"] for b in on["with_model"])),
        "throughput_loss_pct_stamps_only": 100 * per_step_ns * args.batch / (args.model_step_us * 1000),
        "serving_cpu_us_per_request": median_ci([(b["cpu"] - a["cpu"]) / requests / 1000 for a, b in pairs]),
        "serving_cpu_us_per_request_off_on": [
            statistics.median(run["cpu"] for run in runs) / requests / 1000 for runs in (off, on["with_model"])
        ],
        "loop_with_model_ns_per_request_step_over_off": median_ci([(b["loop"] - a["loop"]) / tokens for a, b in pairs]),
        "steps_per_s_with_model": args.steps / (min(b["wall"] for b in on["with_model"]) / 1e9),
        "step_ms_p50_p99_with_model": min(b["quantiles"] for b in on["with_model"]),
        "samples_ms": {
            "stamps_null": [round(v / 1e6, 3) for v in on["stamps"]],
            "with_model": [round(b["wall"] / 1e6, 3) for b in on["with_model"]],
        },
    }


COUNTED = ("requests_offered", "spans_built", "child_cpu_ns", "shipper_cpu_ns", "spans_dropped")


def child_figures(windows: list[tuple[dict, dict]]) -> dict:
    """The span-builder child's CPU (build + export) and the shipper thread's, per request and per
    span, summed over the path's own timed runs and their flushes (stats before, after)."""
    total = {key: sum(after[key] - before[key] for before, after in windows) for key in COUNTED}
    requests, spans = total["requests_offered"], total["spans_built"]
    return {
        "child_cpu_us_per_request": total["child_cpu_ns"] / requests / 1000,
        "child_cpu_us_per_span": total["child_cpu_ns"] / spans / 1000,
        "shipper_cpu_us_per_request": total["shipper_cpu_ns"] / requests / 1000,
        "requests": requests,
        "spans": spans,
        "spans_dropped": total["spans_dropped"],
    }


def warm_up(args, live: dict, no_model) -> None:
    """Each path builds and exports a few hundred untimed requests first: its one-time costs (the
    exporter's first connection, the allocator's first arenas, the interpreter's specializing) are
    a server's first minute, not a cost per request. Measured: a `--quick` child's first round cost
    ~1.5-2x its later ones."""
    warm = argparse.Namespace(**{**vars(args), "steps": 4 * args.life})
    for telemetry in live.values():
        measure_on(warm, no_model, telemetry)
        telemetry.flush(120)


def run_rounds(args, live: dict, no_model, model) -> tuple[dict, dict]:
    """Per round: tracing off with no model (the stamps' baseline); per path, its stamps alone (the
    builder paused, no model), then a pair of runs with the model, tracing off and on, the order
    alternated round by round (ABBA...: a drift of the machine's load over the rounds cancels). An
    on run's window for the child and shipper figures: from a flush before it to the flush after."""
    capacity = 4 * args.steps * args.batch
    off: dict = {"null": [], "with_model": {path: [] for path in live}}
    on: dict = {path: {"stamps": [], "with_model": [], "windows": []} for path in live}
    for round_index in range(args.rounds):
        off["null"].append(measure_off(args, no_model))
        for path, telemetry in live.items():
            paused = paused_telemetry(capacity, "thread" if path == "thread" else "process")
            on[path]["stamps"].append(measure_on(args, no_model, paused))
            paused.shutdown()
            for tracing in (False, True) if round_index % 2 == 0 else (True, False):
                if not tracing:
                    off["with_model"][path].append(measured(lambda: measure_off(args, model), model))
                    continue
                telemetry.flush(120)  # the last run's backlog is built (and shipped) first
                before = telemetry.stats().as_dict()  # the child's report as of this flush
                run = functools.partial(measure_on, args, model, telemetry)
                on[path]["with_model"].append(measured(run, model, functools.partial(telemetry.flush, 120)))
                on[path]["windows"].append((before, telemetry.stats().as_dict()))
    return off, on


# --- instruction counts (callgrind) ------------------------------------------------------------------


class DiscardExporter(SpanExporter):
    """Encodes nothing more: what it is given is already bytes (fast) or encoded by the caller (SDK)."""

    def export(self, spans) -> SpanExportResult:
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


class EncodingDiscard(DiscardExporter):
    """The fast path's request encoding (resource, scope, the batch's spans), bytes discarded."""

    def __init__(self, encode) -> None:
        self.encode = encode

    def export(self, spans) -> SpanExportResult:
        self.encode(spans)
        return SpanExportResult.SUCCESS


class DiscardMetrics(MetricExporter):
    """Takes each collection and throws it away (OTLP encoding of metrics left out: once a minute)."""

    def export(self, metrics_data, timeout_millis: float = 10_000, **kwargs) -> MetricExportResult:
        return MetricExportResult.SUCCESS

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return True

    def shutdown(self, timeout_millis: float = 30_000, **kwargs) -> None:
        return None


def builder_run(frames: list[bytes], path: str, anchor) -> None:
    """The span-builder child's work on this thread: every frame decoded and built (phases, metrics
    into a metric reader as with the default OTEL_METRICS_EXPORTER=otlp, spans, OTLP bytes), then
    exported (the request encoding; network left out) and the metrics collected once."""
    provider = TracerProvider()
    never = BatchSettings(1 << 20, 1 << 20, 3_600_000)  # the worker stays asleep: force_flush exports here
    if path == "fast":  # as configure(encoded_spans=True): phaselens's own histograms
        processor = CountingBatchSpanProcessor(EncodingDiscard(request_encoder(provider)), never)
        emitter = FastEmitter(provider, [processor])
        scope = InstrumentationScope(names.SERVER_SCOPE)
        reader = HistogramReader(DiscardMetrics(), provider.resource, scope, export_interval_millis=3_600_000)
        owned = [reader]
    else:
        processor = CountingBatchSpanProcessor(EncodingDiscardExporter(), never)
        provider.add_span_processor(processor)
        emitter = SpanEmitter.of_provider(provider)
        reader, owned = PeriodicExportingMetricReader(DiscardMetrics(), export_interval_millis=3_600_000), None
    metrics = GenAiServerMetrics(MeterProvider(metric_readers=[reader]), dict, owned)
    builder = SpanBuilder(emitter, metrics, anchor, provider, False)
    decode = {wire.KIND_REQUEST: wire.decode_request, wire.KIND_STEP: wire.decode_step}
    for kind, fields in wire.split_frames(b"".join(frames))[0]:
        builder.build(decode[kind](fields))
    processor.force_flush()
    reader.collect()


def ship_run(records: list) -> None:
    """The shipper's work on a drain's records, the write to the child left out."""
    kept = retention.Retained()
    packed = wire.pack(records)
    kept.add(packed.data, packed.ends)
    kept.unsent()


def callgrind_child(args) -> None:
    """Runs under callgrind, which dumps the counts of each functools.reduce call (--dump-after):
    1 the loop with tracing off, 2 with phaselens handles (builder paused), 3 the fast builder over
    the records that loop closed, 4 the SDK builder over them, 5 the shipper's packing of them
    (`wire.pack`, kept in a retention, its unsent frames taken, as a drain does before the write)."""
    no_model = ModelStandIn(0)
    paused = paused_telemetry(4 * args.steps * args.batch, "thread")
    shape = (args.batch, args.steps, args.life)
    for open_request, close, observer in (
        (lambda: NULL_REQUEST, lambda req: None, NULL_STEP),
        (lambda: paused.request(dict(SCOPE)), lambda req: req.complete(args.life, FINISH_LENGTH), paused.step_observer),
    ):
        opened = open_requests(open_request, *shape)  # the event loop's part: not counted
        run = functools.partial(run_engine, open_request, close, lambda req: req.token(), observer, *shape, no_model)
        functools.reduce(lambda _, __: run(opened=opened), [0], None)
    paused._closer.expire(force=True)  # a benchmark's look at the records the loop closed
    records = paused._sink._handoffs.take()
    encode = {RequestRecord: wire.encode_request}
    frames = [encode.get(type(r), wire.encode_step)(r) for r in records]
    for path in ("fast", "sdk"):
        functools.reduce(lambda _, __: builder_run(frames, path, paused.anchor), [0], None)
    ship_run(records)  # the packer's buffer grows once, on the first drain: the counted one reuses it
    functools.reduce(lambda _, __: ship_run(records), [0], None)
    requests = sum(isinstance(r, RequestRecord) for r in records)
    print(json.dumps({"requests": requests, "step_records": len(records) - requests}))


def callgrind_counts(args) -> dict:
    """Instructions per unit of work, from one callgrind run of `callgrind_child` (see there)."""
    child_args = ["--steps", str(args.callgrind_steps), "--batch", str(args.batch), "--life", str(args.life)]
    counted = reduce_instructions(__file__, child_args)
    if counted is None:
        return {"skipped": "valgrind is not installed"}
    counts, stdout = counted
    shape = json.loads(stdout.strip().splitlines()[-1])
    if len(counts) != 5:
        return {"skipped": f"expected 5 callgrind dumps, got {len(counts)}"}
    off, on, fast, sdk, ship = counts
    request_steps, requests = args.callgrind_steps * args.batch, shape["requests"]
    return {
        "loop_stamps_instructions_per_request_step": (on - off) / request_steps,  # request opening excluded
        "loop_off_instructions_per_request_step": off / request_steps,
        "builder_instructions_per_request": {"fast": fast / requests, "sdk": sdk / requests},
        "shipper_encode_instructions_per_request": ship / requests,
        "workload": {"steps": args.callgrind_steps, "batch": args.batch, "life": args.life, **shape},
    }


def reduce_instructions(script: str, child_args: list[str]) -> tuple[list[int], str] | None:
    """`python script --callgrind-child *child_args` under callgrind, counting only inside each
    `functools.reduce` call (one dump each): their instruction counts in call order and the child's
    stdout; None without valgrind. PYTHONHASHSEED fixed: dict layouts, hence the counts, the same every run."""
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        return None
    with tempfile.TemporaryDirectory() as folder:
        out = os.path.join(folder, "callgrind.out")
        command = [valgrind, "--tool=callgrind", "--collect-atstart=no", "--toggle-collect=functools_reduce",
                   "--dump-after=functools_reduce", f"--callgrind-out-file={out}", sys.executable, script,
                   "--callgrind-child", *child_args]  # fmt: skip
        env = {**os.environ, "PYTHONHASHSEED": "0"}
        done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=True, env=env)
        dumps = sorted(
            (p for p in os.listdir(folder) if p.startswith("callgrind.out.")), key=lambda p: int(p.rsplit(".", 1)[1])
        )
        return [_total_ir(os.path.join(folder, p)) for p in dumps], done.stdout


def _total_ir(path: str) -> int:
    with open(path) as dump:
        for line in dump:
            if line.startswith(("summary:", "totals:")):
                return int(line.split()[1])
    raise ValueError(f"{path}: no totals")


def targets_met(figures: dict, default: dict) -> dict:
    return {
        "loop": all(f["overhead_ns_per_request_step"] <= 1000 for f in figures.values()),
        "throughput_loss_median": {
            path: f["throughput_loss_pct_median"]["median"] <= 1.0 for path, f in figures.items()
        },
        "builder": default["child_cpu_us_per_request"] <= 100 and default["child_cpu_us_per_span"] <= 20,
        "shipper": default["shipper_cpu_us_per_request"] <= 20,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests B")
    parser.add_argument("--steps", type=int, default=300, help="engine steps S of each timed run")
    parser.add_argument("--life", type=int, default=128, help="decode steps per request L")
    parser.add_argument("--model-step-us", type=float, default=5000.0, help="stand-in model time per step")
    parser.add_argument("--rounds", type=int, default=16, help="rounds: a pair of runs, off and on, per path")
    parser.add_argument("--naive-steps", type=int, default=100)
    parser.add_argument("--paths", default=",".join(PATHS), help="comma list of fast, sdk, thread")
    parser.add_argument("--callgrind", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--callgrind-steps", type=int, default=256, help="engine steps under callgrind")
    parser.add_argument("--callgrind-child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true", help="short run: S=300, 6 rounds")
    args = parser.parse_args()
    if args.callgrind_child:
        callgrind_child(args)
        return 0
    if args.quick:
        args.steps, args.rounds, args.naive_steps = 300, 6, 40
    if args.steps <= args.life:
        parser.error("--steps must exceed --life: no request would finish")
    paths = [p for p in args.paths.split(",") if p]
    no_model, model = ModelStandIn(0), ModelStandIn(args.model_step_us)
    sink, endpoint = start_otlp_sink()
    process_builder_env(endpoint)
    provider, meter_provider, exporter = make_providers()
    live = {path: live_telemetry(path, provider, meter_provider) for path in paths}
    time.sleep(1.0)  # the span-builder processes are up and idle
    warm_up(args, live, no_model)
    off, on = run_rounds(args, live, no_model, model)
    for telemetry in live.values():
        telemetry.flush(120)
    tokens = args.steps * args.batch
    off_ns = min(off["null"])
    figures = {
        path: mode_figures(args, tokens, off_ns, off["with_model"][path], on[path], live[path]) for path in paths
    }
    off_runs = [run for runs in off["with_model"].values() for run in runs]
    for path in paths:
        if path != "thread":
            figures[path].update(child_figures(on[path]["windows"]))
    if "thread" in figures:
        figures["thread"]["builder_us_per_request"] = measure_builder_us(args, 200 if args.quick else 1000)
    naive_per_token = (measure_naive(args, no_model) - measure_off_short(args, no_model)) / (
        args.naive_steps * args.batch
    )
    default = figures.get("fast", {})
    result = {
        "benchmark": "instrumentation_overhead",
        "config": {
            "batch": args.batch,
            "steps": args.steps,
            "decode_steps_per_request": args.life,
            "model_step_us": args.model_step_us,
            "model_stand_in": "sha256 over a buffer (releases the GIL)",
            "rounds": args.rounds,
            "python": platform.python_version(),
            "opentelemetry_sdk": otel_sdk_version,
            "cpus": os.cpu_count(),
            "load_average": os.getloadavg(),
        },
        "default_path": "fast",
        "child_cpu_us_per_request": default.get("child_cpu_us_per_request"),
        "shipper_cpu_us_per_request": default.get("shipper_cpu_us_per_request"),
        "baseline_tracing_off": {
            "loop_ns_per_request_step": off_ns / tokens,
            "steps_per_s_with_model": args.steps / (min(run["wall"] for run in off_runs) / 1e9),
            "step_ms_p50_p99_with_model": min(run["quantiles"] for run in off_runs),
            "samples_ms": {
                "null": [round(v / 1e6, 3) for v in off["null"]],
                "with_model": [round(run["wall"] / 1e6, 3) for run in off_runs],
            },
        },
        "paths": figures,
        "instructions": callgrind_counts(args) if args.callgrind else {"skipped": "--no-callgrind"},
        "naive_span_per_token": {"overhead_ns_per_token": naive_per_token},
        "targets": {
            "overhead_ns_per_request_step_max": 1000,
            "throughput_loss_pct_median_max": 1.0,
            "builder_cpu_us_per_request_max": 100,
            "builder_cpu_us_per_span_max": 20,
            "shipper_cpu_us_per_request_max": 20,
            "met": targets_met(figures, default) if default else None,
        },
        "telemetry": {path: {k: v for k, v in t.stats().as_dict().items() if v} for path, t in live.items()},
        "thread_exported_bytes": exporter.bytes,
    }
    for telemetry in live.values():
        telemetry.shutdown()
    sink.terminate()
    sink.wait()
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
