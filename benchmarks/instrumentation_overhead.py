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
- process: the same handles, records shipped to the span-builder process, which builds the same
           spans and exports them with the real OTLP/HTTP exporter to a loopback sink process
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
process (encoding and writing, under its GIL). Targets: ≤ 1 µs per request per step, ≤ 1 % loss at B = 64.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time

from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.version import __version__ as otel_sdk_version

from phaselens.common.quantile import quantile
from phaselens.instrumentation.hotpath.observer import FINISH_LENGTH, NULL_REQUEST, NULL_STEP, NullRequest
from phaselens.instrumentation.hotpath.records import StepStats
from phaselens.instrumentation.pipeline.otel_setup import add_counting_processor
from phaselens.instrumentation.server.telemetry import ServerTelemetry

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

    def step(self) -> None:
        if self.length:
            hashlib.sha256(self.buffer).digest()
            self.stamps.append(time.perf_counter_ns())

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


def run_engine(
    open_request, close, per_token, step_observer, batch: int, steps: int, life: int, model: ModelStandIn
) -> int:
    """The null engine; returns loop-thread ns for `steps` steps (request opening excluded)."""
    live = [[open_request(), 0] for _ in range(batch)]
    spare = [open_request() for _ in range(steps * batch // life + batch)]
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
    """The span-builder process exports real OTLP/HTTP (protobuf) to the sink; no metric export."""
    os.environ.update(
        {
            "OTEL_TRACES_EXPORTER": "otlp",
            "OTEL_METRICS_EXPORTER": "none",
            "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf",
            "OTEL_EXPORTER_OTLP_ENDPOINT": endpoint,
        }
    )


def timed(run) -> int:
    started = time.perf_counter_ns()
    run()
    return time.perf_counter_ns() - started


def mode_figures(
    args,
    tokens: int,
    off_ns: int,
    off_model: list[int],
    stamps: list[int],
    model_runs: list[int],
    quantiles: list,
    telemetry: ServerTelemetry,
) -> dict:
    per_step_ns = (min(stamps) - off_ns) / tokens
    return {
        "loop_ns_per_request_step": min(stamps) / tokens,
        "overhead_ns_per_request_step": per_step_ns,
        "overhead_ns_per_request_total": per_step_ns * args.life,
        "event_loop_us_per_request_open": measure_open_request_ns(telemetry, 500) / 1000,
        "steps_per_s_with_model": args.steps / (min(model_runs) / 1e9),
        "step_ms_p50_p99_with_model": min(quantiles),
        "throughput_loss_pct": 100 * (1 - min(off_model) / min(model_runs)),
        "throughput_loss_pct_median": 100 * (1 - statistics.median(off_model) / statistics.median(model_runs)),
        "throughput_loss_pct_stamps_only": 100 * per_step_ns * args.batch / (args.model_step_us * 1000),
        "samples_ms": {
            "stamps_null": [round(v / 1e6, 3) for v in stamps],
            "with_model": [round(v / 1e6, 3) for v in model_runs],
        },
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=64, help="concurrent requests B")
    parser.add_argument("--steps", type=int, default=2000, help="engine steps S")
    parser.add_argument("--life", type=int, default=128, help="decode steps per request L")
    parser.add_argument("--model-step-us", type=float, default=5000.0, help="stand-in model time per step")
    parser.add_argument("--rounds", type=int, default=3, help="off/thread/process rounds, interleaved; min taken")
    parser.add_argument("--naive-steps", type=int, default=100)
    parser.add_argument("--quick", action="store_true", help="short run: S=300, 2 rounds")
    args = parser.parse_args()
    if args.quick:
        args.steps, args.rounds, args.naive_steps = 300, 2, 40
    no_model, model = ModelStandIn(0), ModelStandIn(args.model_step_us)
    sink, endpoint = start_otlp_sink()
    process_builder_env(endpoint)
    provider, meter_provider, exporter = make_providers()
    live = {
        "thread": ServerTelemetry(provider, meter_provider),
        "process": ServerTelemetry(provider, meter_provider, builder="process"),
    }
    capacity = 4 * args.steps * args.batch
    off_null, off_model, off_quantiles = [], [], []
    stamps, model_runs, quantiles = ({mode: [] for mode in live} for _ in range(3))
    time.sleep(1.0)  # the span-builder process is up and idle
    live["process"].flush(30)
    child_before = live["process"].stats().as_dict()
    for _ in range(args.rounds):
        off_null.append(measure_off(args, no_model))
        off_model.append(timed(lambda: measure_off(args, model)))
        off_quantiles.append(model.take_step_quantiles_ms())
        for mode, telemetry in live.items():
            paused = paused_telemetry(capacity, mode)
            stamps[mode].append(measure_on(args, no_model, paused))
            paused.shutdown()
            model_runs[mode].append(timed(lambda: measure_on(args, model, telemetry)))
            quantiles[mode].append(model.take_step_quantiles_ms())
            telemetry.flush(120)  # its backlog is built before the next loop is timed
    for telemetry in live.values():
        telemetry.flush(120)
    child_after = live["process"].stats().as_dict()
    tokens = args.steps * args.batch
    off_ns = min(off_null)
    figures = {
        mode: mode_figures(args, tokens, off_ns, off_model, stamps[mode], model_runs[mode], quantiles[mode], telemetry)
        for mode, telemetry in live.items()
    }
    figures["thread"]["builder_us_per_request"] = measure_builder_us(args, 200 if args.quick else 1000)
    requests = child_after["requests_offered"] - child_before["requests_offered"]
    for key in ("child_cpu_ns", "shipper_cpu_ns"):  # the child's build + export; this process's shipping
        figures["process"][key.replace("_ns", "_us_per_request")] = (
            (child_after[key] - child_before[key]) / requests / 1000
        )
    naive_per_token = (measure_naive(args, no_model) - measure_off_short(args, no_model)) / (
        args.naive_steps * args.batch
    )
    met = {
        mode: f["overhead_ns_per_request_step"] <= 1000 and f["throughput_loss_pct"] <= 1.0
        for mode, f in figures.items()
    }
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
        },
        "baseline_tracing_off": {
            "loop_ns_per_request_step": off_ns / tokens,
            "steps_per_s_with_model": args.steps / (min(off_model) / 1e9),
            "step_ms_p50_p99_with_model": min(off_quantiles),
            "samples_ms": {
                "null": [round(v / 1e6, 3) for v in off_null],
                "with_model": [round(v / 1e6, 3) for v in off_model],
            },
        },
        "phaselens_thread_builder": figures["thread"],
        "phaselens_process_builder": figures["process"],
        "naive_span_per_token": {"overhead_ns_per_token": naive_per_token},
        "targets": {"overhead_ns_per_request_step_max": 1000, "throughput_loss_pct_max": 1.0, "met": met},
        "telemetry": {
            mode: {k: v for k, v in telemetry.stats().as_dict().items() if v} for mode, telemetry in live.items()
        },
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
