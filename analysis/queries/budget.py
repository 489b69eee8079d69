"""The budget's queries over the per-request facts and the engine steps: the summary (percentiles,
shares, goodput), the tail attribution and the decode stalls (`phaselens budget`, the Python API).

Budget terms (docs/budget-method.md), each a duration on one clock, from `phaselens_request_facts`:
    TTFT_client = inbound + ingress + queue + prefill + first_token + held_back + first_chunk + client
                  + client_late_est + residual,
    held_back = first token → the decode step whose token made the first content visible,
    inbound = the request's bytes in the server's kernel → ingress (server clock, kernel stamp),
    first_chunk = that token handed to the stream → its chunk handed to the server's `send`,
    client = client_send + client_read (client clock): sent → the request's bytes handed to the
    kernel, less a new connection's handshake round trip; the first content bytes in the client's
    kernel → read,
    client_late_est = an ESTIMATE of the client's wait TCP's coalescing hid from client_read (the
    server's send gap from the first content chunk to the chunk whose bytes the client's read
    ended in; analysis/schema/schema.py),
    residual = client_ttft − server_ttfc − inbound − client − client_late_est (network both ways:
    what no stamp explains), server_ttfc = server_ttft + held_back + first_chunk. A request without one of the stamped terms
    (not streamed, a server without the inbound protocol, another client, a span model that does not
    separate it) counts it 0 in the budget: that time stays in the residual, so the mean row still
    adds up exactly; a term no request in the selection has prints as unobserved (`OBSERVED_BY`).
The queue term is `ttft_queue_ms`, the waits before the first token; `queue_ms` counts all waits.
A request's TTFT for ranking and SLOs is the client's when there is a client span, else the server's
(`ttft_ms`); likewise `tpot_ms`.

Decode stalls caused by prefill (from `phaselens_steps`):
    decode-only step:  prefill_tokens = 0 and decode_tokens > 0
    mixed step:        prefill_tokens > 0 and decode_tokens > 0
    baseline_ms      = median (linear interpolation) of decode-only step durations in the selection
    extra_ms(s)      = max(0, duration_ms(s) − baseline_ms), for a mixed step s
    stall_ms         = Σ_s extra_ms(s)                     (engine time lost to prefill work)
    request_stall_ms = Σ_s decode_tokens(s) × extra_ms(s)  (each decoding request in the batch got
                       its next token extra_ms later: one decode token per request per step)
"""

from __future__ import annotations

from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import (
    COMPONENTS,
    DISTRIBUTIONS,
    ERROR,
    NO_OUTPUT,
    STAMPED_BY,
    from_requests,
    from_steps,
    meets_slo,
    quantiles,
    window_s,
)


def _tail_columns() -> list[str]:
    """Tail attribution in the same pass: the p99 of TTFT, then, over the requests above it, the
    mean TTFT and the mean of each component (rows kept as compact tuples, filtered once)."""
    exprs = ", ".join(expr for _, expr in COMPONENTS)
    cols = [
        "quantileExactInclusive(0.99)(ttft_ms) AS threshold_ms",
        (
            f"arrayFilter(r -> r.1 > threshold_ms, groupArrayIf(tuple(ttft_ms, {exprs}), ttft_ms IS NOT NULL)) "
            "AS tail_rows"
        ),
        "length(tail_rows) AS tail_requests",
        f"{_mean_of('arrayMap(r -> r.1, tail_rows)')} AS ttft_tail_mean",
    ]
    return cols + [
        f"{_mean_of(f'arrayMap(r -> r.{i + 2}, tail_rows)')} AS {name}_tail_mean"
        for i, (name, _) in enumerate(COMPONENTS)
    ]


def request_component(name: str, expr: str) -> str:
    """Component `name` (facts expression `expr`) of one request: NULL where that request was not
    stamped with it (STAMPED_BY), `expr` (a missing part counted 0) where it was."""
    stamp = STAMPED_BY.get(name)
    if stamp is None or expr == stamp:
        return expr
    return stamp if expr == f"ifNull({stamp}, 0)" else f"if({stamp} IS NULL, NULL, {expr})"


def _mean_of(array: str) -> str:
    """Mean of the non-NULL elements of an array, NULL when there is none (arrayAvg of an empty array
    is 0 in ClickHouse 26.9: a term a span model lacks would read as a 0 ms tail mean)."""
    return f"arrayReduce('avgOrNull', {array})"


# who measured the client views: `name version` per harness (phaselens's own client has no version)
HARNESS = "concat(client_harness, if(client_harness_version IS NULL, '', concat(' ', client_harness_version)))"
CLIENT_HARNESSES = f"arraySort(groupUniqArrayIf({HARNESS}, has_client))"


def budget_summary(d: Dialect) -> str:
    """One row, one pass: counts, goodput, every distribution's p50/p90/p99 array and mean, and
    the tail attribution (against the medians, which are the distributions' p50)."""
    dists = ",\n    ".join(
        f"{quantiles(d, expr)} AS {name}_q, avg({expr}) AS {name}_mean" for name, expr in DISTRIBUTIONS
    )
    return _drop_tail_rows(
        f"SELECT count() AS requests, countIf(has_client) AS with_client, countIf({ERROR}) AS errors,\n"
        f"    countIf(has_server) AS with_server, countIf({meets_slo(d)}) AS good,\n"
        "    arraySort(groupUniqArrayIf(span_model, span_model IS NOT NULL)) AS span_models,\n"
        f"    {CLIENT_HARNESSES} AS client_harnesses,\n"
        f"    countIf({NO_OUTPUT}) AS no_output,\n"
        f"    {window_s()} AS window_s,\n    {dists},\n    {', '.join(_tail_columns())}\n{from_requests(d)}"
    )


def tail_attribution(d: Dialect) -> str:
    """Among requests whose TTFT is above its p99, the mean of each component, against the
    component's median over all requests: delta = tail mean − median."""
    medians = ", ".join(f"quantileExactInclusive(0.5)({expr}) AS {name}_median" for name, expr in COMPONENTS)
    return _drop_tail_rows(
        f"SELECT {', '.join(_tail_columns())},\n"
        f"    quantileExactInclusive(0.5)(ttft_ms) AS ttft_median, {medians}\n{from_requests(d)}"
    )


def _drop_tail_rows(sql: str) -> str:
    return f"SELECT * EXCEPT (tail_rows) FROM (\n{sql}\n)"


def stall_columns() -> list[str]:
    mixed = "prefill_tokens > 0 AND decode_tokens > 0"
    extra = "greatest(duration_ms - step_baseline_ms, 0)"
    return [
        "count() AS steps",
        f"countIf({mixed}) AS mixed_steps",
        "countIf(decode_tokens > 0) AS decode_steps",
        f"sumIf({extra}, {mixed}) AS stall_ms",
        f"sumIf(decode_tokens * {extra}, {mixed}) AS request_stall_ms",
        f"sumIf(decode_tokens, {mixed}) AS delayed_decodes",
    ]


def with_baseline(d: Dialect, body: str) -> str:
    baseline = (
        f"SELECT quantileExactInclusive(0.5)(duration_ms) {from_steps(d)} AND prefill_tokens = 0 AND decode_tokens > 0"
    )
    return f"WITH ({baseline}) AS step_baseline_ms\n{body}"


def decode_stalls(d: Dialect) -> str:
    """Decode stalls caused by prefill over the selection (defined in this module's docstring)."""
    return with_baseline(
        d, f"SELECT any(step_baseline_ms) AS baseline_ms, {', '.join(stall_columns())}\n{from_steps(d)}"
    )
