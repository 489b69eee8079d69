"""Collector ingest benchmark: OTLP/gRPC → `phaselens collector` (own process) → embedded ClickHouse,
and the same payloads through Rotel (`rotel-agent`, docs/collectors.md) in the same run.

Prints one JSON object. Each collector writes into a database of its own; two phases, each with its
own service and scope name (rows are counted by scope: Rotel may lose the service, never the scope):
- flood: pre-encoded ExportTraceServiceRequest payloads posted concurrently as fast as the collector
  acknowledges them: sustained spans/s from the first export to the last row visible, lost and
  duplicate spans, CPU seconds of the collector process per 100k spans (on a shared machine the
  figure to compare: `collector_spans_per_cpu_s` is the rate one core sustains) and of ClickHouse;
- paced: the same payloads sent at the target rate: p50/p99 export→visible when the collector keeps
  up (in the flood phase that latency is only the backlog's queueing).
And, in the same run, the client-side baseline: the spans/s the OTel SDK's own OTLPSpanExporter
(gRPC) can emit from one thread. Rotel runs twice: as docs/collectors.md tells its users to
(`--disable-batching`), and with its default batching, which stores the spans of an export request
that fills or straddles a batch with an empty ServiceName (`mislabelled`). Each span carries 8 attributes (one of them, the response id,
never recurs) and 1 event.

Export→visible of request k: from its send to the first poll where the row count reaches the
cumulative span count of requests acknowledged up to k (the spool keeps acknowledgement order).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc

# The payload generator is shared with the tests (tests/collector_payloads.py), which are not installed.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from phaselens.collectors import schema
from phaselens.collectors.rotel_agent import RotelAgent
from phaselens.common.quantile import quantile
from phaselens.instrumentation import names
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.embedded import EmbeddedClickHouse
from tests.collector_payloads import export_request

EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"
DATABASE = "bench"  # phaselens's; Rotel's are bench_<name>
COLLECTORS = ("phaselens", "rotel", "rotel_batching")
LOAD_SERVICE = "bench-load"
PACED_SERVICE = "bench-paced"
SDK_SERVICE = "bench-sdk"
TARGET_SPANS_PER_S = 50_000


def payloads(count: int, spans_per_request: int, service: str = LOAD_SERVICE) -> list[bytes]:
    """Distinct ids in every request: a template whose trace/span ids and response ids (an
    attribute value that never recurs, as in real traffic) are re-drawn per copy."""
    template = export_request(spans_per_request, time.time_ns(), service=service)
    template.resource_spans[0].scope_spans[0].scope.name = service
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


def start_collector(url: str, spool: str, batch_spans: int) -> tuple[subprocess.Popen, str]:
    """`phaselens collector` in a process of its own; (process, gRPC endpoint)."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "phaselens.commands.collector",
            "--clickhouse",
            url,
            "--database",
            DATABASE,
            "--grpc-port",
            "0",
            "--http-port",
            "0",
            "--spool",
            spool,
            "--batch-spans",
            str(batch_spans),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    line = proc.stdout.readline()
    if not line.startswith("READY collector"):
        proc.kill()
        raise RuntimeError(f"collector did not start: {line!r}")
    grpc_endpoint = line.split("grpc=")[1].split()[0]
    return proc, grpc_endpoint


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def send_all(
    endpoint: str, bodies: list[bytes], concurrency: int, deadline: float, interval_s: float = 0.0
) -> tuple[list, int]:
    """Returns [(send_time, ack_time, spans)] in acknowledgement order, and the retry count.
    `interval_s` > 0 paces the sends: request k leaves at start + k * interval_s."""
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

    start = time.monotonic()
    for k, body in enumerate(bodies):
        if interval_s:
            time.sleep(max(0.0, start + k * interval_s - time.monotonic()))
        slots.acquire()
        send(body, time.monotonic())
    for _ in range(concurrency):
        slots.acquire()
    channel.close()
    return acks, retries[0]


def poll_counts(client, database: str, scope: str, total: int, deadline: float, samples: list) -> None:
    while time.monotonic() < deadline:
        n = client.command(f"SELECT count() FROM {database}.otel_traces WHERE ScopeName = '{scope}'")
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
        with tracer.start_as_current_span(
            names.SPAN_DECODE,
            attributes={
                names.GEN_AI_REQUEST_MODEL: "tiny",
                names.GEN_AI_USAGE_OUTPUT_TOKENS: i,
                names.GEN_AI_REQUEST_TEMPERATURE: 0.7,
                names.GEN_AI_REQUEST_STREAM: True,
            },
        ) as span:
            span.add_event(names.EVENT_FIRST_CHUNK, {"index": i})
    exporter = OTLPSpanExporter(endpoint=endpoint, insecure=True)
    start = time.perf_counter()
    for i in range(0, spans, 512):
        exporter.export(keep.spans[i : i + 512])
    rate = spans / (time.perf_counter() - start)
    exporter.shutdown()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short run (200k spans flood, 3 s paced)")
    parser.add_argument("--spans", type=int, default=None, help="spans in the flood phase (1M)")
    parser.add_argument("--paced-s", type=float, default=None, help="seconds of the paced phase (10)")
    parser.add_argument("--spans-per-request", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--batch-spans", type=int, default=50_000, help="the collector's --batch-spans")
    parser.add_argument("--timeout-s", type=float, default=300)
    parser.add_argument(
        "--collectors", type=lambda text: text.split(","), default=list(COLLECTORS), help=f"of {','.join(COLLECTORS)}"
    )
    args = parser.parse_args()
    if not set(args.collectors) <= set(COLLECTORS):
        parser.error(f"--collectors: choose from {','.join(COLLECTORS)}")
    total = args.spans or (200_000 if args.quick else 1_000_000)
    paced_s = args.paced_s if args.paced_s is not None else (3 if args.quick else 10)
    flood = payloads(total // args.spans_per_request, args.spans_per_request)
    paced = payloads(
        round(paced_s * TARGET_SPANS_PER_S / args.spans_per_request), args.spans_per_request, PACED_SERVICE
    )
    with (
        tempfile.TemporaryDirectory(prefix="phaselens-bench-") as tmp,
        EmbeddedClickHouse(f"{tmp}/clickhouse") as clickhouse,
    ):
        client = connect(clickhouse.url)
        results, sdk_rate = {}, 0.0
        for name in args.collectors:
            database = DATABASE if name == "phaselens" else f"{DATABASE}_{name}"
            schema.apply(client, schema.statements(database))
            with running(name, clickhouse.url, database, tmp, args) as (pid, endpoint):
                pids = {"collector": pid, "clickhouse": clickhouse.pid}
                phase = functools.partial(run_phase, args, endpoint, client, database, pids=pids)
                results[name] = {
                    "flood": phase(flood, LOAD_SERVICE),
                    "paced": phase(paced, PACED_SERVICE, interval_s=args.spans_per_request / TARGET_SPANS_PER_S),
                }
                if name == "phaselens":
                    sdk_rate = sdk_exporter_rate(endpoint, 5_000 if args.quick else 20_000)
        client.close()
    print(json.dumps(report(args, results, sdk_rate)))


@contextlib.contextmanager
def running(name: str, url: str, database: str, tmp: str, args) -> Iterator[tuple[int, str]]:
    """The collector `name` of COLLECTORS, started; (its pid, its OTLP/gRPC endpoint)."""
    if name == "phaselens":
        proc, endpoint = start_collector(url, f"{tmp}/spool", args.batch_spans)
        try:
            yield proc.pid, endpoint
        finally:
            proc.terminate()
            proc.wait(60)
        return
    rotel = RotelAgent(url, database, f"{tmp}/{name}.log", batching=name == "rotel_batching").start_serving()
    try:
        yield rotel.pid, rotel.grpc_endpoint
    finally:
        rotel.stop(60)


def run_phase(args, endpoint, client, database: str, bodies, service: str, pids: dict, interval_s: float = 0.0) -> dict:
    """Sends `bodies`, waits until all their rows are visible; figures of that phase. Rows are
    counted by scope (the payloads' scope name is the service's): `mislabelled` rows have another
    ServiceName."""
    total = len(bodies) * args.spans_per_request
    deadline = time.monotonic() + args.timeout_s
    cpu_before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    samples: list = []
    poller = threading.Thread(target=poll_counts, args=(client, database, service, total, deadline, samples))
    start = time.monotonic()
    poller.start()
    acks, retries = send_all(endpoint, bodies, args.concurrency, deadline, interval_s)
    sent_s = time.monotonic() - start
    poller.join()
    visible_at = samples[-1][0] if samples and samples[-1][1] >= total else None
    latencies, cumulative, k = [], 0, 0
    for sent, _, _ in acks:
        cumulative += args.spans_per_request
        while k < len(samples) and samples[k][1] < cumulative:
            k += 1
        if k < len(samples):
            latencies.append(samples[k][0] - sent)
    count, unique, mislabelled = client.query(
        f"SELECT count(), uniqExact(SpanId), countIf(ServiceName != '{service}') FROM {database}.otel_traces "
        f"WHERE ScopeName = '{service}'"
    ).result_rows[0]
    latencies.sort()
    return {
        "spans": total,
        "spans_per_s": round(total / (visible_at - start)) if visible_at else None,
        "acknowledged_spans_per_s": round(total / sent_s),
        "lost": total - int(unique),
        "duplicates": int(count) - int(unique),
        "mislabelled": int(mislabelled),
        "client_retries": retries,
        "p50_ms": round(quantile(latencies, 0.50) * 1000, 1),
        "p99_ms": round(quantile(latencies, 0.99) * 1000, 1),
        "cpu_s": {name: cpu_seconds(pid) - cpu_before[name] for name, pid in pids.items()},
    }


def report(args, results: dict, sdk_rate: float) -> dict:
    """phaselens's figures at the top level (as before), each collector's in `collectors`."""
    out = {
        "benchmark": "collector_ingest",
        "spans": results[args.collectors[0]]["flood"]["spans"],
        "spans_per_request": args.spans_per_request,
        "concurrency": args.concurrency,
        "batch_spans": args.batch_spans,
        "collectors": {name: summary(phases["flood"], phases["paced"]) for name, phases in results.items()},
        "paced_offered_spans_per_s": TARGET_SPANS_PER_S,
        "load_average_1m": round(os.getloadavg()[0], 2),
        "baseline_sdk_exporter_spans_per_s": round(sdk_rate) if sdk_rate else None,
        "target_spans_per_s": TARGET_SPANS_PER_S,
    }
    return out | out["collectors"].get("phaselens", {})


def summary(flood: dict, paced: dict) -> dict:
    cpu = flood["cpu_s"]["collector"]
    return {
        "sustained_spans_per_s": flood["spans_per_s"],
        "acknowledged_spans_per_s": flood["acknowledged_spans_per_s"],
        "flood_export_to_visible_p50_ms": flood["p50_ms"],
        "flood_export_to_visible_p99_ms": flood["p99_ms"],
        "lost": flood["lost"] + paced["lost"],
        "duplicates": flood["duplicates"] + paced["duplicates"],
        "mislabelled": flood["mislabelled"] + paced["mislabelled"],
        "client_retries": flood["client_retries"] + paced["client_retries"],
        "collector_cpu_s_per_100k_spans": round(cpu / flood["spans"] * 100_000, 3),
        "collector_spans_per_cpu_s": round(flood["spans"] / cpu) if cpu else None,
        "clickhouse_cpu_s_per_100k_spans": round(flood["cpu_s"]["clickhouse"] / flood["spans"] * 100_000, 3),
        "paced_export_to_visible_p50_ms": paced["p50_ms"],
        "paced_export_to_visible_p99_ms": paced["p99_ms"],
    }


if __name__ == "__main__":
    main()
