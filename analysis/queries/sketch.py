"""The approximation the budget rollups make, in one place: the quantile sketch, the log buckets of
the goodput and tail histograms, and the names of the rollup's state columns.

Quantiles: ClickHouse's DDSketch (`quantilesDD`) with relative accuracy ALPHA = 1 %: the value it
returns for level q lies within ALPHA × |x| of x, an order statistic next to rank q·(n − 1) (the exact
path interpolates between those two), for every term of a nanosecond or more (SCALE). Sketches of one minute merge into sketches of any window
without losing accuracy (bucket counts add), so a budget over a day or over 2 shards is as accurate
as over one minute.

Histograms (goodput and tail): a value x > 0 falls in bucket i = ⌈log_γ x⌉, γ = (1 + ALPHA) / (1 − ALPHA),
i.e. x ∈ (γ^(i−1), γ^i], at most 2 % wide; x ≤ 0 (or NULL, for TPOT) in bucket −OFFSET.
    goodput: the requests of the (TTFT, TPOT) buckets under both SLOs, and of a bucket an SLO falls
             in the share of it under the SLO (log scale): only requests within 2 % of an SLO may be
             counted on the wrong side;
    tail:    the requests of the TTFT buckets above the p99, and of the bucket it falls in the share
             above it: only requests within 2 % of the p99 may be counted on the wrong side.
"""

from __future__ import annotations

import math

ALPHA = 0.01
LEVELS = (0.5, 0.9, 0.99)
GAMMA = (1 + ALPHA) / (1 - ALPHA)
OFFSET = 2048  # bucket indexes −OFFSET … OFFSET − 1 cover e^±41: every duration in ms there is
SLO_STRIDE = 2 * OFFSET  # a goodput key is ttft_bucket × SLO_STRIDE + tpot_bucket
_PARAMS = f"({ALPHA}, {', '.join(map(str, LEVELS))})"
# ClickHouse's quantilesDD keeps its bound only for |x| ≥ 1 (measured on 26.9: 2.6 % off at x ≈ 0.79
# with ALPHA = 1 %; within 1 % once scaled): the terms are sketched in ns, so every duration of a
# nanosecond or more is.
SCALE = 1e6
NOTE = (
    f"approximate: quantiles from DDSketch rollups (relative error ≤ {ALPHA:.0%} of the value); goodput and "
    f"tail from {GAMMA - 1:.0%}-wide log buckets (a request within {GAMMA - 1:.0%} of an SLO or of the p99 "
    "may be counted on the wrong side); decode stalls against a baseline within "
    f"{ALPHA:.0%} (each mixed step's extra off by at most that); counts, sums and means exact; --exact reads "
    "every request"
)

PANEL_NOTE = (
    f"From the per-minute rollups: percentiles from DDSketch states within {ALPHA:.0%} of the value, goodput "
    f"exact but for requests within {GAMMA - 1:.0%} of an SLO; counts, rates and means exact; a point per "
    "minute at least."
)

ROLLUP_TABLE = "phaselens_budget_rollup"  # sealed minutes: -State aggregates per minute × group
PENDING_TABLE = "phaselens_request_pending"  # recent partial request rows, stamped with their insert time
LIVE_TABLE = "phaselens_budget_live"  # the states of the requests not sealed yet, as of its last refresh
STATES_LOCAL = "phaselens_budget_states_local"  # this node's rollup + its live states
STATES_CURRENT = "phaselens_budget_states_current"  # of those, what a read may merge (never a request twice)
STATES_VIEW = "phaselens_budget_states"  # what the budget reads: the local view, or every shard's
STEPS_ROLLUP_TABLE = "phaselens_steps_rollup"  # engine steps: -State aggregates per minute × service
STEPS_STATES_VIEW = "phaselens_steps_states"  # what the rollup reads of the steps: this node's, or every shard's
QUANTILES_COLUMN = "terms_qs"  # DDSketch states of every term, by position (queries.ROLLUP_POSITIONS)
MEANS_COLUMN = "terms_avg"  # avg states of every term, by position
MERGED_QUANTILES, MERGED_MEANS = "terms_q", "terms_mean"  # their merges in a read
SKETCH_TYPE = f"AggregateFunction(quantilesDDForEach{_PARAMS}, Array(Nullable(Float64)))"
MEANS_TYPE = "AggregateFunction(avgForEach, Array(Nullable(Float64)))"


def quantiles_state(exprs: list[str]) -> str:
    """The -State of every term in ms (NULLs skipped), one sketch per array position (-ForEach),
    sketched in ns (SCALE). One aggregate over all terms, not one per term: ClickHouse plans each
    aggregate of a query separately, and per-term states made the planning of every read (~0.1 s
    of CPU for the summary) its whole cost."""
    values = ", ".join(f"CAST(({e}) * {SCALE} AS Nullable(Float64))" for e in exprs)
    return f"quantilesDDForEachState{_PARAMS}([{values}])"


def means_state(exprs: list[str]) -> str:
    """The avg -State of every term in ms, one per array position (NULLs skipped)."""
    return f"avgForEachState([{', '.join(f'CAST(({e}) AS Nullable(Float64))' for e in exprs)}])"


def merged_states() -> str:
    """The merged sketches (Array(Array(Float64)) in ns) and means (Array(Nullable(Float64)), ms) of
    a read, under the names quantiles_at / mean_at use. Rows of an older, shorter term list merge
    with newer ones (-ForEach pads): a term they lack has an empty sketch and a NULL mean there."""
    return (
        f"{merged_quantiles(QUANTILES_COLUMN)} AS {MERGED_QUANTILES}, avgForEachMerge({MEANS_COLUMN}) AS {MERGED_MEANS}"
    )


def merged_quantiles(column: str) -> str:
    """The merged sketches of a -ForEach quantile state column (Array(Array(Float64)), in ns)."""
    return f"quantilesDDForEachMerge{_PARAMS}({column})"


def quantiles_at(position: int) -> str:
    """The [p50, p90, p99] (ms) of the term stored at `position` (1-based) of a read's merged states."""
    return f"arrayMap(v -> v / {SCALE}, {MERGED_QUANTILES}[{position}])"


def quantile_at(position: int, level: float, merged: str = MERGED_QUANTILES) -> str:
    """One of LEVELS of the term at `position` of `merged`: NULL where the term has no sketch (no
    rows: an empty array) or an empty one (rows, none with the term: quantilesDD gives NaN)."""
    return f"ifNotFinite(arrayElementOrNull({merged}[{position}], {LEVELS.index(level) + 1}) / {SCALE}, NULL)"


def mean_at(position: int) -> str:
    """The exact mean (ms) of the term at `position` (NULL where no request had it)."""
    return f"{MERGED_MEANS}[{position}]"


def bucket_index(x: str) -> str:
    """SQL: the log-bucket index of x, shifted by OFFSET into 0 … 2·OFFSET − 1 (UInt32)."""
    raw = f"ceil(log({x}) / {math.log(GAMMA)!r})"
    clamped = f"ifNull(if({x} > 0, least(greatest({raw}, -{OFFSET}), {OFFSET - 1}), NULL), -{OFFSET})"
    return f"toUInt32({clamped} + {OFFSET})"


def share_below(value: str, index: str) -> str:
    """SQL: the share of the bucket with shifted index `index` that lies at or below `value`, on the
    log scale (0 below the bucket, 1 above it): the requests of the bucket an SLO or the p99 falls
    in are split in this proportion, as if spread evenly over log x inside it."""
    lower = f"(toInt32({index}) - {OFFSET + 1})"
    return f"least(greatest(log({value}) / {math.log(GAMMA)!r} - {lower}, 0), 1)"
