"""The budget rollups' columns (analysis/rollup/rollup.py makes the tables; the approximation is in
`sketch`) and the queries that read them: the summary, the verdict, the time series.
"""

from __future__ import annotations

from phaselens.analysis import terms
from phaselens.analysis import thresholds as th
from phaselens.analysis.queries import pd_queries
from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.budget import HARNESS, request_component
from phaselens.analysis.queries.diagnosis import DIAGNOSIS_FIGURES, DIAGNOSIS_LEVELS, causes
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import COMPONENTS, DISTRIBUTIONS, ERROR, NO_OUTPUT, slo_value, where, window_s
from phaselens.analysis.queries.steps import diagnosis_engine_rollup

# Every term the rollups keep a DDSketch and a mean of: each distribution of the budget, then the
# diagnosis figures the distributions do not already hold (their own names, `diag_` first), and
# the first chunk where it was stamped. A term added to DISTRIBUTIONS is rolled up too, with no
# other change: the rollup DDL, the sealing query and the reads below are all generated from this.
_DIST_EXPRS = {expr for _, expr in DISTRIBUTIONS}
ROLLUP_TERMS: tuple[tuple[str, str], ...] = (
    *DISTRIBUTIONS,
    *((f"diag_{name}", expr) for name, expr in DIAGNOSIS_FIGURES if expr not in _DIST_EXPRS),
    ("first_chunk_stamped_ms", "first_chunk_ms"),
)
# Where each rolled-up series's sketch and mean are stored in the rollup's arrays (1-based):
# append-only, since rows already sealed keep their positions. A budget term declares its own
# (analysis/terms.py); the other series are placed here. A series added above takes the next free
# position (tests/test_rollup.py checks every one has a position); one removed keeps its position,
# stored as NULL.
_SERIES_POSITIONS = {
    **{"ttft_ms": 1, "client_ttft_ms": 2, "server_ttft_ms": 3, "client_ttfo_ms": 4, "server_ttfc_ms": 5},
    **{"client_observed_ms": 23, "held_back_observed_ms": 24, "e2e_residual_ms": 25, "client_tpot_ms": 26},
    **{"server_tpot_ms": 27, "client_itl_p99_ms": 28, "server_itl_p99_ms": 29, "client_e2e_ms": 30},
    **{"server_e2e_ms": 31, "stall_ms": 32, "queue_all_waits_ms": 33, "diag_tpot_ms": 34, "diag_e2e_ms": 35},
    **{"diag_input_tokens": 36, "diag_output_tokens": 37, "diag_prefill_ms": 38, "diag_ingress_ms": 39},
    **{"first_chunk_stamped_ms": 40, "client_late_est_observed_ms": 42, "diag_client_ms": 43},
    **{"client_end_read_ms": 44},
}


def _in_position_order(positions: dict[str, int]) -> tuple[str, ...]:
    """Names ordered by their 1-based position; a gap or a position taken twice is an error."""
    order = sorted(positions, key=positions.__getitem__)
    if [positions[name] for name in order] != list(range(1, len(order) + 1)):
        raise ValueError(f"rollup positions must run 1..{len(order)} without a gap or a repeat: {positions}")
    return tuple(order)


ROLLUP_POSITIONS = _in_position_order({**_SERIES_POSITIONS, **terms.REGISTRY.rollup_positions()})
# Counters: (column, condition on a request)
ROLLUP_COUNTS = (
    ("requests", "1"),
    ("with_client", "has_client"),
    ("with_server", "has_server"),
    ("errors", ERROR),
    ("ok_requests", "status = 'ok'"),
    ("no_output", NO_OUTPUT),
    ("preempted", "preemptions > 0"),
)
# Sums: (column, value of a request; NULL counts 0)
ROLLUP_SUMS = (
    ("input_tokens_sum", "input_tokens"),
    ("output_tokens_sum", "output_tokens"),
    ("cached_tokens_sum", "cached_tokens"),
)
_TTFT_BUCKET = sk.bucket_index("ttft_ms")
# goodput: one count per (TTFT bucket, TPOT bucket) of the requests that could meet an SLO at all
_SLO_KEY = f"toUInt32({_TTFT_BUCKET} * {sk.SLO_STRIDE} + {sk.bucket_index('tpot_ms')})"
_CAN_MEET_SLO = "status = 'ok' AND ttft_ms IS NOT NULL"
# tail: per TTFT bucket, the count, Σ TTFT, and per component Σ value and the count of values
_TAIL_VALUES = ("1", "ttft_ms", *(v for _, expr in COMPONENTS for v in (f"ifNull({expr}, 0)", f"{expr} IS NOT NULL")))


# slowest requests: each rollup row keeps the SLOWEST_KEPT slowest of its requests by TTFT (NULLs last),
# so the merge over a window's rows is that window's slowest, exactly (whole minutes)
SLOWEST_KEPT = 50
DOMINANT = ", ".join(f"('{name.removesuffix('_ms')}', coalesce({expr}, 0))" for name, expr in COMPONENTS)
SLOWEST_FIELDS: tuple[tuple[str, str, str], ...] = (  # (column, type, expression over the facts)
    ("trace_id", "String", "trace_id"),
    ("request_id", "Nullable(String)", "request_id"),
    ("start_time", "Nullable(DateTime64(9))", "start_time"),
    ("service", "Nullable(String)", "service"),
    ("model", "Nullable(String)", "model"),
    ("status", "String", "status"),
    ("ttft_ms", "Nullable(Float64)", "ttft_ms"),
    ("client_ttft_ms", "Nullable(Float64)", "client_ttft_ms"),
    ("server_ttft_ms", "Nullable(Float64)", "server_ttft_ms"),
    *((name, "Nullable(Float64)", request_component(name, expr)) for name, expr in COMPONENTS),
    ("dominant_phase", "String", f"tupleElement(arrayReverseSort(x -> tupleElement(x, 2), [{DOMINANT}])[1], 1)"),
    ("input_tokens", "Nullable(UInt32)", "input_tokens"),
    ("output_tokens", "Nullable(UInt32)", "output_tokens"),
    ("preemptions", "Nullable(UInt32)", "preemptions"),
    ("client_e2e_ms", "Nullable(Float64)", "client_e2e_ms"),
    ("client_harness", "Nullable(String)", "client_harness"),
    ("x_request_id", "Nullable(String)", "x_request_id"),
)
_SLOWEST_TYPE = f"Tuple(Float64, {', '.join(t for _, t, _ in SLOWEST_FIELDS)})"
_SLOWEST_TUPLE = "tuple(-ifNull(ttft_ms, -inf), " + ", ".join(f"CAST({e} AS {t})" for _, t, e in SLOWEST_FIELDS) + ")"


def rollup_key() -> tuple[tuple[str, str], ...]:
    """The rollup's key columns: (name, expression over the per-request facts)."""
    return (
        ("bucket", "toStartOfMinute(start_time)"),
        ("service", "ifNull(service, '')"),
        ("model", "ifNull(model, '')"),
        ("span_model", "ifNull(span_model, '')"),
    )


def rollup_columns() -> tuple[tuple[str, str, str], ...]:
    """Every state column of the rollup: (name, ClickHouse type, aggregate over per-request facts)."""
    counts = tuple((name, "SimpleAggregateFunction(sum, UInt64)", f"countIf({cond})") for name, cond in ROLLUP_COUNTS)
    sums = tuple(
        (name, "SimpleAggregateFunction(sum, Float64)", f"sum(toFloat64(ifNull({expr}, 0)))")
        for name, expr in ROLLUP_SUMS
    )
    window = (
        ("first_server_start", "SimpleAggregateFunction(min, Nullable(DateTime64(9)))", "min(server_start_time)"),
        ("last_server_end", "SimpleAggregateFunction(max, Nullable(DateTime64(9)))", "max(server_end_time)"),
    )
    exprs = dict(ROLLUP_TERMS)
    stored = [exprs.get(name, "NULL") for name in ROLLUP_POSITIONS]
    terms = (
        (sk.QUANTILES_COLUMN, sk.SKETCH_TYPE, sk.quantiles_state(stored)),
        (sk.MEANS_COLUMN, sk.MEANS_TYPE, sk.means_state(stored)),
    )
    slowest = (
        "slowest",
        f"AggregateFunction(groupArraySorted({SLOWEST_KEPT}), {_SLOWEST_TYPE})",
        f"groupArraySortedState({SLOWEST_KEPT})({_SLOWEST_TUPLE})",
    )
    # goodput: (key, count) pairs, a row's summed at sealing; rows' pairs are concatenated, not merged
    # into a map (sumMap's merge was most of a 10M-request budget's CPU)
    slo = f"sumMap(if({_CAN_MEET_SLO}, [{_SLO_KEY}], []), if({_CAN_MEET_SLO}, [toUInt64(1)], []))"
    tail_arrays = ", ".join(f"if(ttft_ms IS NULL, [], [toFloat64(assumeNotNull({v}))])" for v in _TAIL_VALUES)
    hists = (
        (
            "slo_pairs",
            "SimpleAggregateFunction(groupArrayArray, Array(Tuple(UInt32, UInt64)))",
            f"arrayZip({slo}.1, {slo}.2)",
        ),
        (
            "tail_hist",
            f"AggregateFunction(sumMap, Array(UInt32){', Array(Float64)' * len(_TAIL_VALUES)})",
            f"sumMapState(if(ttft_ms IS NULL, [], [{_TTFT_BUCKET}]), {tail_arrays})",
        ),
    )
    harnesses = (
        (
            "client_harnesses",
            "SimpleAggregateFunction(groupUniqArrayArray, Array(String))",
            f"groupUniqArrayIf({HARNESS}, has_client)",
        ),
    )
    pd_terms = pd_queries.pd_rollup_terms()
    disaggregated = (
        (pd_queries.PD_QUANTILES_COLUMN, sk.SKETCH_TYPE, sk.quantiles_state(pd_terms)),
        (pd_queries.PD_MEANS_COLUMN, sk.MEANS_TYPE, sk.means_state(pd_terms)),
    )
    return counts + sums + window + terms + hists + harnesses + (slowest,) + disaggregated


def states(d: Dialect) -> str:
    """FROM + WHERE of the rollup states (sealed minutes and the requests not sealed yet, each once:
    rollup.current_select) under the time, service and model filters; the window is widened to
    whole minutes."""
    return f"FROM {d.table(sk.STATES_VIEW)}\n" + where(
        d.bucket_filter("bucket"), d.match("service", "service"), d.match("model", "model")
    )


def rolled_up_quantiles(term: str, level: float | None = None) -> str:
    """A rolled-up term's [p50, p90, p99], or the one `level` of them (in a SELECT with _merged())."""
    position = ROLLUP_POSITIONS.index(term) + 1
    return sk.quantiles_at(position) if level is None else sk.quantile_at(position, level)


def rolled_up_mean(term: str) -> str:
    return sk.mean_at(ROLLUP_POSITIONS.index(term) + 1)


_MERGED = (sk.MERGED_QUANTILES, sk.MERGED_MEANS)


def _merged(selects: list[str]) -> list[str]:
    """`selects` after the merged term states they read (none when they read no term)."""
    return [sk.merged_states(), *selects] if any(m in s for s in selects for m in _MERGED) else selects


def good_from_hist(d: Dialect) -> str:
    """Requests meeting both SLOs (defaults: common.slo.DEFAULT_SLO), from the goodput histogram:
    each (TTFT, TPOT) bucket counts with the share of it under both SLOs (sketch.share_below)."""
    ttft, tpot = slo_value(d, "ttft", th.DEFAULT_TTFT_SLO_MS), slo_value(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
    ttft_share = sk.share_below(ttft, f"intDiv(k, {sk.SLO_STRIDE})")
    tpot_share = sk.share_below(tpot, f"k % {sk.SLO_STRIDE}")
    pairs = "groupArrayArray(slo_pairs)"
    keys, counts = f"arrayMap(p -> p.1, {pairs})", f"arrayMap(p -> p.2, {pairs})"
    return f"toUInt64(round(arraySum((k, c) -> c * {ttft_share} * {tpot_share}, {keys}, {counts})))"


def _tail_from_hist() -> list[str]:
    """Tail attribution from the tail histogram: the TTFT buckets above the p99, and the share above
    it of the bucket it falls in (one weight per bucket, then a dot product per column)."""
    h = "tail_hist_merged"
    share = f"ifNull(1 - {sk.share_below('threshold_ms', 'k')}, 0)"
    weights = f"arrayMap(k -> if(k > threshold_bucket, 1, if(k = threshold_bucket, {share}, 0)), {h}.1)"

    def above(i: int) -> str:
        return f"arrayDotProduct(tail_weights, {h}.{i})"

    cols = [
        f"{rolled_up_quantiles('ttft_ms', 0.99)} AS threshold_ms",
        f"sumMapMerge(tail_hist) AS {h}",
        f"{sk.bucket_index('threshold_ms')} AS threshold_bucket",
        f"{weights} AS tail_weights",
        f"toUInt64(round({above(2)})) AS tail_requests",
        f"{above(3)} / nullIf({above(2)}, 0) AS ttft_tail_mean",
    ]
    return cols + [
        f"{above(4 + 2 * i)} / nullIf({above(5 + 2 * i)}, 0) AS {name}_tail_mean"
        for i, (name, _) in enumerate(COMPONENTS)
    ]


def _diagnosis_term(name: str, expr: str) -> str:
    """The rolled-up term that holds diagnosis figure `name` (ROLLUP_TERMS)."""
    return next((dist for dist, e in DISTRIBUTIONS if e == expr), f"diag_{name}")


def _diagnosis_figures_rollup(d: Dialect) -> str:
    """What the verdict reads of diagnosis_figures, from the rollups: the p50 and p99 of every
    figure from its sketch (within 1 %), the preempted share exact."""
    qs = ", ".join(
        f"[{', '.join(rolled_up_quantiles(_diagnosis_term(name, expr), level) for level in DIAGNOSIS_LEVELS)}] AS {name}_q"
        for name, expr in DIAGNOSIS_FIGURES
    )
    return (
        f"SELECT * EXCEPT ({', '.join(_MERGED)}) FROM (\nSELECT {sk.merged_states()},\n"
        f"    sum(preempted) / nullIf(sum(requests), 0) AS preempted_share,\n    {qs}\n{states(d)}\n)"
    )


def diagnosis_causes_rollup(d: Dialect) -> str:
    """The verdict (diagnosis_causes) from the rollups: the figures' p50 and p99 from their sketches
    and the engine's from the steps' rollups (within 1 %; stalls: _stall_columns_rollup)."""
    return causes(d, _diagnosis_figures_rollup(d), diagnosis_engine_rollup(d))


def budget_summary_rollup(d: Dialect) -> str:
    """budget_summary's row from the rollups: the same columns, quantiles from merged DDSketches,
    means and counts exact, goodput and tail from the log-bucket histograms (analysis/queries/sketch.py)."""
    dists = ",\n    ".join(
        f"{rolled_up_quantiles(name)} AS {name}_q, {rolled_up_mean(name)} AS {name}_mean" for name, _ in DISTRIBUTIONS
    )
    return (
        f"SELECT * EXCEPT ({', '.join(_MERGED)}, tail_hist_merged, threshold_bucket, tail_weights) FROM (\n"
        f"SELECT {sk.merged_states()},\n    sum(requests) AS requests, sum(with_client) AS with_client, sum(errors) AS errors,\n"
        f"    sum(with_server) AS with_server, {good_from_hist(d)} AS good,\n"
        "    arraySort(groupUniqArrayIf(span_model, span_model != '')) AS span_models,\n"
        "    arraySort(groupUniqArrayArray(client_harnesses)) AS client_harnesses, sum(no_output) AS no_output,\n"
        f"    {window_s('min(first_server_start)', 'max(last_server_end)')} AS window_s,\n    {dists},\n"
        f"    {', '.join(_tail_from_hist())}\n{states(d)}\n)"
    )


def series_rollup(d: Dialect, selects: list[str]) -> str:
    """One row per time bucket of the rollup's minutes (buckets of at least a minute)."""
    body = ",\n    ".join(_merged(selects))
    sql = f"SELECT {d.time_bucket('bucket')} AS time,\n    {body}\n{states(d)}\nGROUP BY time"
    if body.startswith(sk.merged_states()):
        sql = f"SELECT * EXCEPT ({', '.join(_MERGED)}) FROM (\n{sql}\n)"
    return f"{sql}\nORDER BY time"


def bucket_s(d: Dialect) -> str:
    """The length of a series bucket in seconds: the rollup's minute at least."""
    return f"greatest({d.bucket_seconds()}, 60)"
