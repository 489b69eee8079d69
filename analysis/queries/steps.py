"""The engine-step rollups' columns (analysis/rollup/step_rollup.py makes the table) and the queries
over the engine steps: the decode stalls and engine figures from the rollup, the engine panels.
"""

from __future__ import annotations

from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.budget import stall_columns, with_baseline
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import from_steps, series, where

_MIXED = "prefill_tokens > 0 AND decode_tokens > 0"
_KV_USED = "kv_blocks_used / nullIf(kv_blocks_total, 0)"
# the step durations and the KV use the steps' rollups sketch, by position (1-based)
STEP_TERMS = (
    ("decode_step_ms", "if(prefill_tokens = 0 AND decode_tokens > 0, duration_ms, NULL)"),
    ("mixed_step_ms", f"if({_MIXED}, duration_ms, NULL)"),
    ("kv_used", _KV_USED),
)
# per log bucket of a mixed step's duration: count, Σ duration, Σ decode tokens, Σ tokens × duration
_MIXED_HIST_VALUES = ("1", "duration_ms", "decode_tokens", "decode_tokens * duration_ms")


def step_rollup_columns() -> tuple[tuple[str, str, str], ...]:
    """Every column of the steps' rollup: (name, ClickHouse type, aggregate over the steps view's columns)."""
    total = "SimpleAggregateFunction(sum, UInt64)"
    hist = ", ".join(f"if({_MIXED}, [toFloat64({v})], [])" for v in _MIXED_HIST_VALUES)
    return (
        ("steps", total, "count()"),
        ("mixed_steps", total, f"countIf({_MIXED})"),
        ("decode_steps", total, "countIf(decode_tokens > 0)"),
        ("delayed_decodes", total, f"sumIf(toUInt64(decode_tokens), {_MIXED})"),
        (
            "decode_token_ms",
            "SimpleAggregateFunction(sum, Float64)",
            "sumIf(decode_tokens * duration_ms, decode_tokens > 0)",
        ),
        ("preemptions", total, "sum(toUInt64(preemptions))"),
        (
            "batch_size_avg",
            "AggregateFunction(avg, Nullable(Float64))",
            "avgState(CAST(batch_size AS Nullable(Float64)))",
        ),
        ("queue_depth_max", "SimpleAggregateFunction(max, Nullable(UInt32))", "max(queue_depth)"),
        ("kv_used_max", "SimpleAggregateFunction(max, Nullable(Float64))", f"max({_KV_USED})"),
        ("step_qs", sk.SKETCH_TYPE, sk.quantiles_state([e for _, e in STEP_TERMS])),
        (
            "mixed_hist",
            f"AggregateFunction(sumMap, Array(UInt32){', Array(Float64)' * len(_MIXED_HIST_VALUES)})",
            f"sumMapState(if({_MIXED}, [{sk.bucket_index('duration_ms')}], []), {hist})",
        ),
    )


def _step_states(d: Dialect) -> str:
    return f"FROM {d.table(sk.STEPS_STATES_VIEW)}\n" + where(d.bucket_filter("bucket"), d.match("service", "service"))


def _step_quantile(term: str, level: float) -> str:
    position = [name for name, _ in STEP_TERMS].index(term) + 1
    return sk.quantile_at(position, level, "step_q")


def _stall_columns_rollup() -> list[str]:
    """_stall_columns from the steps' rollups: the baseline is the decode-only steps' p50 sketch
    (within 1 %); per log bucket of mixed-step durations, extra = Σ duration − baseline × count (and
    Σ tokens × duration − baseline × Σ tokens), 0 for a bucket below the baseline: exact but for the
    mixed steps of the bucket the baseline falls in (within 2 % of it), counted by their sum."""
    h = "mixed_hist_merged"

    def extra(weights: int, sums: int) -> str:  # 0 without a baseline (no decode-only step)
        over = f"(w, t) -> greatest(t - assumeNotNull(baseline_ms) * w, 0), {h}.{weights}, {h}.{sums}"
        return f"if(baseline_ms IS NULL, 0, arraySum({over}))"

    return [
        f"{sk.merged_quantiles('step_qs')} AS step_q",
        f"sumMapMerge(mixed_hist) AS {h}",
        f"{_step_quantile('decode_step_ms', 0.5)} AS baseline_ms",
        "sum(steps) AS steps",
        "sum(mixed_steps) AS mixed_steps",
        "sum(decode_steps) AS decode_steps",
        f"{extra(2, 3)} AS stall_ms",
        f"{extra(4, 5)} AS request_stall_ms",
        "sum(delayed_decodes) AS delayed_decodes",
    ]


def decode_stalls_rollup(d: Dialect) -> str:
    """decode_stalls from the steps' rollups (the approximation: _stall_columns_rollup)."""
    return f"SELECT * EXCEPT (step_q, mixed_hist_merged) FROM (\nSELECT {', '.join(_stall_columns_rollup())}\n{_step_states(d)}\n)"


def diagnosis_engine_rollup(d: Dialect) -> str:
    """diagnosis_engine from the steps' rollups: p50s and the KV p90 from sketches (within 1 %),
    stalls as decode_stalls_rollup, the rest exact."""
    return (
        "SELECT steps, mixed_steps, decode_steps, stall_ms, request_stall_ms, delayed_decodes,\n"
        "    request_stall_ms / nullIf(decode_token_ms, 0) AS stall_share, baseline_ms AS decode_step_p50_ms,\n"
        f"    {_step_quantile('mixed_step_ms', 0.5)} AS mixed_step_p50_ms, {_step_quantile('kv_used', 0.9)} AS kv_used_p90,\n"
        "    kv_used_max, preemptions, batch_size_mean, queue_depth_max\n"
        f"FROM (SELECT {', '.join(_stall_columns_rollup())}, sum(decode_token_ms) AS decode_token_ms,\n"
        "    max(kv_used_max) AS kv_used_max, sum(preemptions) AS preemptions, avgMerge(batch_size_avg) AS batch_size_mean,\n"
        f"    max(queue_depth_max) AS queue_depth_max\n{_step_states(d)})"
    )


def engine_batch_over_time(d: Dialect) -> str:
    return series(
        d,
        "time",
        from_steps(d),
        [
            "avg(batch_size) AS batch_size_mean",
            "max(batch_size) AS batch_size_max",
            "avg(prefill_tokens) AS prefill_tokens_per_step",
            "avg(decode_tokens) AS decode_tokens_per_step",
            f"count() / {d.bucket_seconds()} AS steps_per_s",
        ],
    )


def engine_kv_over_time(d: Dialect) -> str:
    ratio = "kv_blocks_used / nullIf(kv_blocks_total, 0)"
    return series(
        d,
        "time",
        from_steps(d),
        [
            f"avg({ratio}) AS kv_used_ratio_mean",
            f"max({ratio}) AS kv_used_ratio_max",
            "max(kv_blocks_used) AS kv_blocks_used_max",
            "sum(preemptions) AS preemptions",
        ],
    )


def decode_stalls_over_time(d: Dialect) -> str:
    return with_baseline(d, series(d, "time", from_steps(d), stall_columns()[1:]))


def queue_depth_over_time(d: Dialect) -> str:
    return series(
        d, "time", from_steps(d), ["avg(queue_depth) AS queue_depth_mean", "max(queue_depth) AS queue_depth_max"]
    )
