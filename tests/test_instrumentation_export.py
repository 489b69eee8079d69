"""otel_setup from the OTEL_* environment, and a dead collector that must not touch the loop."""

from __future__ import annotations

import contextlib
import time

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter as GrpcSpanExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import ConsoleSpanExporter, SpanExporter, SpanExportResult

from phaselens.instrumentation import names
from phaselens.instrumentation.hotpath.records import RequestInfo
from phaselens.instrumentation.pipeline.otel_setup import configure
from phaselens.instrumentation.pipeline.span_processor import BatchSettings, CountingBatchSpanProcessor
from phaselens.instrumentation.server.telemetry import ServerTelemetry
from tests.dead_collectors import closed_port, silent_port

OTEL_VARS = (
    "OTEL_TRACES_EXPORTER",
    "OTEL_METRICS_EXPORTER",
    "OTEL_EXPORTER_OTLP_PROTOCOL",
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL",
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


@pytest.fixture()
def env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("OTEL_METRICS_EXPORTER", "none")
    return monkeypatch


def exporters_of(providers):
    processors = providers.tracer_provider._active_span_processor._span_processors
    return [type(p.exporter) for p in processors]


@pytest.mark.parametrize(
    "exporter, protocol, expected",
    [
        ("otlp", None, [HttpSpanExporter]),  # the specification's default protocol
        ("otlp", "grpc", [GrpcSpanExporter]),
        ("otlp,console", "http/protobuf", [HttpSpanExporter, ConsoleSpanExporter]),
        ("none", None, []),
    ],
)
def test_exporters_follow_the_environment(env, exporter, protocol, expected):
    env.setenv("OTEL_TRACES_EXPORTER", exporter)
    if protocol:
        env.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", protocol)
    providers = configure("svc", set_global=False)
    assert exporters_of(providers) == expected
    providers.shutdown()


@pytest.mark.parametrize(
    "variable, value", [("OTEL_EXPORTER_OTLP_PROTOCOL", "carrier-pigeon"), ("OTEL_TRACES_EXPORTER", "zipkinish")]
)
def test_bad_settings_are_clear_errors(env, variable, value):
    env.setenv(variable, value)
    with pytest.raises(ValueError, match=variable.split("_")[1] if "PROTOCOL" not in variable else "PROTOCOL"):
        configure("svc", set_global=False)


def test_service_name_and_sampler_from_environment(env):
    env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert configure("fallback", set_global=False).tracer_provider.resource.attributes["service.name"] == "fallback"
    env.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=test,service.name=from-attrs")
    resource = configure("fallback", set_global=False).tracer_provider.resource
    assert resource.attributes["service.name"] == "from-attrs"
    assert resource.attributes["deployment.environment"] == "test"
    env.setenv("OTEL_SERVICE_NAME", "from-env")
    env.setenv("OTEL_TRACES_SAMPLER", "parentbased_traceidratio")
    env.setenv("OTEL_TRACES_SAMPLER_ARG", "0.25")
    provider = configure("fallback", set_global=False).tracer_provider
    assert provider.resource.attributes["service.name"] == "from-env"
    assert "0.25" in provider.sampler.get_description()


def serve_100_ns(telemetry: ServerTelemetry) -> int:
    """Nanoseconds the serving loop spends on 100 requests' telemetry (21 tokens each)."""
    loop_ns = 0
    for index in range(100):
        req = telemetry.request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": []})
        started = time.perf_counter_ns()
        req.describe(RequestInfo(operation=names.OP_TEXT_COMPLETION, model="tiny", request_id=f"r{index}"))
        req.enqueued()
        req.scheduled()
        req.first_token()
        for _ in range(20):
            req.token()
        req.finished("length")
        loop_ns += time.perf_counter_ns() - started
        req.complete(output_tokens=21, finish_reason="length")
        time.sleep(0.001)
    return loop_ns


def dead_collector(kind: str) -> contextlib.AbstractContextManager[int]:
    return contextlib.nullcontext(closed_port()) if kind == "refusing" else silent_port()


@pytest.mark.parametrize("collector", ["refusing", "hung"])
@pytest.mark.parametrize("builder", ["thread", "process"])
def test_unreachable_collector_does_not_slow_the_loop_and_losses_are_counted(env, builder, collector):
    env.setenv(names.ENV_SPAN_BUILDER, builder)
    env.setenv("OTEL_TRACES_EXPORTER", "none")
    baseline = ServerTelemetry.from_env("no-exporter")
    baseline_ns = serve_100_ns(baseline)  # the same loop on this machine now, nothing to wait for
    baseline.shutdown()
    with dead_collector(collector) as port:
        env.setenv("OTEL_TRACES_EXPORTER", "otlp")
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_EXPORTER_OTLP_TIMEOUT", "0.5")
        env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "64")
        env.setenv("OTEL_BSP_MAX_EXPORT_BATCH_SIZE", "64")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "20")
        telemetry = ServerTelemetry.from_env("dead-collector")
        loop_ns = serve_100_ns(telemetry)
        # a loop that waited on the exporter would wait up to its 0.5 s timeout each time the 64-span
        # queue filled (every ~9 requests of 7 spans): seconds, past the bound however loaded the machine
        assert loop_ns < max(0.25e9, 4 * baseline_ns), (loop_ns, baseline_ns)
        assert telemetry.flush(20)  # the span-builder child exports its full batches itself: ~11 × 0.5 s
        telemetry.shutdown()
    stats = telemetry.stats()
    assert stats.spans_built == 100 * 7 and stats.export_exported == 0
    assert stats.export_failed + stats.export_dropped == stats.spans_built
    assert stats.spans_dropped >= stats.spans_built
    if collector == "hung":
        # each export waits its whole 0.5 s, and ~19 requests' spans fill the queue and the batch
        # behind it (~30 ms quiet, ~0.1 s on a loaded machine): the 64-span queue must overflow; a refused
        # connection fails at once, so how many it drops depends on the race with the builder
        assert stats.export_dropped > 0


class FlakyExporter(SpanExporter):
    """Raises on every other batch: a bug in an exporter must cost spans, never the worker."""

    def __init__(self) -> None:
        self.calls = 0

    def export(self, spans):
        self.calls += 1
        if self.calls % 2:
            raise RuntimeError("exporter bug")
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def test_processor_accounts_for_every_span(env):
    processor = CountingBatchSpanProcessor(
        FlakyExporter(), BatchSettings(max_queue_size=10, max_export_batch_size=5, schedule_delay_ms=3_600_000)
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    for _ in range(25):  # the worker sleeps: 10 queue, 15 are refused
        tracer.start_span("s").end()
    assert processor.counts.dropped == 15
    provider.shutdown()
    counts = processor.counts
    assert (counts.exported, counts.failed, counts.dropped) == (5, 5, 15)


def test_a_full_batch_can_be_exported_by_the_thread_that_filled_it(env):
    """`full_batch_on_caller` (the span-builder process): the batch goes out inside the offer that
    filled it, on that thread, counted as the worker would; a partial batch, and what is left over
    a full one, waits for the next full batch or a flush."""
    import threading

    seen = []

    class ThreadNoting(FlakyExporter):
        def export(self, spans):
            seen.append((threading.get_ident(), len(spans)))
            return super().export(spans)

    processor = CountingBatchSpanProcessor(
        ThreadNoting(), BatchSettings(max_queue_size=10, max_export_batch_size=3, schedule_delay_ms=3_600_000)
    )
    processor.full_batch_on_caller = True
    processor.offer([b"a", b"b"])
    assert seen == [] and processor.counts.queued == 2
    processor.offer([b"c", b"d"])  # full: this thread exports the full batch; "d" waits
    assert seen == [(threading.get_ident(), 3)] and processor.counts.settled == 3
    processor.offer([b"e", b"f", b"g", b"h", b"i"])  # 6 held: two full batches, none left
    assert [n for _, n in seen] == [3, 3, 3] and processor.counts.settled == 9
    processor.offer([b"j"])
    processor.force_flush()  # a checkpoint: the rest, whatever its size
    assert [n for _, n in seen] == [3, 3, 3, 1]
    counts = processor.counts
    assert (counts.settled, counts.dropped, counts.exported + counts.failed) == (10, 0, 10)
    processor.shutdown()


def test_bad_batch_setting_is_a_clear_error(env):
    env.setenv("OTEL_BSP_MAX_QUEUE_SIZE", "lots")
    with pytest.raises(ValueError, match="OTEL_BSP_MAX_QUEUE_SIZE"):
        BatchSettings.from_env()


class SelfTracingExporter(SpanExporter):
    """An exporter whose HTTP client is instrumented without checking suppression: each export makes
    a span through the same provider. It also notes whether instrumentation was suppressed."""

    def __init__(self) -> None:
        self.tracer = None
        self.names: list[str] = []
        self.suppressed: list[bool] = []

    def export(self, spans):
        from opentelemetry.context import _SUPPRESS_INSTRUMENTATION_KEY, get_value

        self.names.extend(span.name for span in spans)
        self.suppressed.append(bool(get_value(_SUPPRESS_INSTRUMENTATION_KEY)))
        if len(self.suppressed) < 10:  # a processor that feeds itself fails the test instead of looping
            self.tracer.start_span("POST /v1/traces").end()
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        return None


def test_export_runs_suppressed_and_never_feeds_itself(env):
    exporter = SelfTracingExporter()
    processor = CountingBatchSpanProcessor(
        exporter, BatchSettings(max_queue_size=10, max_export_batch_size=10, schedule_delay_ms=3_600_000)
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    exporter.tracer = provider.get_tracer("t")
    for name in ("a", "b"):
        exporter.tracer.start_span(name).end()
    for _ in range(3):  # a span queued by an export would be exported by the next flush
        provider.force_flush()
    assert exporter.names == ["a", "b"] and exporter.suppressed == [True]
    counts = processor.counts
    assert (counts.exported, counts.suppressed, counts.dropped) == (2, 1, 0)
    provider.shutdown()


def test_a_forked_child_exports_on_its_own_thread(env):
    import os

    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    processor = CountingBatchSpanProcessor(
        exporter, BatchSettings(max_queue_size=10, max_export_batch_size=1, schedule_delay_ms=3_600_000)
    )
    provider = TracerProvider()
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("t")
    tracer.start_span("parent").end()
    provider.force_flush()
    pid = os.fork()
    if pid == 0:  # the child: no force_flush, only its own export thread can deliver the span
        tracer.start_span("child").end()
        deadline = time.monotonic() + 5
        while processor.counts.exported < 1 and time.monotonic() < deadline:
            time.sleep(0.01)
        names = [s.name for s in exporter.get_finished_spans()]
        os._exit(0 if processor.counts.exported == 1 and names[-1:] == ["child"] else 1)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
    assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0
    assert processor.counts.exported == 1  # the parent's count is its own
    provider.shutdown()
