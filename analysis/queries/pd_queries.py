"""The queries of the disaggregated TTFT budget (docs/disaggregation.md#the-budget-across-machines), over
`phaselens_requests`: `pd_summary` for `phaselens budget` (analysis.budget.pd_budget), `pd_budget_stack` (exact)
and `pd_budget_stack_rollup` (the Grafana panel: the rollups' states, `pd_rollup_terms`), `pd_hops` for
the report's waterfall (registered in analysis.queries.catalog).

A request counts when it went through both instances and every term is known (`complete`):

    client TTFT = inbound_ms + client_ms + client_late_est_ms + residual_ms + Σ PD_TERMS
(each term a duration on one clock; analysis.schema.pd_schema; the edges, docs/budget-method.md, count 0
where nobody stamped them), so the mean row adds up to the mean client TTFT.
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


def _selection(d: Dialect) -> str:
    """The disaggregated requests of the time range and model, with their `complete` flag."""
    where = f"prefill_instance IS NOT NULL AND {d.time_filter('server_start_time')} AND {d.match('model', 'model')}"
    return f"SELECT *, {COMPLETE} AS complete FROM {d.table(REQUESTS_VIEW)} WHERE {where}"


def pd_summary(d: Dialect) -> str:
    """One row: counts, then each term's p50/p90/p99 and mean over the complete requests."""
    stats = ",\n    ".join(
        f"quantilesExactInclusiveIf(0.5, 0.9, 0.99)({_value(c)}, complete) AS {c}_q, avgIf({_value(c)}, complete) AS {c}_mean"
        for c in (*TTFT_TERMS, *SIDE)
    )
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
        f"arrayPushBack(quantilesExactInclusive(0.5, 0.9, 0.99)({_value(t)}), avg({_value(t)}))" for t in TTFT_TERMS
    )
    cols = ", ".join(f"tupleElement(row, {i + 2}) AS {t}" for i, t in enumerate(TTFT_TERMS))
    return (
        f"SELECT tupleElement(row, 1) AS statistic, {cols}\n"
        f"FROM (SELECT arrayJoin(arrayZip({_LABELS}, {arrays})) AS row\n"
        f"    FROM ({_selection(d)}) WHERE complete)"
    )


# The rollup's P/D state columns (analysis.rollup.rollup): DDSketch and mean states of each of TTFT_TERMS
# (positions in that order: append-only, as the rollup's own terms) over the complete requests.
PD_QUANTILES_COLUMN, PD_MEANS_COLUMN = "pd_terms_qs", "pd_terms_avg"
# a request that went router -> prefill -> decode with every term known (one column: its condition
# written once per term cost the rollup's passes more analysis than the rest of their query)
PD_COMPLETE = f"prefill_instance IS NOT NULL AND {COMPLETE}"


def pd_rollup_terms() -> list[str]:
    """Each TTFT term of a request whose `pd_complete` column (PD_COMPLETE) is true, NULL for any
    other (the rollup's states skip it)."""
    return [f"if(pd_complete, {_value(t)}, NULL)" for t in TTFT_TERMS]


def pd_budget_stack_rollup(d: Dialect) -> str:
    """pd_budget_stack from the rollups: each term's p50/p90/p99 from its DDSketch states (within
    sketch.ALPHA of the value), the mean exact; the range widened to whole minutes of the requests'
    start, filtered by model (not service, as the exact query)."""
    merged = f"{sk.merged_quantiles(PD_QUANTILES_COLUMN)} AS pd_q, avgForEachMerge({PD_MEANS_COLUMN}) AS pd_mean"
    arrays = ", ".join(
        f"[{', '.join(sk.quantile_at(i, level, 'pd_q') for level in sk.LEVELS)}, pd_mean[{i}]]"
        for i in range(1, len(TTFT_TERMS) + 1)
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
