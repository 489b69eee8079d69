"""The Grafana panels' queries (the dashboards render these), read from the rollups where a panel
spans a long range.
"""

from __future__ import annotations

from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.budget import request_component
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import (
    COMPONENTS,
    FIRST_CHUNK_SPLIT,
    LEVEL_LABELS,
    LEVELS,
    OBSERVED_BY,
    from_requests,
    meets_slo,
    series,
)
from phaselens.analysis.queries.rollups import (
    DOMINANT,
    SLOWEST_FIELDS,
    SLOWEST_KEPT,
    bucket_s,
    good_from_hist,
    rolled_up_mean,
    rolled_up_quantiles,
    series_rollup,
    states,
)


def _rolled_up_stats(name: str) -> str:
    """[p50, p90, p99, mean] of a rolled-up component, each its own element (always four: a term
    without a sketch is NULL there), all NULL where no request of the read stamped it (OBSERVED_BY)."""
    stats = [*(rolled_up_quantiles(name, level) for level in LEVELS), rolled_up_mean(name)]
    if name in OBSERVED_BY:
        stats = [f"if({rolled_up_mean(OBSERVED_BY[name])} IS NULL, NULL, {s})" for s in stats]
    return f"[{', '.join(stats)}]"


def budget_stack(d: Dialect) -> str:
    """TTFT budget components at p50/p90/p99 (each its own percentile, from the rollups' sketches)
    and the mean (exact: rolled-up sums); no rows for a range without requests."""
    arrays = ", ".join(_rolled_up_stats(name) for name, _ in COMPONENTS)
    cols = ", ".join(f"tupleElement(row, {i + 2}) AS {name}" for i, (name, _) in enumerate(COMPONENTS))
    labels = ", ".join(f"'{label}'" for label in (*LEVEL_LABELS, "mean"))
    return (
        f"SELECT tupleElement(row, 1) AS statistic, {cols}\n"
        f"FROM (SELECT {sk.merged_states()}, arrayJoin(arrayZip([{labels}], {arrays})) AS row\n    {states(d)}\n"
        "    HAVING sum(requests) > 0)"
    )


LATENCY_SERIES = (  # (column, level, rolled-up term)
    ("client_ttft_p50_ms", 0.5, "client_ttft_ms"),
    ("client_ttft_p99_ms", 0.99, "client_ttft_ms"),
    ("server_ttft_p99_ms", 0.99, "server_ttft_ms"),
    ("client_ttfo_p99_ms", 0.99, "client_ttfo_ms"),
    ("client_tpot_p50_ms", 0.5, "client_tpot_ms"),
    ("client_tpot_p99_ms", 0.99, "client_tpot_ms"),
    ("server_tpot_p99_ms", 0.99, "server_tpot_ms"),
    ("client_itl_p99_ms", 0.99, "client_itl_p99_ms"),
    ("server_itl_p99_ms", 0.99, "server_itl_p99_ms"),
    ("client_e2e_p50_ms", 0.5, "client_e2e_ms"),
    ("client_e2e_p99_ms", 0.99, "client_e2e_ms"),
)


def latency_over_time(d: Dialect) -> str:
    return series_rollup(d, [f"{rolled_up_quantiles(term, level)} AS {name}" for name, level, term in LATENCY_SERIES])


def delivery_over_time(d: Dialect) -> str:
    """Where the server's first-chunk time goes (first_chunk = loop_wait + encode; write beside it), against
    the residual (network + client): a starved event loop shows in loop_wait, a slow network or
    client in the residual. p90s from the rollups' sketches."""
    terms = (*FIRST_CHUNK_SPLIT, ("first_chunk_ms", "first_chunk_stamped_ms"), ("residual_ms", "residual_ms"))
    return series_rollup(
        d, [f"{rolled_up_quantiles(term, 0.9)} AS {name.removesuffix('_ms')}_p90_ms" for name, term in terms]
    )


def goodput_over_time(d: Dialect) -> str:
    """Goodput: completed requests per second meeting every SLO; attainment: their fraction (goodput
    histogram of the rollups: a request less than 2 % under an SLO may count as missing it)."""
    s = bucket_s(d)
    return series_rollup(
        d,
        [
            f"{good_from_hist(d)} / {s} AS goodput_rps",
            f"sum(ok_requests) / {s} AS completed_rps",
            f"goodput_rps * {s} / sum(requests) AS slo_attainment",
        ],
    )


def goodput_per_minute(d: Dialect) -> str:
    """goodput_over_time over every request (the cookbook's: exact, and plain SQL to read)."""
    good = f"countIf({meets_slo(d)})"
    return series(
        d,
        "start_time",
        from_requests(d),
        [
            f"{good} / {d.bucket_seconds()} AS goodput_rps",
            f"countIf(status = 'ok') / {d.bucket_seconds()} AS completed_rps",
            f"{good} / count() AS slo_attainment",
        ],
    )


def throughput_over_time(d: Dialect) -> str:
    s = bucket_s(d)
    return series_rollup(
        d,
        [
            f"sum(requests) / {s} AS requests_per_s",
            f"sum(errors) / {s} AS errors_per_s",
            f"sum(input_tokens_sum) / {s} AS input_tokens_per_s",
            f"sum(output_tokens_sum) / {s} AS output_tokens_per_s",
        ],
    )


def slowest_requests(d: Dialect) -> str:
    """The slowest requests by TTFT, each with its budget and the phase that dominated it."""
    parts = DOMINANT
    comps = ", ".join(
        expr if expr == name else f"{expr} AS {name}"
        for name, expr in ((name, request_component(name, expr)) for name, expr in COMPONENTS)
    )
    return (
        f"SELECT trace_id, request_id, start_time, service, model, status, ttft_ms, client_ttft_ms,\n"
        f"    server_ttft_ms, {comps},\n"
        f"    tupleElement(arrayReverseSort(x -> tupleElement(x, 2), [{parts}])[1], 1) AS dominant_phase,\n"
        f"    input_tokens, output_tokens, preemptions, client_e2e_ms, client_harness, x_request_id\n"
        f"{from_requests(d)}\nORDER BY ttft_ms DESC NULLS LAST\nLIMIT {d.limit(50)}"
    )


def slowest_requests_rollup(d: Dialect) -> str:
    """slowest_requests from the rollups: the merge of the rows' kept slowest (at most SLOWEST_KEPT),
    over whole minutes; the same rows as over every request of those minutes."""
    cols = ", ".join(f"r.{i + 2} AS {name}" for i, (name, _, _) in enumerate(SLOWEST_FIELDS))
    return (
        f"SELECT {cols}\nFROM (SELECT arrayJoin(groupArraySortedMerge({SLOWEST_KEPT})(slowest)) AS r\n    {states(d)})\n"
        f"ORDER BY r.1, r.2\nLIMIT {d.limit(SLOWEST_KEPT)}"
    )
