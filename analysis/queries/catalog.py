"""Every analysis query by name (`QUERIES`), in one room: the CLI, the Python API, the report and the Grafana
dashboards render these templates; nobody copies their SQL (docs/contracts.md, "Analysis queries").
Each one's CLI rendering is checked in as `analysis/sql/<name>.sql` (`phaselens sql write|check`).

    render_cli(name, **filters) -> (sql, parameters)   # bound server-side parameters only
    render_grafana(name, database="otel") -> str       # Grafana macros and ${variables}
    PANEL_COLUMNS[name]                                # the columns a panel query returns

Filters (CLI): database, service, model, since ("15m"; None = all time), bucket_s, limit,
ttft_slo_ms, tpot_slo_ms, trace_id, bucket_tokens, approx (t-digest quantiles).

Each family's templates live in their own module: `budget`, `diagnosis`, `rollups`, `steps`,
`panels`, `traces`, `cookbook`, `report` (over the building blocks of `facts`), `pd_queries`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from phaselens.analysis.queries import pd_queries
from phaselens.analysis.queries.budget import budget_summary, decode_stalls, tail_attribution
from phaselens.analysis.queries.cookbook import (
    budget_by_model,
    models,
    naive_ttft,
    queueing_vs_load,
    request_spans,
    services,
    ttft_vs_prompt_length,
)
from phaselens.analysis.queries.diagnosis import (
    DIAGNOSIS_FIGURES,
    diagnosis_causes,
    diagnosis_engine,
    diagnosis_figures,
    diagnosis_target,
)
from phaselens.analysis.queries.dialect import CliDialect, Dialect, Filters, GrafanaDialect, QueryError
from phaselens.analysis.queries.facts import COMPONENTS, DISTRIBUTIONS
from phaselens.analysis.queries.panels import (
    LATENCY_SERIES,
    budget_stack,
    delivery_over_time,
    goodput_over_time,
    goodput_per_minute,
    latency_over_time,
    slowest_requests,
    slowest_requests_rollup,
    throughput_over_time,
)
from phaselens.analysis.queries.report import report_points, report_steps
from phaselens.analysis.queries.rollups import SLOWEST_FIELDS, budget_summary_rollup, diagnosis_causes_rollup
from phaselens.analysis.queries.steps import (
    decode_stalls_over_time,
    decode_stalls_rollup,
    diagnosis_engine_rollup,
    engine_batch_over_time,
    engine_kv_over_time,
    queue_depth_over_time,
)
from phaselens.analysis.queries.traces import request_trace


@dataclass(frozen=True, slots=True)
class Query:
    template: Callable[[Dialect], str]
    columns: tuple[str, ...]
    panel: bool = False
    defaults: Filters = field(default_factory=dict)


def _dist_columns() -> tuple[str, ...]:
    return tuple(c for name, _ in DISTRIBUTIONS for c in (f"{name}_q", f"{name}_mean"))


_STALL = ("mixed_steps", "decode_steps", "stall_ms", "request_stall_ms", "delayed_decodes")
_LATENCY = tuple(name for name, _, _ in LATENCY_SERIES)
_COMP_NAMES = tuple(name for name, _ in COMPONENTS)
_GOODPUT = ("time", "goodput_rps", "completed_rps", "slo_attainment")
_TAIL = ("threshold_ms", "tail_requests", "ttft_tail_mean", *(f"{c}_tail_mean" for c in _COMP_NAMES))
_SUMMARY_HEAD = ("requests", "with_client", "errors", "with_server", "good", "span_models")
_SUMMARY_TAIL = ("no_output", "window_s", *_dist_columns(), *_TAIL)
_SLOWEST = tuple(name for name, _, _ in SLOWEST_FIELDS)
_CAUSES = ("cause", "role", "p50_signal", "p99_signal", "threshold", "flagged_p50", "flagged_p99")
_ENGINE = (
    "steps",
    *_STALL,
    "stall_share",
    "decode_step_p50_ms",
    "mixed_step_p50_ms",
    "kv_used_p90",
    "kv_used_max",
    "preemptions",
    "batch_size_mean",
    "queue_depth_max",
)
QUERIES: dict[str, Query] = {
    "budget_summary": Query(budget_summary, (*_SUMMARY_HEAD, "client_harnesses", *_SUMMARY_TAIL)),
    "budget_summary_rollup": Query(budget_summary_rollup, (*_SUMMARY_HEAD, "client_harnesses", *_SUMMARY_TAIL)),
    "tail_attribution": Query(tail_attribution, (*_TAIL, "ttft_median", *(f"{c}_median" for c in _COMP_NAMES))),
    "decode_stalls": Query(decode_stalls, ("baseline_ms", "steps", *_STALL)),
    "diagnosis_figures": Query(
        diagnosis_figures,
        (
            "requests",
            "errors",
            "with_client",
            "good",
            "window_s",
            "prefix_hit_rate",
            "preempted_share",
            "models",
            "client_harnesses",
            *(f"{name}_q" for name, _ in DIAGNOSIS_FIGURES),
        ),
    ),
    "diagnosis_target": Query(diagnosis_target, ("server_address", "server_port")),
    "diagnosis_engine": Query(diagnosis_engine, _ENGINE),
    "diagnosis_causes": Query(diagnosis_causes, _CAUSES),
    "diagnosis_causes_rollup": Query(diagnosis_causes_rollup, _CAUSES, panel=True),
    "diagnosis_engine_rollup": Query(diagnosis_engine_rollup, _ENGINE),
    "decode_stalls_rollup": Query(decode_stalls_rollup, ("baseline_ms", "steps", *_STALL)),
    "budget_stack": Query(budget_stack, ("statistic", *_COMP_NAMES), panel=True),
    "pd_budget_stack": Query(pd_queries.pd_budget_stack, ("statistic", *pd_queries.TTFT_TERMS)),
    "pd_budget_stack_rollup": Query(
        pd_queries.pd_budget_stack_rollup, ("statistic", *pd_queries.TTFT_TERMS), panel=True
    ),
    "pd_hops": Query(pd_queries.pd_hops, ("prefill_hop_ms", "decode_hop_ms")),
    "latency_over_time": Query(latency_over_time, ("time", *_LATENCY), panel=True),
    "delivery_over_time": Query(
        delivery_over_time,
        ("time", "loop_wait_p90_ms", "encode_p90_ms", "write_p90_ms", "first_chunk_p90_ms", "residual_p90_ms"),
        panel=True,
    ),
    "goodput_over_time": Query(goodput_over_time, _GOODPUT, panel=True),
    "throughput_over_time": Query(
        throughput_over_time,
        ("time", "requests_per_s", "errors_per_s", "input_tokens_per_s", "output_tokens_per_s"),
        panel=True,
    ),
    "slowest_requests": Query(slowest_requests, _SLOWEST),
    "slowest_requests_rollup": Query(slowest_requests_rollup, _SLOWEST, panel=True),
    "engine_batch_over_time": Query(
        engine_batch_over_time,
        (
            "time",
            "batch_size_mean",
            "batch_size_max",
            "prefill_tokens_per_step",
            "decode_tokens_per_step",
            "steps_per_s",
        ),
        panel=True,
    ),
    "engine_kv_over_time": Query(
        engine_kv_over_time,
        ("time", "kv_used_ratio_mean", "kv_used_ratio_max", "kv_blocks_used_max", "preemptions"),
        panel=True,
    ),
    "decode_stalls_over_time": Query(decode_stalls_over_time, ("time", *_STALL), panel=True),
    "queue_depth_over_time": Query(queue_depth_over_time, ("time", "queue_depth_mean", "queue_depth_max"), panel=True),
    "request_trace": Query(
        request_trace,
        (
            "traceID",
            "spanID",
            "parentSpanID",
            "serviceName",
            "operationName",
            "startTime",
            "duration",
            "tags",
            "serviceTags",
            "statusCode",
        ),
        panel=True,
    ),
    "budget_by_model": Query(
        budget_by_model,
        ("model", "requests", "errors", "ttft_p50_ms", "ttft_p99_ms", *(f"{c}_mean" for c in _COMP_NAMES)),
    ),
    "ttft_vs_prompt_length": Query(
        ttft_vs_prompt_length,
        ("prompt_tokens_from", "requests", "ttft_p50_ms", "ttft_p99_ms", "prefill_p50_ms", "prefill_ms_per_1k_tokens"),
    ),
    "queueing_vs_load": Query(
        queueing_vs_load, ("time", "arrivals_per_s", "queue_p50_ms", "queue_p99_ms", "queue_share_of_ttft")
    ),
    "goodput_per_minute": Query(goodput_per_minute, _GOODPUT, defaults={"bucket_s": 60}),
    "request_spans": Query(
        request_spans,
        (
            "service",
            "span",
            "kind",
            "span_id",
            "parent_span_id",
            "offset_ms",
            "duration_ms",
            "status",
            "role",
            "instance",
        ),
    ),
    "naive_ttft": Query(naive_ttft, ("trace_id", "naive_ttft_ms")),
    "report_points": Query(
        report_points,
        (
            "trace_id",
            "input_tokens",
            "client_ttft_ms",
            "server_ttft_ms",
            "client_tpot_ms",
            "server_tpot_ms",
            "prefill_ms",
            "ttft_ms",
            "has_server",
        ),
    ),
    "report_steps": Query(report_steps, ("t_ns", "prefill_tokens", "decode_tokens")),
    "services": Query(services, ("service",)),
    "models": Query(models, ("model",)),
}
PANEL_COLUMNS: dict[str, tuple[str, ...]] = {name: q.columns for name, q in QUERIES.items() if q.panel}
FILTERS = frozenset(
    {
        "database",
        "service",
        "model",
        "since",
        "bucket_s",
        "limit",
        "ttft_slo_ms",
        "tpot_slo_ms",
        "trace_id",
        "bucket_tokens",
        "approx",
    }
)


def _query(name: str) -> Query:
    try:
        return QUERIES[name]
    except KeyError:
        raise QueryError(f"unknown query {name!r}; known: {', '.join(sorted(QUERIES))}") from None


def render_cli(name: str, **filters: str | float | None) -> tuple[str, Filters]:
    """(sql, parameters) for clickhouse-connect's `query(sql, parameters=...)`; user values are
    only ever bound server-side, never formatted into the SQL."""
    query = _query(name)
    unknown = set(filters) - FILTERS
    if unknown:
        raise QueryError(f"unknown filter(s) {sorted(unknown)}; known: {sorted(FILTERS)}")
    merged = {**query.defaults, **{k: v for k, v in filters.items() if v is not None}}
    d = CliDialect(merged, database=str(merged.get("database", "otel")))
    return query.template(d), d.parameters


def render_grafana(name: str, database: str = "otel") -> str:
    """The panel SQL with Grafana's macros and the dashboard variables ${service}, ${model},
    ${ttft_slo_ms}, ${tpot_slo_ms}, ${trace_id}."""
    return _query(name).template(GrafanaDialect(database))
