"""SGLang's disaggregated prefill and decode spans → the P/D columns of `phaselens_requests`. Spans are
built as SGLang 0.5.23 builds them (tests/native_pd_spans.py), the prefill instance's clock an hour
behind, the decode instance's an hour ahead, exported over OTLP/gRPC to the real collector and written
to the real embedded ClickHouse; every column must give back the duration put in, on its own clock."""

from __future__ import annotations

import time
from collections.abc import Mapping

import pytest
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from phaselens.analysis.budget.pd_budget import pd_budget
from phaselens.analysis.schema.pd_schema import PD_COLUMN_NAMES
from phaselens.collectors.service import Collector
from phaselens.common.process import LOOPBACK
from phaselens.instrumentation import names as n
from tests.analysis_fixtures import client, new_database
from tests.native_pd_spans import (
    SglangPdRequest,
    SglangPdSide,
    VllmPdSide,
    decode_instance,
    prefill_instance,
    vllm_instance,
)
from tests.native_spans import MS, SglangRequest, SixtyFourBitIds, client_span, provider, sglang_request

__all__ = ["client"]

HOUR_NS = 3600 * 10**9
DECODE_INSTANCE = "http://decode-0:30000"  # set through OTEL_RESOURCE_ATTRIBUTES on the decode instance
REQUESTS = [
    SglangPdRequest(
        "5e1d2c3b4a5968778695a4b3c2d1e0f1",
        bootstrap_room=0x1F2E3D4C,
        prefill=SglangPdSide(3.5, 0.5, 0.75, 0.25, 2.5, 0.0, 12.5, (20.25,), 4.75, 1.0),
        decode=SglangPdSide(2.0, 0.5, 0.5, 0.25, 1.5, 41.0, 0.75, (0.5, 8.0, 8.5), 0.0, 1.25),
        prompt_tokens=40,
    ),
    SglangPdRequest(
        "a0b1c2d3e4f5a6b7c8d9e0f1a2b3c4d5",
        bootstrap_room=0x7A6B5C4D,
        prefill=SglangPdSide(2.0, 0.25, 0.5, 0.5, 6.0, 0.0, 30.0, (10.0, 10.5, 9.5), 12.0, 2.0),
        decode=SglangPdSide(1.5, 0.25, 0.5, 0.5, 7.5, 85.5, 3.0, (0.75, 9.0), 0.0, 1.5),
        prompt_tokens=300,
    ),
]
COLOCATED = SglangRequest(
    "c0c0c0c0a1a2a3a4a5a6a7a8a9aaabac",
    tokenize_ms=3.0,
    dispatch_ms=0.5,
    hop_ms=0.5,
    request_process_ms=0.25,
    queue_ms=5.0,
    chunks_ms=(15.0,),
    back_ms=1.0,
    decode_ms=50.0,
    prompt_tokens=20,
    completion_tokens=6,
    cached_tokens=0,
)


def _pipeline(clickhouse, client, tmp_path_factory):
    db = new_database(client, "pd_native")
    collector = Collector(
        clickhouse.url, database=db, spool_dir=str(tmp_path_factory.mktemp("spool")), flush_interval_s=0.05
    ).start()
    yield db, f"{LOOPBACK}:{collector.grpc_port}"
    collector.stop()


pipeline = pytest.fixture(scope="module")(_pipeline)
vllm_pipeline = pytest.fixture(scope="module")(_pipeline)  # its own database: the budgets stay apart


def emit(endpoint: str) -> dict[str, SglangPdRequest | None]:
    """Each P/D request under a client span whose traceparent both instances get (SGLang's router sends
    the request to both at once), and one colocated SGLang request; trace id → request (None: colocated)."""
    p_tok, p_sched = provider(endpoint, "sglang-prefill", SixtyFourBitIds(1)), provider(endpoint, "sglang-prefill")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_RESOURCE_ATTRIBUTES", f"{n.PL_PD_INSTANCE}={DECODE_INSTANCE}")
        d_tok, d_sched = provider(endpoint, "sglang-decode", SixtyFourBitIds(2)), provider(endpoint, "sglang-decode")
    colocated, loadgen = provider(endpoint, "sglang"), provider(endpoint, "phaselens-loadgen")
    t0 = (time.time_ns() // 10**9 - 60) * 10**9
    traces: dict[str, SglangPdRequest | None] = {}
    for i, r in enumerate(REQUESTS):
        start = t0 + i * 10**9
        e2e_ms = r.decode.ttft_ms(True) + 40.0
        span, headers = client_span(loadgen.get_tracer("phaselens.client"), start, r.decode.ttft_ms(True) + 3.0, e2e_ms)
        prefill_instance(
            p_tok.get_tracer("sglang server"), p_sched.get_tracer("sglang server"), r, start - HOUR_NS, headers
        )
        decode_instance(
            d_tok.get_tracer("sglang server"), d_sched.get_tracer("sglang server"), r, start + HOUR_NS, headers
        )
        span.end(end_time=start + round(e2e_ms * MS))
        traces[f"{span.get_span_context().trace_id:032x}"] = r
    span, headers = client_span(loadgen.get_tracer("phaselens.client"), t0 + 5 * 10**9, COLOCATED.ttft_ms + 2, 80.0)
    sglang_request(
        colocated.get_tracer("sglang server"), colocated.get_tracer("sglang server"), COLOCATED, t0 + 5 * 10**9, headers
    )
    span.end(end_time=t0 + 5 * 10**9 + 80 * MS)
    traces[f"{span.get_span_context().trace_id:032x}"] = None
    for tp in (p_tok, p_sched, d_tok, d_sched, colocated, loadgen):
        tp.shutdown()
    return traces


@pytest.fixture(scope="module")
def rows(pipeline, client):
    db, endpoint = pipeline
    traces = emit(endpoint)
    return traces, pd_rows(client, db, traces)


def pd_rows(
    client,
    database: str,
    traces: Mapping[str, object],
    ready: tuple[str, str] = ("decode_first_token_ms", "prefill_compute_ms"),
) -> dict[str, dict]:
    """`phaselens_requests` rows of these traces (trace id → its request, None for a colocated one),
    once every P/D row holds both instances' `ready` terms (by default prefill and first token)."""
    sql = "SELECT * FROM {db:Identifier}.phaselens_requests WHERE trace_id IN {ids:Array(String)}"
    params = {"db": database, "ids": list(traces)}
    deadline = time.monotonic() + 20
    while True:
        got = {r["trace_id"]: r for r in client.query(sql, parameters=params).named_results()}
        complete = len(got) == len(traces) and all(
            all(r[column] is not None for column in ready) for tid, r in got.items() if traces[tid] is not None
        )
        if complete or time.monotonic() > deadline:
            return got
        time.sleep(0.1)


def assert_pd_columns(row: dict, r: SglangPdRequest) -> None:
    """The P/D columns of one SGLang P/D request give back the durations its spans were built with."""
    p, d = r.prefill, r.decode
    assert (row["prefill_instance"], row["decode_instance"], row["pd_span_model"]) == (
        "sglang-prefill",
        DECODE_INSTANCE,
        n.SPAN_MODEL_SGLANG,
    )
    want = {
        "prefill_ingress_ms": p.ingress_ms + p.prepare_ms,
        "prefill_bootstrap_ms": p.bootstrap_ms,
        "prefill_queue_ms": p.queue_ms,
        "prefill_compute_ms": sum(p.work_ms),
        "kv_transfer_ms": p.kv_ms,
        "decode_ingress_ms": d.ingress_ms + d.prepare_ms,
        "decode_bootstrap_ms": d.bootstrap_ms,
        "decode_kv_wait_ms": d.transferred_ms,
        "decode_queue_ms": d.queue_ms,
        "decode_first_token_ms": d.work_ms[0],
    }
    assert {k: row[k] for k in want} == {k: pytest.approx(v, abs=1e-6) for k, v in want.items()}
    # what SGLang's spans do not hold stays NULL: no router spans, no KV bytes, no sender queue
    # apart from the transfer, no hops, no first-chunk stamp
    for column in (
        "kv_bytes",
        "kv_bytes_received",
        "kv_wait_ms",
        "kv_receive_ms",
        "router_ingress_ms",
        "router_ttfc_ms",
        "prefill_hop_ms",
        "decode_hop_ms",
        "prefill_first_token_ms",
        "prefill_respond_ms",
        "decode_first_chunk_ms",
    ):
        assert row[column] is None, column
    # the instances' roots stay out of the generic row: no server TTFT merged from two clocks; its
    # queue and prefill are the prefill instance's slices (the names a colocated SGLang shares)
    assert (row["span_model"], row["server_ttft_ms"], row["residual_ms"]) == (None, None, None)
    assert (row["queue_ms"], row["prefill_ms"]) == (pytest.approx(p.queue_ms), pytest.approx(sum(p.work_ms)))


def test_sglang_pd_spans_fill_the_pd_columns_each_on_its_own_clock(rows):
    traces, got = rows
    assert got.keys() == traces.keys()
    for trace_id, r in traces.items():
        if r is not None:
            assert_pd_columns(got[trace_id], r)


def test_a_colocated_sglang_request_keeps_its_row_and_null_pd_columns(rows):
    traces, got = rows
    (trace_id,) = [t for t, r in traces.items() if r is None]
    row = got[trace_id]
    assert row["span_model"] == n.SPAN_MODEL_SGLANG
    assert row["server_ttft_ms"] == pytest.approx(COLOCATED.ttft_ms, abs=1e-6)
    assert {c: row[c] for c in PD_COLUMN_NAMES} == dict.fromkeys(PD_COLUMN_NAMES)


def test_the_pd_budget_counts_sglang_requests_but_none_complete(pipeline, client, rows):
    """SGLang's router calls both instances at once: the terms run in parallel and cannot add up
    to client TTFT, so no SGLang request is `complete`; the budget names the span model."""
    db, _ = pipeline
    report = pd_budget(client, database=db, since=None)
    assert (report.requests, report.complete, report.prefill_instances, report.decode_instances) == (2, 0, 1, 1)
    assert report.span_models == [n.SPAN_MODEL_SGLANG]


VLLM = [  # (prefill instance's request, decode instance's request)
    (VllmPdSide(4.0, 1.5, 22.5, 0.0, 1), VllmPdSide(31.0, 1.25, 6.5, 90.0, 12)),
    (VllmPdSide(15.0, 2.0, 48.0, 0.0, 1), VllmPdSide(64.5, 1.0, 7.25, 40.0, 6)),
]
VLLM_INSTANCES = {"prefill": "http://prefill-0:8100", "decode": "http://decode-0:8200"}


def _vllm_provider(endpoint: str, role: str) -> TracerProvider:
    """A vLLM instance's provider (vllm/tracing/otel.py), its role and URL set by the operator in
    OTEL_RESOURCE_ATTRIBUTES, which `Resource.create` reads."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OTEL_RESOURCE_ATTRIBUTES", f"{n.PL_PD_ROLE}={role},{n.PL_PD_INSTANCE}={VLLM_INSTANCES[role]}")
        mp.setenv("OTEL_SERVICE_NAME", "vllm")
        resource = Resource.create({"vllm.instrumenting_module_name": "vllm.llm_engine", "vllm.process_id": "4242"})
    tp = TracerProvider(resource=resource)
    tp.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint, insecure=True)))
    return tp


@pytest.fixture(scope="module")
def vllm_rows(vllm_pipeline, client):
    db, endpoint = vllm_pipeline
    prefill, decode = _vllm_provider(endpoint, "prefill"), _vllm_provider(endpoint, "decode")
    loadgen = provider(endpoint, "phaselens-loadgen")
    t0 = (time.time_ns() // 10**9 - 30) * 10**9
    traces = {}
    for i, (p, d) in enumerate(VLLM):
        start = t0 + i * 10**9
        ttft_ms = p.ttft_ms + d.ttft_ms + 5.0
        span, headers = client_span(loadgen.get_tracer("phaselens.client"), start, ttft_ms, ttft_ms + d.decode_ms)
        vllm_instance(prefill.get_tracer("vllm.llm_engine"), p, start - HOUR_NS, headers, 64)
        vllm_instance(decode.get_tracer("vllm.llm_engine"), d, start + HOUR_NS + 30 * MS, headers, 64)
        span.end(end_time=start + round((ttft_ms + d.decode_ms + 1) * MS))
        traces[f"{span.get_span_context().trace_id:032x}"] = (p, d)
    for tp in (prefill, decode, loadgen):
        tp.shutdown()
    return traces, pd_rows(client, db, traces)


def test_vllm_llm_request_spans_of_role_tagged_instances_fill_what_they_hold(vllm_rows):
    """vLLM's keys on each instance's clock: the prefill instance's queue and prefill, the decode
    instance's first step after the KV arrived; its queue (the KV pull and the wait for a seat,
    not separable) and everything else stay NULL."""
    traces, got = vllm_rows
    assert got.keys() == traces.keys()
    for trace_id, (p, d) in traces.items():
        row = got[trace_id]
        assert (row["prefill_instance"], row["decode_instance"], row["pd_span_model"]) == (
            VLLM_INSTANCES["prefill"],
            VLLM_INSTANCES["decode"],
            n.SPAN_MODEL_VLLM,
        )
        want = {
            "prefill_queue_ms": p.queue_ms,
            "prefill_compute_ms": p.prefill_ms,
            "decode_first_token_ms": d.prefill_ms,
        }
        assert {k: row[k] for k in want} == {k: pytest.approx(v, abs=1e-6) for k, v in want.items()}
        for column in ("decode_queue_ms", "kv_transfer_ms", "kv_bytes", "prefill_ingress_ms", "decode_kv_wait_ms"):
            assert row[column] is None, column
        assert (row["span_model"], row["server_ttft_ms"]) == (None, None)  # both spans stay out of the generic row
