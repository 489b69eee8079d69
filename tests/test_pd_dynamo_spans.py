"""Dynamo's disaggregated worker spans → the P/D columns of `phaselens_requests`. Spans are built as
Dynamo builds them (tests/native_pd_spans.py: `handle_payload` and `engine.generate`, read in
ai-dynamo/dynamo lib/backend-common/src/adapter.rs at 052692a7, disagg.rs at 12ff6282,
lib/runtime/src/logging.rs), the prefill worker's clock an hour behind, the decode worker's an hour
ahead, under the frontend's `http-request`, exported over OTLP/gRPC to the real collector and
written to the real embedded ClickHouse. What Dynamo's spans hold comes back on its own clock; what
they do not hold stays NULL, and an aggregated worker's request gets no P/D columns at all."""

from __future__ import annotations

import time

import pytest
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from phaselens.analysis.budget.pd_budget import pd_budget
from phaselens.analysis.schema import span_models
from phaselens.analysis.schema.pd_schema import PD_COLUMN_NAMES
from phaselens.instrumentation import names as n
from tests.analysis_fixtures import client
from tests.native_pd_spans import DynamoPdWorker, dynamo_worker
from tests.native_spans import MS, client_span, provider
from tests.test_pd_native_spans import HOUR_NS, _pipeline, pd_rows

__all__ = ["client"]

dynamo_pipeline = pytest.fixture(scope="module")(_pipeline)  # its own database: the budget stays apart

REQUESTS = [  # (prefill worker, decode worker)
    (DynamoPdWorker(0.75, 37.25, (), 512), DynamoPdWorker(1.5, 21.5, (9.25, 8.75, 14.5, 9.0), 512)),
    (DynamoPdWorker(0.5, 120.75, (), 2048), DynamoPdWorker(2.25, 64.0, (11.0, 30.25), 2048)),
]
AGGREGATED = DynamoPdWorker(1.0, 44.5, (10.0, 12.5), 128)
FILLED = ("prefill_instance", "decode_instance", "prefill_engine_ttft_ms", "decode_engine_ttft_ms", "decode_itl_p99_ms")


def _frontend(tracer, start: int, headers: dict[str, str], e2e_ms: float) -> tuple[object, dict[str, str]]:
    """The frontend's `http-request` (logging.rs make_request_span), under the client's traceparent;
    the headers it passes on to the workers."""
    span = tracer.start_span(
        "http-request",
        start_time=start,
        context=TraceContextTextMapPropagator().extract(headers),
        attributes={"method": "POST", "uri": "/v1/completions", "version": "HTTP/1.1"},
    )
    out: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(out, context=trace.set_span_in_context(span))
    span.end(end_time=start + round(e2e_ms * MS))
    return span, out


@pytest.fixture(scope="module")
def dynamo_rows(dynamo_pipeline, client):
    db, endpoint = dynamo_pipeline
    tps = {s: provider(endpoint, s) for s in ("dynamo-frontend", "dynamo-worker-prefill", "dynamo-worker-decode")}
    worker = provider(endpoint, "dynamo-worker-vllm")
    loadgen = provider(endpoint, "phaselens-loadgen")
    tracer = {s: tp.get_tracer("dynamo") for s, tp in tps.items()}
    t0 = (time.time_ns() // 10**9 - 30) * 10**9
    traces: dict[str, tuple[DynamoPdWorker, DynamoPdWorker] | None] = {}
    for i, (p, d) in enumerate(REQUESTS):
        start = t0 + i * 10**9
        e2e_ms = p.e2e_ms + d.e2e_ms + 6.0
        span, headers = client_span(loadgen.get_tracer("phaselens.client"), start, p.e2e_ms + d.ttft_ms + 5, e2e_ms)
        _, fwd = _frontend(tracer["dynamo-frontend"], start + MS, headers, e2e_ms - 2)
        prefill = dynamo_worker(tracer["dynamo-worker-prefill"], "prefill", p, start - HOUR_NS, fwd)
        dynamo_worker(tracer["dynamo-worker-decode"], "decode", d, start + HOUR_NS, fwd, prefill.get_span_context())
        span.end(end_time=start + round(e2e_ms * MS))
        traces[f"{span.get_span_context().trace_id:032x}"] = (p, d)
    start = t0 + 5 * 10**9
    span, headers = client_span(loadgen.get_tracer("phaselens.client"), start, AGGREGATED.ttft_ms + 4, 80.0)
    _, fwd = _frontend(tracer["dynamo-frontend"], start + MS, headers, 78.0)
    dynamo_worker(worker.get_tracer("dynamo"), "agg", AGGREGATED, start + HOUR_NS, fwd)
    span.end(end_time=start + 80 * MS)
    traces[f"{span.get_span_context().trace_id:032x}"] = None
    for tp in (*tps.values(), worker, loadgen):
        tp.shutdown()
    # the workers' figures Dynamo's spans do hold (pd_rows' defaults are terms they do not)
    return traces, pd_rows(client, db, traces, ("decode_engine_ttft_ms", "prefill_engine_ttft_ms"))


def test_dynamo_engine_generate_spans_fill_what_they_hold_each_on_its_own_clock(dynamo_rows):
    traces, got = dynamo_rows
    assert got.keys() == traces.keys()
    for trace_id, pair in traces.items():
        if pair is None:
            continue
        p, d = pair
        row = got[trace_id]
        assert (row["prefill_instance"], row["decode_instance"], row["pd_span_model"]) == (
            "dynamo-worker-prefill",
            "dynamo-worker-decode",
            n.SPAN_MODEL_DYNAMO,
        )
        want = {
            "prefill_engine_ttft_ms": p.ttft_ms,
            "decode_engine_ttft_ms": d.ttft_ms,
            "decode_itl_p99_ms": d.itl_p99_ms(),
        }
        assert {k: row[k] for k in want} == {k: pytest.approx(v, abs=1e-6) for k, v in want.items()}
        # nothing else is on Dynamo's spans: no queue / prefill / KV terms apart, no bytes, no hops
        rest = [c for c in PD_COLUMN_NAMES if c not in (*FILLED, "pd_span_model")]
        assert {c: row[c] for c in rest} == dict.fromkeys(rest)
        # the workers' spans stay out of the generic row: no server TTFT made from two clocks
        assert (row["span_model"], row["server_ttft_ms"]) == (None, None)


def test_an_aggregated_dynamo_worker_leaves_the_pd_columns_null(dynamo_rows):
    traces, got = dynamo_rows
    (trace_id,) = [t for t, r in traces.items() if r is None]
    assert {c: got[trace_id][c] for c in PD_COLUMN_NAMES} == dict.fromkeys(PD_COLUMN_NAMES)


def test_the_pd_budget_counts_dynamo_requests_but_none_complete(dynamo_pipeline, client, dynamo_rows):
    db, _ = dynamo_pipeline
    report = pd_budget(client, database=db, since=None)
    assert (report.requests, report.complete, report.prefill_instances, report.decode_instances) == (2, 0, 1, 1)
    assert report.span_models == [n.SPAN_MODEL_DYNAMO]
    (note,) = span_models.pd_notes(report.span_models)  # what `phaselens budget` prints under the table
    assert note.startswith(f"{n.SPAN_MODEL_DYNAMO}: ") and "neither separable" in note
