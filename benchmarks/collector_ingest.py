"""Collector ingest benchmark: OTLP/gRPC → `phaselens collector` (own process) → embedded ClickHouse.

Prints one JSON object: sustained spans/s from the first export to the last row visible, p50/p99
export→visible latency, lost and duplicate spans, CPU seconds of the collector process per 100k
spans (on a shared machine the figure to compare: `collector_spans_per_cpu_s` is the rate one core
sustains) and of the ClickHouse server, and, in the same run, the client-side baseline: the spans/s
the OTel SDK's own OTLPSpanExporter (gRPC) can emit from one thread. The load itself uses
pre-encoded ExportTraceServiceRequest payloads posted concurrently so that the client is not the
limit; each span carries 8 attributes (one of them, the response id, never recurs) and 1 event.

Export→visible of request k: from its send to the first poll where the row count reaches the
cumulative span count of requests acknowledged up to k (the spool keeps acknowledgement order).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.collector_payloads import export_request  # noqa: E402
from instrumentation import names  # noqa: E402
from instrumentation.client import quantile  # noqa: E402
from collectors import schema  # noqa: E402
from collectors.clickhouse_url import connect  # noqa: E402
from collectors.embedded import EmbeddedClickHouse  # noqa: E402

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
DATABASE = "bench"
LOAD_SERVICE = "bench-load"
SDK_SERVICE = "bench-sdk"


def payloads(count: int, spans_per_request: int) -> list[bytes]:
    """Distinct ids in every request: a template whose trace/span ids and response ids (an
    attribute value that never recurs, as in real traffic) are re-drawn per copy."""
    template = export_request(spans_per_request, time.time_ns(), service=LOAD_SERVICE)
    spans = template.resource_spans[0].scope_spans[0].spans
    response_ids = [next(kv for kv in span.attributes if kv.key == names.GEN_AI_RESPONSE_ID) for span in spans]
    out = []
    for copy in range(count):
        for i, span in enumerate(spans):
            if i % 4 == 0:
                trace_id, root = os.urandom(16), os.urandom(8)
            span.trace_id = trace_id
            span.span_id = root if i % 4 == 0 else os.urandom(8)
            if i % 4:
                span.parent_span_id = root
            response_ids[i].value.string_value = f"cmpl-{copy}-{i}"
        out.append(template.SerializeToString())
    return out


def start_collector(url: str, spool: str) -> tuple[subprocess.Popen, str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "phaselens.commands.collector", "--clickhouse", url, "--database", DATABASE,
         "--grpc-port", "0", "--http-port", "0", "--spool", spool],
        cwd=ROOT, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if not line.startswith("READY collector"):
        proc.kill()
        raise RuntimeError(f"collector did not start: {line!r}")
    grpc_endpoint = line.split("grpc=")[1].split()[0]
    return proc, grpc_endpoint


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def send_all(endpoint: str, bodies: list[bytes], concurrency: int, deadline: float) -> tuple[list, int]:
    """Returns [(send_time, ack_time, spans)] in acknowledgement order, and the retry count."""
    channel = grpc.insecure_channel(endpoint, options=[("grpc.max_send_message_length", 64 << 20)])
    export = channel.unary_unary(EXPORT)
    acks, retries, lock = [], [0], threading.Lock()
    slots = threading.Semaphore(concurrency)

    def send(body: bytes, sent: float) -> None:
        future = export.future(body, timeout=30)

        def done(f) -> None:
            if f.exception() is not None and time.monotonic() < deadline:
                with lock:
                    retries[0] += 1
                time.sleep(0.05)
                send(body, sent)
                return
            with lock:
                acks.append((sent, time.monotonic(), body))
            slots.release()

        future.add_done_callback(done)

    for body in bodies:
        slots.acquire()
        send(body, time.monotonic())
    for _ in range(concurrency):
        slots.acquire()
    channel.close()
    return acks, retries[0]


def poll_counts(client, total: int, deadline: float, samples: list) -> None:
    while time.monotonic() < deadline:
        n = client.command(f"SELECT count() FROM {DATABASE}.otel_traces WHERE ServiceName = '{LOAD_SERVICE}'")
        samples.append((time.monotonic(), int(n)))
        if int(n) >= total:
            return
        time.sleep(0.05)


def sdk_exporter_rate(endpoint: str, spans: int) -> float:
    """Spans/s one OTel SDK OTLPSpanExporter (gRPC) sends from one thread: the client-side limit."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

    class Keep(SpanExporter):
        def __init__(self):
            self.spans = []

        def export(self, batch):
            self.spans.extend(batch)
            return SpanExportResult.SUCCESS

    keep = Keep()
    provider = TracerProvider(resource=Resource.create({"service.name": SDK_SERVICE}))
    provider.add_span_processor(SimpleSpanProcessor(keep))
    tracer = provider.get_tracer("bench")
    for i in range(spans):
        with tracer.start_as_current_span(names.SPAN_DECODE, attributes={
                names.GEN_AI_REQUEST_MODEL: "tiny", names.GEN_AI_USAGE_OUTPUT_TOKENS: i,
                names.GEN_AI_REQUEST_TEMPERATURE: 0.7, names.GEN_AI_REQUEST_STREAM: True}) as span:
            span.add_event(names.EVENT_FIRST_CHUNK, {"index": i})
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    start = time.perf_counter()
    for i in range(0, spans, 512):
        exporter.export(keep.spans[i:i + 512])
    rate = spans / (time.perf_counter() - start)
    exporter.shutdown()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (200k spans)")
    parser.add_argument("--spans", type=int, default=None)
    parser.add_argument("--spans-per-request", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=300)
    args = parser.parse_args()
    total = args.spans or (200_000 if args.quick else 1_000_000)
    requests = total // args.spans_per_request
    total = requests * args.spans_per_request
    bodies = payloads(requests, args.spans_per_request)
    with tempfile.TemporaryDirectory(prefix="phaselens-bench-") as tmp, \
            EmbeddedClickHouse(f"{tmp}/clickhouse") as clickhouse:
        client = connect(clickhouse.url)
        schema.apply(client, schema.statements(DATABASE))
        proc, endpoint = start_collector(clickhouse.url, f"{tmp}/spool")
        try:
            result = run(args, proc, endpoint, client, bodies, total, clickhouse.pid)
        finally:
            proc.terminate()
            proc.wait(60)
        client.close()
    print(json.dumps(result))


def run(args, proc, endpoint, client, bodies, total, clickhouse_pid: int) -> dict:
    deadline = time.monotonic() + args.timeout_s
    cpu_before, ch_cpu_before = cpu_seconds(proc.pid), cpu_seconds(clickhouse_pid)
    samples: list = []
    poller = threading.Thread(target=poll_counts, args=(client, total, deadline, samples))
    start = time.monotonic()
    poller.start()
    acks, retries = send_all(endpoint, bodies, args.concurrency, deadline)
    sent_s = time.monotonic() - start
    poller.join()
    cpu = cpu_seconds(proc.pid) - cpu_before
    ch_cpu = cpu_seconds(clickhouse_pid) - ch_cpu_before
    visible_at = samples[-1][0] if samples and samples[-1][1] >= total else None
    latencies, cumulative, k = [], 0, 0
    for sent, _, _ in acks:
        cumulative += args.spans_per_request
        while k < len(samples) and samples[k][1] < cumulative:
            k += 1
        if k < len(samples):
            latencies.append(samples[k][0] - sent)
    stats = client.query(f"SELECT count(), uniqExact(SpanId) FROM {DATABASE}.otel_traces "
                         f"WHERE ServiceName = '{LOAD_SERVICE}'").result_rows[0]
    sdk_rate = sdk_exporter_rate(endpoint, 5_000 if args.quick else 20_000)
    return {
        "benchmark": "collector_ingest",
        "spans": total,
        "spans_per_request": args.spans_per_request,
        "concurrency": args.concurrency,
        "sustained_spans_per_s": round(total / (visible_at - start)) if visible_at else None,
        "acknowledged_spans_per_s": round(total / sent_s),
        "export_to_visible_p50_ms": round(quantile(sorted(latencies), 0.50) * 1000, 1),
        "export_to_visible_p99_ms": round(quantile(sorted(latencies), 0.99) * 1000, 1),
        "lost": total - int(stats[1]),
        "duplicates": int(stats[0]) - int(stats[1]),
        "client_retries": retries,
        "collector_cpu_s_per_100k_spans": round(cpu / total * 100_000, 3),
        "collector_spans_per_cpu_s": round(total / cpu) if cpu else None,
        "clickhouse_cpu_s_per_100k_spans": round(ch_cpu / total * 100_000, 3),
        "load_average_1m": round(os.getloadavg()[0], 2),
        "baseline_sdk_exporter_spans_per_s": round(sdk_rate),
        "target_spans_per_s": 50_000,
    }


if __name__ == "__main__":
    main()
