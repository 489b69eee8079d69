"""The SQL cookbook's own queries (docs/sql-cookbook.md) and the dashboards' drop-down values."""

from __future__ import annotations

from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import COMPONENTS, ERROR, from_requests, series, unless_unstamped
from phaselens.analysis.queries.rollups import states
from phaselens.analysis.queries.traces import one_trace
from phaselens.analysis.schema.schema import (
    CLIENT_KINDS,
    SPANS_VIEW,
)
from phaselens.instrumentation import names as n

TTFT_P50_P99 = (
    "quantileExactInclusive(0.5)(ttft_ms) AS ttft_p50_ms, quantileExactInclusive(0.99)(ttft_ms) AS ttft_p99_ms"
)


def _model_mean(name: str, expr: str) -> str:
    """A component's mean over a model's requests; NULL where none of them was stamped with it."""
    return unless_unstamped(name, f"avg({expr})", "NULL")


def budget_by_model(d: Dialect) -> str:
    means = ", ".join(f"{_model_mean(name, expr)} AS {name}_mean" for name, expr in COMPONENTS)
    return (
        f"SELECT model, count() AS requests, countIf({ERROR}) AS errors,\n    {TTFT_P50_P99},\n"
        f"    {means}\n{from_requests(d)}\nGROUP BY model\nORDER BY requests DESC"
    )


def ttft_vs_prompt_length(d: Dialect) -> str:
    bucket = d.value("bucket_tokens", "UInt32", 128)
    computed_tokens = "sum(input_tokens - coalesce(cached_tokens, 0))"
    return (
        f"SELECT intDiv(input_tokens, {bucket}) * {bucket} AS prompt_tokens_from, count() AS requests,\n"
        f"    {TTFT_P50_P99},\n    quantileExactInclusive(0.5)(prefill_ms) AS prefill_p50_ms,\n"
        f"    sum(prefill_ms) / nullIf({computed_tokens}, 0) * 1000 AS prefill_ms_per_1k_tokens\n"
        f"{from_requests(d)} AND input_tokens IS NOT NULL\nGROUP BY prompt_tokens_from\nORDER BY prompt_tokens_from"
    )


def queueing_vs_load(d: Dialect) -> str:
    return series(
        d,
        "start_time",
        from_requests(d),
        [
            f"count() / {d.bucket_seconds()} AS arrivals_per_s",
            "quantileExactInclusive(0.5)(ttft_queue_ms) AS queue_p50_ms",
            "quantileExactInclusive(0.99)(ttft_queue_ms) AS queue_p99_ms",
            "sum(ttft_queue_ms) / nullIf(sum(ttft_ms), 0) AS queue_share_of_ttft",
        ],
    )


def request_spans(d: Dialect) -> str:
    """A request's spans, placed per process: `offset_ms` counts from the first span of its service and
    P/D instance, on that process's own clock (offsets of two processes are never subtracted from each
    other); `role` and `instance` name a disaggregated process (docs/disaggregation.md)."""
    ts = "toUnixTimestamp64Nano(Timestamp)"
    instance = f"ResourceAttributes['{n.PL_PD_INSTANCE}']"
    return one_trace(
        d,
        (
            "ServiceName AS service, SpanName AS span, SpanKind AS kind, SpanId AS span_id,\n"
            "    ParentSpanId AS parent_span_id,\n"
            f"    ({ts} - min({ts}) OVER (PARTITION BY ServiceName, {instance})) / 1e6 AS offset_ms,\n"
            "    Duration / 1e6 AS duration_ms, StatusCode AS status,\n"
            f"    ResourceAttributes['{n.PL_PD_ROLE}'] AS role, {instance} AS instance"
        ),
        "ORDER BY service, offset_ms, span",
    )


def services(d: Dialect) -> str:
    """Values of the dashboards' service drop-down: the services of the requests and engine steps in
    range, from the rollups (a minute's rows name them)."""
    requests = f"SELECT service FROM {d.table(sk.STATES_VIEW)} WHERE {d.bucket_filter('bucket')}"
    steps = f"SELECT service FROM {d.table(sk.STEPS_STATES_VIEW)} WHERE {d.bucket_filter('bucket')}"
    return f"SELECT DISTINCT service FROM ({requests}\n    UNION ALL {steps})\nWHERE service != ''\nORDER BY service"


def models(d: Dialect) -> str:
    """Values of the dashboards' model drop-down (gen_ai.response.model, else request.model), from
    the rollups: a minute's rows name its models."""
    return f"SELECT DISTINCT model {states(d)} AND model != ''\nORDER BY model"


def naive_ttft(d: Dialect) -> str:
    """THE WRONG WAY, kept as documentation: TTFT as (server first-token span end − client span
    start) subtracts timestamps of two machines, so any clock offset lands in the result."""
    traces = d.table(SPANS_VIEW)
    return (
        f"SELECT c.TraceId AS trace_id, (toUnixTimestamp64Nano(f.Timestamp) + f.Duration "
        "- toUnixTimestamp64Nano(c.Timestamp)) / 1e6 AS naive_ttft_ms\n"
        f"FROM {traces} AS c INNER JOIN {traces} AS f ON f.TraceId = c.TraceId\n"
        f"WHERE c.SpanKind IN {CLIENT_KINDS} AND f.SpanName = '{n.SPAN_FIRST_TOKEN}'\nORDER BY trace_id"
    )
