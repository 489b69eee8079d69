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
SKETCH_TYPE = f"AggregateFunction(quantilesDD{_PARAMS}, Nullable(Float64))"
# ClickHouse's quantilesDD keeps its bound only for |x| ≥ 1 (measured on 26.9: 2.6 % off at x ≈ 0.79
# with ALPHA = 1 %; within 1 % once scaled): the terms are sketched in ns, so every duration of a
# nanosecond or more is.
SCALE = 1e6
NOTE = (
    f"approximate: quantiles from DDSketch rollups (relative error ≤ {ALPHA:.0%} of the value); goodput and "
    f"tail from {GAMMA - 1:.0%}-wide log buckets (a request within {GAMMA - 1:.0%} of an SLO or of the p99 "
    "may be counted on the wrong side); counts, sums and means exact; --exact reads every request"
)

ROLLUP_TABLE = "phaselens_budget_rollup"  # sealed minutes: -State aggregates per minute × group
PENDING_TABLE = "phaselens_request_pending"  # recent partial request rows, stamped with their insert time
LIVE_TABLE = "phaselens_budget_live"  # the states of the requests not sealed yet, as of its last refresh
STATES_LOCAL = "phaselens_budget_states_local"  # this node's rollup + its live states (a Merge table)
STATES_VIEW = "phaselens_budget_states"  # what the budget reads: the local view, or every shard's


def quantile_state(expr: str) -> str:
    """The -State of a term in ms (NULLs skipped), sketched in ns (SCALE)."""
    return f"quantilesDDState{_PARAMS}(CAST(({expr}) * {SCALE} AS Nullable(Float64)))"


def merge_quantiles(column: str) -> str:
    """The p50, p90, p99 array (ms) of a quantile state column (the -Merge must name the state's own
    levels: a Nullable state does not merge under other ones)."""
    return f"arrayMap(v -> v / {SCALE}, quantilesDDMerge{_PARAMS}({column}))"


def merge_quantile(column: str, level: float) -> str:
    """One of LEVELS of a quantile state column."""
    return f"{merge_quantiles(column)}[{LEVELS.index(level) + 1}]"


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


def quantile_column(term: str) -> str:
    return f"{term}_qs"


def mean_column(term: str) -> str:
    return f"{term}_avg"
