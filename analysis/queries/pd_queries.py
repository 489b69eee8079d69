"""The queries of the disaggregated TTFT budget (docs/disaggregation.md#the-budget-across-machines), over
`phaselens_requests`: `pd_summary` for `phaselens budget` (analysis.budget.pd_budget), `pd_budget_stack` (exact)
and `pd_budget_stack_rollup` (the Grafana panel: the rollups' states, `pd_rollup_terms`), `pd_hops` for
the report's waterfall (registered in analysis.queries.catalog).

A request counts when it went through both instances and every term is known (`complete`):

    client TTFT = inbound_ms + client_ms + client_late_est_ms + residual_ms + Σ PD_TERMS
(each term a duration on one clock; analysis.schema.pd_schema; the edges, docs/budget-method.md, count 0
where nobody stamped them), so the mean row adds up to the mean client TTFT. An edge no complete request
of the selection stamped (its witness, the edge's column over the complete requests, has a NULL mean)
is NULL at every statistic: unobserved, never 0.
"""

from __future__ import annotations

from phaselens.analysis import terms
from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.schema.schema import REQUESTS_VIEW

# the edges (the router's kernel/dispatch wait, the client's own time and its estimated wait TCP's
# coalescing hid), the residual, then PD_TERMS (analysis/terms.py)
TTFT_TERMS = tuple(t.name for t in terms.REGISTRY.pd_terms())
_TERM_SQL = {t.name: t.sql for t in terms.REGISTRY.pd_terms()}
# the edges counted 0 where unstamped → the column whose mean over the complete requests witnesses them
_WITNESS = {t.name: t.column for t in terms.REGISTRY.pd_gated()}
SIDE = ("client_ttft_ms", "kv_bytes", "kv_bytes_received", "decode_itl_p99_ms", "decode_stall_ms", "kv_receive_ms")
# every term but an edge nobody stamped (it counts 0), and the client's TTFT
_REQUIRED = (*(t.name for t in terms.REGISTRY.pd_terms() if t.sql == t.column), "client_ttft_ms")
COMPLETE = " AND ".join(f"{t} IS NOT NULL" for t in _REQUIRED)
# What disaggregation adds to a request's TTFT: the transfer, the prefill answer, the hops, the router.
ADDED_BY_DISAGG: tuple[str, ...] = ("kv_wait_ms", "kv_transfer_ms", "prefill_respond_ms", "prefill_hop_ms")
ADDED_BY_DISAGG += ("decode_hop_ms", "router_ingress_ms", "router_gap_ms", "router_relay_ms")
_LABELS = "['p50', 'p90', 'p99', 'mean']"  # the statistics of a budget stack, one row each


def _value(column: str) -> str:
    """A term's value in a budget row: an edge nobody stamped counts 0, so the mean row still adds up
    to client TTFT."""
    return _TERM_SQL.get(column, column)


def _observed(term: str, stats: str, witness_mean: str, unobserved: str = "NULL") -> str:
    """`stats` of a term, or `unobserved` where the term is an edge no request of the read stamped
    (`witness_mean` of its _WITNESS column is NULL)."""
    return stats if term not in _WITNESS else f"if({witness_mean} IS NULL, {unobserved}, {stats})"


def _selection(d: Dialect) -> str:
    """The disaggregated requests of the time range and model, with their `complete` flag."""
    where = f"prefill_instance IS NOT NULL AND {d.time_filter('server_start_time')} AND {d.match('model', 'model')}"
    return f"SELECT *, {COMPLETE} AS complete FROM {d.table(REQUESTS_VIEW)} WHERE {where}"


def _summary_stats(c: str) -> str:
    """`{c}_q` (p50, p90, p99) and `{c}_mean` over the complete requests; NULL where unobserved."""
    witness = f"avgIf({_WITNESS.get(c)}, complete)"
    qs = f"quantilesExactInclusiveIf(0.5, 0.9, 0.99)({_value(c)}, complete)"
    return (
        f"{_observed(c, qs, witness, '[NULL, NULL, NULL]')} AS {c}_q, "
        f"{_observed(c, f'avgIf({_value(c)}, complete)', witness)} AS {c}_mean"
    )


def pd_summary(d: Dialect) -> str:
    """One row: counts, then each term's p50/p90/p99 and mean over the complete requests."""
    stats = ",\n    ".join(_summary_stats(c) for c in (*TTFT_TERMS, *SIDE))
    return (
        f"SELECT count() AS requests, countIf(complete) AS complete_requests, countIf(status = 'error') AS errors,\n"
        "    uniqExact(prefill_instance) AS prefill_instances, uniqExactIf(decode_instance, decode_instance IS NOT NULL)"
        " AS decode_instances,\n"
        "    countIf(complete AND kv_bytes != kv_bytes_received) AS kv_bytes_mismatch,\n"
        "    arraySort(groupUniqArray(pd_span_model)) AS span_models,\n"
        f"    {stats}\n"
        f"FROM ({_selection(d)})"
    )


def pd_budget_stack(d: Dialect) -> str:
    """The TTFT terms of the complete disaggregated requests at p50/p90/p99 (each its own percentile)
    and the mean (whose terms add up to the mean client TTFT): one row per statistic."""
    arrays = ", ".join(
        _observed(
            t,
            f"arrayPushBack(quantilesExactInclusive(0.5, 0.9, 0.99)({_value(t)}), avg({_value(t)}))",
            f"avg({_WITNESS.get(t)})",
            "[NULL, NULL, NULL, NULL]",
        )
        for t in TTFT_TERMS
    )
    cols = ", ".join(f"tupleElement(row, {i + 2}) AS {t}" for i, t in enumerate(TTFT_TERMS))
    return (
        f"SELECT tupleElement(row, 1) AS statistic, {cols}\n"
        f"FROM (SELECT arrayJoin(arrayZip({_LABELS}, {arrays})) AS row\n"
        f"    FROM ({_selection(d)}) WHERE complete)"
    )


# The rollup's P/D state columns (analysis.rollup.rollup): DDSketch and mean states of each of TTFT_TERMS
# (positions in that order), then of each edge's witness (`pd_witness_position`), over the complete
# requests; append-only, as the rollup's own terms.
PD_QUANTILES_COLUMN, PD_MEANS_COLUMN = "pd_terms_qs", "pd_terms_avg"
# a request that went router -> prefill -> decode with every term known (one column: its condition
# written once per term cost the rollup's passes more analysis than the rest of their query)
PD_COMPLETE = f"prefill_instance IS NOT NULL AND {COMPLETE}"


# term → its slot, and an edge's → its witness's slot (analysis/terms.py checks they run 1..n)
_AT = {t.name: t.pd_position for t in terms.REGISTRY.pd_terms() if t.pd_position is not None}
_WITNESS_AT = {t.name: t.pd_witness_position for t in terms.REGISTRY.pd_gated() if t.pd_witness_position is not None}


def pd_rollup_terms() -> list[str]:
    """By slot: each TTFT term's value, or an edge's witness column (_WITNESS), of a request whose
    `pd_complete` column (PD_COMPLETE) is true, NULL for any other (the rollup's states skip it)."""
    slots = {**{_AT[t]: _value(t) for t in TTFT_TERMS}, **{_WITNESS_AT[t]: c for t, c in _WITNESS.items()}}
    return [f"if(pd_complete, {slots[i]}, NULL)" for i in sorted(slots)]


def _rolled_up_stats(position: int) -> list[str]:
    """p50, p90, p99 (sketch) and mean of the P/D rollup's slot `position`."""
    return [*(sk.quantile_at(position, level, "pd_q") for level in sk.LEVELS), f"pd_mean[{position}]"]


def pd_budget_stack_rollup(d: Dialect) -> str:
    """pd_budget_stack from the rollups: each term's p50/p90/p99 from its DDSketch states (within
    sketch.ALPHA of the value), the mean exact; the range widened to whole minutes of the requests'
    start, filtered by model (not service, as the exact query)."""
    merged = f"{sk.merged_quantiles(PD_QUANTILES_COLUMN)} AS pd_q, avgForEachMerge({PD_MEANS_COLUMN}) AS pd_mean"
    arrays = ", ".join(
        f"[{', '.join(_observed(t, s, f'pd_mean[{_WITNESS_AT.get(t)}]') for s in _rolled_up_stats(_AT[t]))}]"
        for t in TTFT_TERMS
    )
    cols = ", ".join(f"tupleElement(row, {i + 2}) AS {t}" for i, t in enumerate(TTFT_TERMS))
    return (
        f"SELECT tupleElement(row, 1) AS statistic, {cols}\n"
        f"FROM (SELECT {merged}, arrayJoin(arrayZip({_LABELS}, {arrays})) AS row\n"
        f"    FROM {d.table(sk.STATES_VIEW)}\n    WHERE {d.bucket_filter('bucket')} AND {d.match('model', 'model')})"
    )


def pd_hops(d: Dialect) -> str:
    """The hops of one request (`trace_id`) as the P/D budget has them, for the report's waterfall:
    NULL for a colocated request."""
    return (
        f"SELECT prefill_hop_ms, decode_hop_ms FROM {d.table(REQUESTS_VIEW)}\n"
        f"WHERE trace_id = {d.value('trace_id', 'String')}\nLIMIT 1"
    )
