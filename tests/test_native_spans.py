"""SGLang's and TGI's native spans → the per-request view and `phaselens budget`. The spans are built as
their sources build them (tests/native_spans.py), each under a client span whose traceparent they
carry, exported over OTLP/gRPC to the real collector and written to the real embedded ClickHouse; the
rows must give back the durations put in."""

from __future__ import annotations

import statistics
import time

import pytest
from opentelemetry.trace import SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.analysis import queries as queries
from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.schema.schema import rust_duration_ms
from phaselens.collectors.service import Collector
from phaselens.common.process import LOOPBACK
from phaselens.instrumentation import names as n
from tests.analysis_fixtures import client, new_database
from tests.native_spans import (
    MS,
    TGI_SERVICE,
    SglangRequest,
    SixtyFourBitIds,
    TgiRequest,
    client_span,
    provider,
    sglang_request,
    tgi_request,
)

T0 = 1_767_000_000 * 10**9  # wall ns of the first request
SGLANG = [  # (request, client TTFT − server TTFT: network both ways + client + SGLang's delivery)
    (
        SglangRequest(
            "9f2c4e1a7b3d4c5e8f6a0b1c2d3e4f5a",
            tokenize_ms=3.5,
            dispatch_ms=0.5,
            hop_ms=0.75,
            request_process_ms=0.25,
            queue_ms=12.5,
            chunks_ms=(20.25,),
            back_ms=1.25,
            decode_ms=100.0,
            prompt_tokens=40,
            completion_tokens=16,
            cached_tokens=8,
        ),
        4.5,
    ),
    (
        SglangRequest(
            "1b2c3d4e5f60718293a4b5c6d7e8f901",
            tokenize_ms=2.0,
            dispatch_ms=0.25,
            hop_ms=0.5,
            request_process_ms=0.5,
            queue_ms=30.0,
            chunks_ms=(10.0, 10.5, 9.5),
            back_ms=2.0,
            decode_ms=150.0,
            prompt_tokens=300,
            completion_tokens=11,
            cached_tokens=0,
        ),
        7.25,
    ),
]
TGI = [  # (handler, request, client TTFT, client e2e, expected ms: validation, queue, total; tokens)
    (
        "generate_stream",
        TgiRequest("1.5ms", "12.5ms", "250ms", "12.5ms", "264ms", span_ms=264.4),
        40.0,
        268.0,
        (1.5, 12.5, 264.0),
        20,
    ),
    (
        "chat_completions",
        TgiRequest("850µs", "3.2s", "1.000000042s", "50.000002ms", "4.200850042s", span_ms=4201.0),
        3300.0,
        4203.5,
        (0.85, 3200.0, 4200.850042),
        20,
    ),
    (
        "generate",
        TgiRequest("12.5 ms", "n/a", "1.5h", "fast", "42ns", span_ms=0.5),  # malformed but total
        2.0,
        3.0,
        (None, None, 0.000042),
        None,
    ),
]


@pytest.fixture(scope="module")
def pipeline(clickhouse, client, tmp_path_factory):
    db = new_database(client, "native")
    collector = Collector(
        clickhouse.url, database=db, spool_dir=str(tmp_path_factory.mktemp("spool")), flush_interval_s=0.05
    ).start()
    yield db, f"{LOOPBACK}:{collector.grpc_port}"
    collector.stop()


def _facts(client, db: str, where: str, parameters: dict, expected: int, timeout_s: float = 20.0) -> list[dict]:
    """The facts rows meeting `where` (values as bound `parameters`), once `expected` of them arrived."""
    sql = f"SELECT * FROM {{db:Identifier}}.phaselens_request_facts WHERE {where}"
    deadline = time.monotonic() + timeout_s
    while True:
        rows = list(client.query(sql, parameters={"db": db, **parameters}).named_results())
        if len(rows) >= expected or time.monotonic() > deadline:
            return rows
        time.sleep(0.1)


def _rows(client, db: str, span_model: str, expected: int) -> dict[str, dict]:
    """The facts rows of this span model that have a client view, by trace id, once all arrived."""
    rows = _facts(client, db, "span_model = {m:String} AND has_client", {"m": span_model}, expected)
    return {r["trace_id"]: r for r in rows}


@pytest.fixture(scope="module")
def sglang_rows(pipeline, client):
    db, endpoint = pipeline
    tokenizer = provider(endpoint, "sglang", SixtyFourBitIds(1))
    scheduler = provider(endpoint, "sglang", SixtyFourBitIds(2))
    loadgen = provider(endpoint, "phaselens-loadgen")
    traces = {}
    for i, (r, extra_ms) in enumerate(SGLANG):
        t0 = T0 + i * 10**9
        span, headers = client_span(
            loadgen.get_tracer("phaselens.client"), t0 - MS, r.ttft_ms + extra_ms, r.ttft_ms + r.decode_ms + extra_ms
        )
        sglang_request(tokenizer.get_tracer("sglang server"), scheduler.get_tracer("sglang server"), r, t0, headers)
        span.end(end_time=t0 + round((r.ttft_ms + r.decode_ms + 5) * MS))
        traces[f"{span.get_span_context().trace_id:032x}"] = (r, extra_ms)
    for tp in (tokenizer, scheduler, loadgen):
        tp.shutdown()
    return traces, _rows(client, db, n.SPAN_MODEL_SGLANG, len(SGLANG))


@pytest.fixture(scope="module")
def tgi_rows(pipeline, client):
    db, endpoint = pipeline
    router, loadgen = provider(endpoint, TGI_SERVICE), provider(endpoint, "phaselens-loadgen")
    traces = {}
    for i, (handler, r, ttft_ms, e2e_ms, expected, tokens) in enumerate(TGI):
        t0 = T0 + (10 + i) * 10**9
        span, headers = client_span(loadgen.get_tracer("phaselens.client"), t0 - MS, ttft_ms, e2e_ms)
        tgi_request(router.get_tracer("opentelemetry-otlp"), r, t0, headers, handler)
        span.end(end_time=t0 + round((r.span_ms + 1) * MS))
        traces[f"{span.get_span_context().trace_id:032x}"] = (r, e2e_ms, expected, tokens)
    router.shutdown()
    loadgen.shutdown()
    return traces, _rows(client, db, n.SPAN_MODEL_TGI, len(TGI))


def test_rust_duration_strings_parse_in_clickhouse_and_malformed_ones_are_null(client):
    cases = {
        "1.5ms": 1.5,
        "850µs": 0.85,
        "850μs": 0.85,
        "850us": 0.85,
        "42ns": 42e-6,
        "3.2s": 3200.0,
        "2s": 2000.0,
        "1.000000042s": 1000.000042,
        "0ns": 0.0,
        "": None,
        "12.5 ms": None,
        "1.5h": None,
        "ms": None,
        ".5ms": None,
        "-1ms": None,
        "1e3ms": None,
        "1.5ms ": None,
        "None": None,
    }
    sql = f"SELECT s, {rust_duration_ms('s')} FROM (SELECT arrayJoin({{v:Array(String)}}) AS s)"
    got = dict(client.query(sql, parameters={"v": list(cases)}).result_rows)
    assert got.keys() == cases.keys()
    for text, want in cases.items():
        assert got[text] == (None if want is None else pytest.approx(want, rel=1e-12)), text


def test_sglang_request_trace_becomes_a_budget_row_under_the_client_span(sglang_rows):
    traces, rows = sglang_rows
    assert rows.keys() == traces.keys()
    for trace_id, (r, extra_ms) in traces.items():
        row = rows[trace_id]
        assert (row["request_id"], row["service"], row["model"]) == (r.rid, "sglang", "tiny")
        assert (row["input_tokens"], row["output_tokens"], row["cached_tokens"]) == (
            r.prompt_tokens,
            r.completion_tokens,
            r.cached_tokens,
        )
        want = {
            "server_ttft_ms": r.ttft_ms,
            "ingress_ms": r.ingress_ms,
            "queue_ms": r.queue_ms,
            "ttft_queue_ms": r.queue_ms,
            "prefill_ms": r.prefill_ms,
            "before_engine_ms": r.before_engine_ms,
            "decode_ms": r.decode_ms,
            "server_tpot_ms": r.decode_ms / (r.completion_tokens - 1),
            "residual_ms": extra_ms,
            "server_e2e_ms": r.ttft_ms + r.decode_ms,
        }
        assert {k: row[k] for k in want} == {k: pytest.approx(v, abs=1e-6) for k, v in want.items()}
        assert row["prefill_chunks"] == len(r.chunks_ms)
        assert (row["first_token_ms"], row["delivery_ms"], row["status"]) == (None, None, "ok")


def test_sglang_budget_adds_up_and_says_what_it_cannot_separate(pipeline, client, sglang_rows):
    db, _ = pipeline
    report = budget(client, database=db, since=None, service="sglang")
    assert report.span_models == [n.SPAN_MODEL_SGLANG] and report.requests == len(SGLANG)
    assert len(report.unseparated) == 1 and "request_process" in report.unseparated[0]
    means = {c.name: c.ms.mean for c in report.components}
    requests = [r for r, _ in SGLANG]
    assert means["ingress_ms"] == pytest.approx(statistics.mean(r.ingress_ms for r in requests))
    assert means["queue_ms"] == pytest.approx(statistics.mean(r.queue_ms for r in requests))
    assert means["prefill_ms"] == pytest.approx(statistics.mean(r.prefill_ms for r in requests))
    assert means["first_token_ms"] is None
    total = sum(v for v in means.values() if v is not None)
    assert total == pytest.approx(report.distributions["client_ttft_ms"].mean)  # the identity holds


def test_the_diagnosis_counts_sglangs_before_engine_with_ingress(pipeline, client, sglang_rows):
    """SGLang rows carry both ingress and before_engine: the diagnosis's ingress term is their sum."""
    db, _ = pipeline
    sql, params = queries.render_cli("diagnosis_figures", database=db, service="sglang")
    row = next(client.query(sql, parameters=params).named_results())
    sums = sorted(r.ingress_ms + r.before_engine_ms for r, _ in SGLANG)
    assert row["ingress_ms_q"][0] == pytest.approx(statistics.quantiles(sums, n=2, method="inclusive")[0])


def test_tgi_handler_span_becomes_a_row_with_its_timings_parsed(tgi_rows):
    traces, rows = tgi_rows
    assert rows.keys() == traces.keys()  # one row per request: Infer's own generate_stream span is not it
    for trace_id, (r, e2e_ms, (validation, queue, total), tokens) in traces.items():
        row = rows[trace_id]
        assert (row["service"], row["status"], row["output_tokens"]) == (TGI_SERVICE, "ok", tokens)
        assert row["ingress_ms"] == (None if validation is None else pytest.approx(validation, abs=1e-9))
        assert row["queue_ms"] == row["ttft_queue_ms"] == (None if queue is None else pytest.approx(queue, abs=1e-9))
        assert row["e2e_residual_ms"] == pytest.approx(e2e_ms - total, abs=1e-9)
        assert row["server_e2e_ms"] == pytest.approx(r.span_ms, abs=1e-6)  # the handler span's own length
        # TGI gives no TTFT, and its inference_time holds prefill and every decode step: nothing invented
        for column in (
            "server_ttft_ms",
            "prefill_ms",
            "first_token_ms",
            "decode_ms",
            "before_engine_ms",
            "residual_ms",
            "server_tpot_ms",
        ):
            assert row[column] is None, column


def test_tgi_budget_names_the_span_model_and_keeps_the_residual_empty(pipeline, client, tgi_rows):
    db, _ = pipeline
    report = budget(client, database=db, since=None, service=TGI_SERVICE)
    assert report.span_models == [n.SPAN_MODEL_TGI] and report.requests == len(TGI)
    assert len(report.unseparated) == 1 and "no TTFT" in report.unseparated[0]
    means = {c.name: c.ms.mean for c in report.components}
    assert means["ingress_ms"] == pytest.approx((1.5 + 0.85) / 2)  # the malformed one is NULL, not 0
    assert means["queue_ms"] == pytest.approx((12.5 + 3200.0) / 2)
    assert means["residual_ms"] is None and means["prefill_ms"] is None
    e2e = [e2e_ms - total for _, _, _, e2e_ms, (_, _, total), _ in TGI]
    assert report.distributions["e2e_residual_ms"].mean == pytest.approx(statistics.mean(e2e))


def test_vllm_llm_request_keeps_its_mapping_beside_the_new_span_models(pipeline, client):
    """vLLM 0.32's one SERVER span: its time_in_model_prefill is the prefill term (SGLang's is not)."""
    db, endpoint = pipeline
    vllm, loadgen = provider(endpoint, "vllm-regression"), provider(endpoint, "phaselens-loadgen")
    t0 = T0 + 20 * 10**9
    span, headers = client_span(loadgen.get_tracer("phaselens.client"), t0 - MS, 60.0, 160.0)
    keys = {
        n.LATENCY_TIME_TO_FIRST_TOKEN: 0.05,
        n.LATENCY_TIME_IN_QUEUE: 0.0125,
        n.LATENCY_TIME_IN_MODEL_PREFILL: 0.02,
        n.LATENCY_TIME_IN_MODEL_DECODE: 0.09,
        n.LATENCY_E2E: 0.15,
        n.GEN_AI_USAGE_PROMPT_TOKENS: 32,
        n.GEN_AI_USAGE_COMPLETION_TOKENS: 10,
        n.GEN_AI_REQUEST_ID: "cmpl-abc-0",
    }
    server = vllm.get_tracer("vllm").start_span(
        n.SPAN_VLLM_REQUEST,
        kind=SpanKind.SERVER,
        start_time=t0,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes=keys,
    )
    server.end(end_time=t0 + 150 * MS)
    span.end(end_time=t0 + 160 * MS)
    vllm.shutdown()
    loadgen.shutdown()
    (row,) = _rows(client, db, n.SPAN_MODEL_VLLM, 1).values()
    want = {
        "server_ttft_ms": 50.0,
        "ttft_queue_ms": 12.5,
        "prefill_ms": 20.0,
        "before_engine_ms": 17.5,
        "decode_ms": 90.0,
        "residual_ms": 10.0,
    }
    assert {k: row[k] for k in want} == {k: pytest.approx(v, abs=1e-9) for k, v in want.items()}
    assert (row["ingress_ms"], row["first_token_ms"], row["request_id"]) == (None, None, "cmpl-abc-0")
    assert row["x_request_id"] == "abc"  # vLLM's id is cmpl-{X-Request-Id}-{prompt index}


def test_tgi_request_that_failed_before_its_last_token_keeps_its_client_row_only(pipeline, client):
    """TGI records its timings only at the last token: a failed request's handler span has none."""
    db, endpoint = pipeline
    router, loadgen = provider(endpoint, TGI_SERVICE), provider(endpoint, "phaselens-loadgen-failed")
    t0 = T0 + 30 * 10**9
    span, headers = client_span(loadgen.get_tracer("phaselens.client"), t0 - MS, 5.0, 6.0)
    handler = router.get_tracer("opentelemetry-otlp").start_span(
        "generate_stream",
        start_time=t0,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={"parameters": "GenerateParameters { .. }", "busy_ns": 1000, "idle_ns": 2000},
    )
    handler.end(end_time=t0 + 2 * MS)
    span.end(end_time=t0 + 7 * MS)
    router.shutdown()
    loadgen.shutdown()
    trace_id = f"{span.get_span_context().trace_id:032x}"
    (row,) = _facts(client, db, "trace_id = {t:String}", {"t": trace_id}, 1)
    assert (row["has_client"], row["has_server"], row["span_model"]) == (True, False, None)
    assert row["client_ttft_ms"] == pytest.approx(5.0) and row["ingress_ms"] is None
