"""Every analysis query, in one place: the CLI, the Python API, the report and the Grafana
dashboards render these templates; nobody copies their SQL (docs/contracts.md, "Analysis queries").
Each one's CLI rendering is checked in as `analysis/sql/<name>.sql` (`phaselens sql write|check`).

    render_cli(name, **filters) -> (sql, parameters)   # bound server-side parameters only
    render_grafana(name, database="otel") -> str       # Grafana macros and ${variables}
    PANEL_COLUMNS[name]                                # the columns a panel query returns

Filters (CLI): database, service, model, since ("15m"; None = all time), bucket_s, limit,
ttft_slo_ms, tpot_slo_ms, trace_id, bucket_tokens, approx (t-digest quantiles).

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

from collections.abc import Callable
from dataclasses import dataclass, field

from phaselens.analysis import terms
from phaselens.analysis import thresholds as th
from phaselens.analysis.queries import pd_queries
from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.queries.dialect import CliDialect, Dialect, Filters, GrafanaDialect, QueryError
from phaselens.analysis.schema.schema import (
    CLIENT_KINDS,
    ERROR_CODES,
    FACTS_VIEW,
    SPANS_VIEW,
    STEPS_VIEW,
    TRACE_TIMES_VIEW,
)
from phaselens.instrumentation import names as n

LEVELS = (0.5, 0.9, 0.99)
LEVEL_LABELS = ("p50", "p90", "p99")
# Budget components: (name shown, value over the facts), in TTFT order (analysis/terms.py).
# `before_engine_ms` is set only for span models that cannot split ingress and first_token (vLLM's
# native span): server TTFT − queue − prefill (analysis/schema/schema.py).
COMPONENTS = tuple((t.name, t.sql) for t in terms.REGISTRY.components())
# Components that are estimates, not differences of stamps: labelled so wherever they are shown.
ESTIMATED = terms.REGISTRY.estimated()


def _parts_of(whole: str) -> tuple[tuple[str, str], ...]:
    return tuple((t.name, t.sql) for t in terms.REGISTRY.parts(whole))


# Where the inbound edge went (inbound = kernel_wait + dispatch): the bytes waiting in the kernel for
# a busy event loop, against HTTP parsing and the task start.
INBOUND_SPLIT = _parts_of("inbound_ms")
# The client's own time (client = send + read): a load generator short of CPU shows here.
CLIENT_SPLIT = _parts_of("client_ms")
# Where the server's first-chunk time went (first_chunk = loop_wait + encode): a late event loop
# (loop_wait) against SSE encoding and the framework (encode); write (send until it returned) beside it.
FIRST_CHUNK_SPLIT = _parts_of("first_chunk_ms")
# Every distribution the budget reports: (name, expression over the facts view).
DISTRIBUTIONS = (
    ("ttft_ms", "ttft_ms"),
    ("client_ttft_ms", "client_ttft_ms"),
    ("server_ttft_ms", "server_ttft_ms"),
    ("client_ttfo_ms", "client_ttfo_ms"),
    ("server_ttfc_ms", "server_ttfc_ms"),
    *COMPONENTS,
    *FIRST_CHUNK_SPLIT,
    *INBOUND_SPLIT,
    *CLIENT_SPLIT,
    *terms.REGISTRY.witnesses(),
    ("e2e_residual_ms", "e2e_residual_ms"),
    ("client_tpot_ms", "client_tpot_ms"),
    ("server_tpot_ms", "server_tpot_ms"),
    ("client_itl_p99_ms", "client_itl_p99_ms"),
    ("server_itl_p99_ms", "itl_p99_ms"),
    ("client_e2e_ms", "client_e2e_ms"),
    ("server_e2e_ms", "server_e2e_ms"),
    ("stall_ms", "stall_ms"),
    ("queue_all_waits_ms", "queue_ms"),
)
# A component counted 0 where not stamped, and the distribution whose mean is NULL when no request
# in the selection was stamped: the budget then shows the component as unobserved, not as 0 ms.
OBSERVED_BY = terms.REGISTRY.observed_by()
# ...and the facts column whose NULL says one request was not stamped with the component
UNOBSERVED = "unobserved"  # the word every surface shows for such a term (never 0)
STAMPED_BY = {name: dict(DISTRIBUTIONS)[witness] for name, witness in OBSERVED_BY.items()}
ERROR = "status = 'error'"
# completed, seen by a client, and no content chunk reached it: no client TTFT, not an error
NO_OUTPUT = "status = 'ok' AND has_client AND client_ttft_ms IS NULL"


def _quantiles(d: Dialect, expr: str) -> str:
    fn = "quantilesTDigest" if d.approximate() else "quantilesExactInclusive"
    return f"{fn}({', '.join(map(str, LEVELS))})({expr})"


def _where(*conditions: str) -> str:
    """Conditions joined by AND; a filter the user did not set renders as `1` and is left out."""
    return "WHERE " + (" AND ".join(c for c in conditions if c != "1") or "1")


def _requests(d: Dialect) -> str:
    """FROM + WHERE of the per-request facts under the time, service and model filters."""
    return f"FROM {d.table(FACTS_VIEW)}\n" + _where(
        d.time_filter("start_time"), d.match("service", "service"), d.match("model", "model")
    )


def _steps(d: Dialect) -> str:
    return f"FROM {d.table(STEPS_VIEW)}\n" + _where(d.time_filter("time"), d.match("service", "service"))


def _meets_slo(d: Dialect) -> str:
    """Completed OK within both SLOs (defaults: common.slo.DEFAULT_SLO); a one-token request has no TPOT."""
    ttft, tpot = _slo(d, "ttft", th.DEFAULT_TTFT_SLO_MS), _slo(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
    return f"status = 'ok' AND ttft_ms <= {ttft} AND (tpot_ms IS NULL OR tpot_ms <= {tpot})"


def _window_s(start: str = "min(server_start_time)", end: str = "max(server_end_time)") -> str:
    """Seconds from the first request received to the last response closed, on the server clock."""
    return f"greatest((toUnixTimestamp64Nano({end}) - toUnixTimestamp64Nano({start})) / 1e9, 1e-9)"


def _series(d: Dialect, time_col: str, source: str, selects: list[str]) -> str:
    """One row per time bucket of `time_col` (Grafana time-series format: `time` first)."""
    body = ",\n    ".join(selects)
    return (
        f"SELECT {d.time_bucket('bucket_start')} AS time,\n    {body}\n"
        f"FROM (SELECT *, {time_col} AS bucket_start {source})\nGROUP BY time\nORDER BY time"
    )


# --- budget (Python API, CLI) -------------------------------------------------------------


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
_HARNESS = "concat(client_harness, if(client_harness_version IS NULL, '', concat(' ', client_harness_version)))"
CLIENT_HARNESSES = f"arraySort(groupUniqArrayIf({_HARNESS}, has_client))"


def budget_summary(d: Dialect) -> str:
    """One row, one pass: counts, goodput, every distribution's p50/p90/p99 array and mean, and
    the tail attribution (against the medians, which are the distributions' p50)."""
    dists = ",\n    ".join(
        f"{_quantiles(d, expr)} AS {name}_q, avg({expr}) AS {name}_mean" for name, expr in DISTRIBUTIONS
    )
    return _drop_tail_rows(
        f"SELECT count() AS requests, countIf(has_client) AS with_client, countIf({ERROR}) AS errors,\n"
        f"    countIf(has_server) AS with_server, countIf({_meets_slo(d)}) AS good,\n"
        "    arraySort(groupUniqArrayIf(span_model, span_model IS NOT NULL)) AS span_models,\n"
        f"    {CLIENT_HARNESSES} AS client_harnesses,\n"
        f"    countIf({NO_OUTPUT}) AS no_output,\n"
        f"    {_window_s()} AS window_s,\n    {dists},\n    {', '.join(_tail_columns())}\n{_requests(d)}"
    )


def tail_attribution(d: Dialect) -> str:
    """Among requests whose TTFT is above its p99, the mean of each component, against the
    component's median over all requests: delta = tail mean − median."""
    medians = ", ".join(f"quantileExactInclusive(0.5)({expr}) AS {name}_median" for name, expr in COMPONENTS)
    return _drop_tail_rows(
        f"SELECT {', '.join(_tail_columns())},\n"
        f"    quantileExactInclusive(0.5)(ttft_ms) AS ttft_median, {medians}\n{_requests(d)}"
    )


def _drop_tail_rows(sql: str) -> str:
    return f"SELECT * EXCEPT (tail_rows) FROM (\n{sql}\n)"


def _stall_columns() -> list[str]:
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


def _with_baseline(d: Dialect, body: str) -> str:
    baseline = (
        f"SELECT quantileExactInclusive(0.5)(duration_ms) {_steps(d)} AND prefill_tokens = 0 AND decode_tokens > 0"
    )
    return f"WITH ({baseline}) AS step_baseline_ms\n{body}"


def decode_stalls(d: Dialect) -> str:
    """Decode stalls caused by prefill over the selection (defined in the docstring of analysis/queries/catalog.py)."""
    return _with_baseline(d, f"SELECT any(step_baseline_ms) AS baseline_ms, {', '.join(_stall_columns())}\n{_steps(d)}")


# --- diagnosis (phaselens diagnose, the report, the verdict panel) --------------------------

DIAGNOSIS_LEVELS = (0.5, 0.99)  # p50 and p99, judged separately
# The figures the diagnosis reads per request: (name, expression over the facts view). TTFT terms
# map onto the causes: first_token (sampling the prefill's token) counts with prefill, a coarse span
# model's before_engine (tokenisation and hops) with ingress (SGLang has both: summed), first_chunk
# is the server's delivery.
DIAGNOSIS_FIGURES = (
    ("ttft_ms", "ttft_ms"),
    ("tpot_ms", "tpot_ms"),
    ("client_tpot_ms", "client_tpot_ms"),
    ("server_tpot_ms", "server_tpot_ms"),
    ("e2e_ms", "coalesce(client_e2e_ms, server_e2e_ms)"),
    ("input_tokens", "input_tokens"),
    ("output_tokens", "output_tokens"),
    ("queue_ms", "ttft_queue_ms"),
    ("prefill_ms", "prefill_ms + coalesce(first_token_ms, 0)"),
    ("ingress_ms", "coalesce(ingress_ms + before_engine_ms, ingress_ms, before_engine_ms)"),
    ("delivery_ms", "ifNull(first_chunk_ms, 0)"),
    ("network_ms", "residual_ms"),
    # the client's own wait: send + read of the first chunk + the estimated wait TCP's coalescing hid
    ("client_ms", "ifNull(client_ms, 0) + ifNull(client_late_est_ms, 0)"),
)
# TTFT terms and the cause each one names
TTFT_CAUSES = (
    ("queue", "queue_ms"),
    ("prefill", "prefill_ms"),
    ("ingress", "ingress_ms"),
    ("delivery", "delivery_ms"),
    ("network", "network_ms"),
)
DECODE_CAUSES = ("decode", "client", "prefill_stalls")  # the causes that act on TPOT


def _slo(d: Dialect, key: str, default: float) -> str:
    return d.value(f"{key}_slo_ms", "Float64", default)


def diagnosis_figures(d: Dialect) -> str:
    """One row: counts, goodput against the SLOs (defaults in analysis/thresholds.py), the p50 and
    p99 of every figure (`<name>_q` = [p50, p99]), the prefix-cache hit rate
    min(1, Σ cached_tokens / Σ input_tokens) (a preempted request's re-admission can hit its own
    output's blocks too) and the share of requests preempted at least once."""
    levels = ", ".join(map(str, DIAGNOSIS_LEVELS))
    dists = ",\n    ".join(f"quantilesExactInclusive({levels})({expr}) AS {name}_q" for name, expr in DIAGNOSIS_FIGURES)
    return (
        f"SELECT count() AS requests, countIf({ERROR}) AS errors, countIf(has_client) AS with_client,\n"
        f"    countIf({_meets_diagnosis_slo(d)}) AS good, {_window_s()} AS window_s,\n"
        "    least(sum(cached_tokens) / nullIf(sum(input_tokens), 0), 1) AS prefix_hit_rate,\n"
        "    countIf(preemptions > 0) / count() AS preempted_share,\n"
        f"    arraySort(groupUniqArrayIf(model, model IS NOT NULL)) AS models,\n"
        f"    {CLIENT_HARNESSES} AS client_harnesses,\n    {dists}\n{_requests(d)}"
    )


def diagnosis_target(d: Dialect) -> str:
    """The server the selection's clients called (`server.address`, `server.port` of their CLIENT
    spans): the URL of the second `phaselens bench` run the load-dependence step may ask for."""
    addr, port = f"SpanAttributes['{n.SERVER_ADDRESS}']", f"SpanAttributes['{n.SERVER_PORT}']"
    return (
        f"SELECT any({addr}) AS server_address, any({port}) AS server_port\nFROM {d.table(SPANS_VIEW)}\n"
        f"WHERE {d.time_filter('Timestamp')} AND SpanKind IN {CLIENT_KINDS} AND {addr} != ''\n"
        f"    AND TraceId IN (SELECT trace_id {_requests(d)})"
    )


def _meets_diagnosis_slo(d: Dialect) -> str:
    ttft, tpot = _slo(d, "ttft", th.DEFAULT_TTFT_SLO_MS), _slo(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
    return f"status = 'ok' AND ttft_ms <= {ttft} AND (tpot_ms IS NULL OR tpot_ms <= {tpot})"


def diagnosis_engine(d: Dialect) -> str:
    """One row over the engine steps: batch size, KV use (used / total blocks) at the steps' p90 and
    max, preemptions, decode-only and mixed step durations (p50), and the stall share:
        stall_share = request_stall_ms / Σ_{decode steps} decode_tokens × duration_ms
    (request_stall_ms as in decode_stalls: the decode-token time lost to prefill in mixed steps)."""
    kv = "kv_blocks_used / nullIf(kv_blocks_total, 0)"
    return _with_baseline(
        d,
        (
            f"SELECT {', '.join(_stall_columns())},\n"
            "    request_stall_ms / nullIf(sumIf(decode_tokens * duration_ms, decode_tokens > 0), 0) AS stall_share,\n"
            "    any(step_baseline_ms) AS decode_step_p50_ms,\n"
            "    quantileExactInclusiveIf(0.5)(duration_ms, prefill_tokens > 0 AND decode_tokens > 0) AS mixed_step_p50_ms,\n"
            f"    quantileExactInclusive(0.9)({kv}) AS kv_used_p90, max({kv}) AS kv_used_max,\n"
            "    sum(preemptions) AS preemptions, avg(batch_size) AS batch_size_mean, max(queue_depth) AS queue_depth_max\n"
            f"{_steps(d)}"
        ),
    )


def _at(name: str, i: int) -> str:
    """Level `i` (1 = p50, 2 = p99) of figure `name` in the figures row `f`."""
    return f"f.{name}_q[{i}]"


def _share(num: str, den: str, i: int) -> str:
    """num / den at level `i` of the figures row (NULL when den is 0)."""
    return f"toFloat64({_at(num, i)} / nullIf({_at(den, i)}, 0))"


def _cause_rows() -> list[str]:
    """(cause, p50 signal, p99 signal, threshold, root) per cause. A TTFT term's signal is its share
    of TTFT at that percentile; decode's the server's share of TPOT, client's the rest; the engine
    causes have one signal for both levels. Root causes (engine mechanisms) rank above the symptom
    terms they explain: kv_pressure (admission waits, preemptions), prefill_stalls (slow decode)."""
    rows = [
        f"('{cause}', {_share(col, 'ttft_ms', 1)}, {_share(col, 'ttft_ms', 2)}, {th.TERM_SHARE}, 0)"
        for cause, col in TTFT_CAUSES
    ]
    rows.append(
        f"('decode', {_share('server_tpot_ms', 'tpot_ms', 1)}, {_share('server_tpot_ms', 'tpot_ms', 2)}, "
        f"{th.DECODE_SHARE}, 0)"
    )
    rows.append(f"('client', {_client_signal(1)}, {_client_signal(2)}, {th.CLIENT_SHARE}, 0)")
    rows.append(f"('prefill_stalls', toFloat64(e.stall_share), toFloat64(e.stall_share), {th.STALL_SHARE}, 1)")
    kv = f"toFloat64(greatest(e.kv_used_p90 / {th.KV_USED}, f.preempted_share / {th.PREEMPTED_SHARE}))"
    rows.append(f"('kv_pressure', {kv}, {kv}, 1, 1)")
    return rows


def _client_signal(i: int) -> str:
    """The client's share at level `i`: the larger of its TPOT share (1 − server TPOT / client TPOT)
    and its own time's share of TTFT (client = send + read, kernel receive stamps, + the estimated
    wait TCP's coalescing hid from the read); NULL with neither."""
    tpot = f"toFloat64(1 - {_at('server_tpot_ms', i)} / nullIf({_at('client_tpot_ms', i)}, 0))"
    ttft = _share("client_ms", "ttft_ms", i)
    return f"if({tpot} IS NULL AND {ttft} IS NULL, NULL, greatest(ifNull({tpot}, 0), ifNull({ttft}, 0)))"


def _flagged(i: int, ttft_risk: str, tpot_risk: str) -> str:
    """Cause `c` flagged at level `i`: its signal reached its threshold while the SLO it acts on is at
    risk (the client acts on both: its own time delays the first chunk and every later one)."""
    both = f"{ttft_risk} OR {tpot_risk}"
    gate = f"multiIf(c.1 IN ('kv_pressure', 'client'), {both}, c.1 IN {DECODE_CAUSES}, {tpot_risk}, {ttft_risk})"
    return f"ifNull({gate} AND c.{i + 1} >= c.4, 0)"


def diagnosis_causes(d: Dialect) -> str:
    """The verdict, one row per cause in rank order. At a percentile an SLO is at risk when TTFT or
    TPOT exceeds MARGIN × its SLO; a cause is flagged there when its signal ≥ its threshold and the
    SLO it acts on is at risk (TTFT terms: TTFT; decode, client, prefill_stalls: TPOT; kv_pressure:
    either). Rank: flagged first, then root causes, then signal / threshold. role: `primary` (rank 1
    while any SLO is at risk), `contributing` (the other flagged ones), `none` (every SLO holds)."""
    return _causes(d, diagnosis_figures(d), diagnosis_engine(d))


def _causes(d: Dialect, figures: str, engine: str) -> str:
    """diagnosis_causes over a figures row `figures` and an engine row `engine` (SELECTs)."""
    ttft, tpot = _slo(d, "ttft", th.DEFAULT_TTFT_SLO_MS), _slo(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
    risk = [
        (f"{_at('ttft_ms', i)} > {th.MARGIN} * {ttft}", f"{_at('tpot_ms', i)} > {th.MARGIN} * {tpot}") for i in (1, 2)
    ]
    flagged = [_flagged(i, *risk[i - 1]) for i in (1, 2)]
    at_risk = " OR ".join(f"ifNull({t} OR {p}, 0)" for t, p in risk)
    cols = (
        f"c.1 AS cause, c.2 AS p50_signal, c.3 AS p99_signal, c.4 AS threshold, {flagged[0]} AS flagged_p50,\n"
        f"    {flagged[1]} AS flagged_p99, (flagged_p50 OR flagged_p99) AS flagged, c.5 AS root,\n"
        "    ifNull(greatest(ifNull(c.2, 0), ifNull(c.3, 0)) / c.4, 0) AS score,\n"
        f"    ({at_risk}) AS at_risk"
    )
    ranked = (
        f"SELECT {cols}\nFROM ({figures}) AS f\nCROSS JOIN ({engine}) AS e\n"
        f"ARRAY JOIN [{', '.join(_cause_rows())}] AS c"
    )
    return (
        f"SELECT cause, multiIf(NOT at_risk, 'none', rank = 1, 'primary', flagged, 'contributing', '') AS role,\n"
        "    p50_signal, p99_signal, threshold, flagged_p50, flagged_p99\n"
        "FROM (SELECT *, row_number() OVER (ORDER BY flagged DESC, (flagged AND root) DESC, score DESC, cause) AS rank\n"
        f"    FROM ({ranked}))\nORDER BY rank"
    )


# --- rollups (analysis/rollup/rollup.py makes the tables; the approximation is in analysis/queries/sketch.py) ----

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
_DOMINANT = ", ".join(f"('{name.removesuffix('_ms')}', coalesce({expr}, 0))" for name, expr in COMPONENTS)
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
    ("dominant_phase", "String", f"tupleElement(arrayReverseSort(x -> tupleElement(x, 2), [{_DOMINANT}])[1], 1)"),
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
            f"groupUniqArrayIf({_HARNESS}, has_client)",
        ),
    )
    pd_terms = pd_queries.pd_rollup_terms()
    disaggregated = (
        (pd_queries.PD_QUANTILES_COLUMN, sk.SKETCH_TYPE, sk.quantiles_state(pd_terms)),
        (pd_queries.PD_MEANS_COLUMN, sk.MEANS_TYPE, sk.means_state(pd_terms)),
    )
    return counts + sums + window + terms + hists + harnesses + (slowest,) + disaggregated


def _states(d: Dialect) -> str:
    """FROM + WHERE of the rollup states (sealed minutes and the requests not sealed yet, each once:
    rollup.current_select) under the time, service and model filters; the window is widened to
    whole minutes."""
    return f"FROM {d.table(sk.STATES_VIEW)}\n" + _where(
        d.bucket_filter("bucket"), d.match("service", "service"), d.match("model", "model")
    )


def _sketch(term: str, level: float | None = None) -> str:
    """A rolled-up term's [p50, p90, p99], or the one `level` of them (in a SELECT with _merged())."""
    position = ROLLUP_POSITIONS.index(term) + 1
    return sk.quantiles_at(position) if level is None else sk.quantile_at(position, level)


def _mean(term: str) -> str:
    return sk.mean_at(ROLLUP_POSITIONS.index(term) + 1)


_MERGED = (sk.MERGED_QUANTILES, sk.MERGED_MEANS)


def _merged(selects: list[str]) -> list[str]:
    """`selects` after the merged term states they read (none when they read no term)."""
    return [sk.merged_states(), *selects] if any(m in s for s in selects for m in _MERGED) else selects


def _good_from_hist(d: Dialect) -> str:
    """Requests meeting both SLOs (defaults: common.slo.DEFAULT_SLO), from the goodput histogram:
    each (TTFT, TPOT) bucket counts with the share of it under both SLOs (sketch.share_below)."""
    ttft, tpot = _slo(d, "ttft", th.DEFAULT_TTFT_SLO_MS), _slo(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
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
        f"{_sketch('ttft_ms', 0.99)} AS threshold_ms",
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
        f"[{', '.join(_sketch(_diagnosis_term(name, expr), level) for level in DIAGNOSIS_LEVELS)}] AS {name}_q"
        for name, expr in DIAGNOSIS_FIGURES
    )
    return (
        f"SELECT * EXCEPT ({', '.join(_MERGED)}) FROM (\nSELECT {sk.merged_states()},\n"
        f"    sum(preempted) / nullIf(sum(requests), 0) AS preempted_share,\n    {qs}\n{_states(d)}\n)"
    )


def diagnosis_causes_rollup(d: Dialect) -> str:
    """The verdict (diagnosis_causes) from the rollups: the figures' p50 and p99 from their sketches
    and the engine's from the steps' rollups (within 1 %; stalls: _stall_columns_rollup)."""
    return _causes(d, _diagnosis_figures_rollup(d), diagnosis_engine_rollup(d))


def budget_summary_rollup(d: Dialect) -> str:
    """budget_summary's row from the rollups: the same columns, quantiles from merged DDSketches,
    means and counts exact, goodput and tail from the log-bucket histograms (analysis/queries/sketch.py)."""
    dists = ",\n    ".join(f"{_sketch(name)} AS {name}_q, {_mean(name)} AS {name}_mean" for name, _ in DISTRIBUTIONS)
    return (
        f"SELECT * EXCEPT ({', '.join(_MERGED)}, tail_hist_merged, threshold_bucket, tail_weights) FROM (\n"
        f"SELECT {sk.merged_states()},\n    sum(requests) AS requests, sum(with_client) AS with_client, sum(errors) AS errors,\n"
        f"    sum(with_server) AS with_server, {_good_from_hist(d)} AS good,\n"
        "    arraySort(groupUniqArrayIf(span_model, span_model != '')) AS span_models,\n"
        "    arraySort(groupUniqArrayArray(client_harnesses)) AS client_harnesses, sum(no_output) AS no_output,\n"
        f"    {_window_s('min(first_server_start)', 'max(last_server_end)')} AS window_s,\n    {dists},\n"
        f"    {', '.join(_tail_from_hist())}\n{_states(d)}\n)"
    )


def _series_rollup(d: Dialect, selects: list[str]) -> str:
    """One row per time bucket of the rollup's minutes (buckets of at least a minute)."""
    body = ",\n    ".join(_merged(selects))
    sql = f"SELECT {d.time_bucket('bucket')} AS time,\n    {body}\n{_states(d)}\nGROUP BY time"
    if body.startswith(sk.merged_states()):
        sql = f"SELECT * EXCEPT ({', '.join(_MERGED)}) FROM (\n{sql}\n)"
    return f"{sql}\nORDER BY time"


def _bucket_s(d: Dialect) -> str:
    """The length of a series bucket in seconds: the rollup's minute at least."""
    return f"greatest({d.bucket_seconds()}, 60)"


# --- Grafana panels (the dashboards render these) -----------------------------------------


def _rolled_up_stats(name: str) -> str:
    """[p50, p90, p99, mean] of a rolled-up component, each its own element (always four: a term
    without a sketch is NULL there), all NULL where no request of the read stamped it (OBSERVED_BY)."""
    stats = [*(_sketch(name, level) for level in LEVELS), _mean(name)]
    if name in OBSERVED_BY:
        stats = [f"if({_mean(OBSERVED_BY[name])} IS NULL, NULL, {s})" for s in stats]
    return f"[{', '.join(stats)}]"


def budget_stack(d: Dialect) -> str:
    """TTFT budget components at p50/p90/p99 (each its own percentile, from the rollups' sketches)
    and the mean (exact: rolled-up sums); no rows for a range without requests."""
    arrays = ", ".join(_rolled_up_stats(name) for name, _ in COMPONENTS)
    cols = ", ".join(f"tupleElement(row, {i + 2}) AS {name}" for i, (name, _) in enumerate(COMPONENTS))
    labels = ", ".join(f"'{label}'" for label in (*LEVEL_LABELS, "mean"))
    return (
        f"SELECT tupleElement(row, 1) AS statistic, {cols}\n"
        f"FROM (SELECT {sk.merged_states()}, arrayJoin(arrayZip([{labels}], {arrays})) AS row\n    {_states(d)}\n"
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
    return _series_rollup(d, [f"{_sketch(term, level)} AS {name}" for name, level, term in LATENCY_SERIES])


def delivery_over_time(d: Dialect) -> str:
    """Where the server's first-chunk time goes (first_chunk = loop_wait + encode; write beside it), against
    the residual (network + client): a starved event loop shows in loop_wait, a slow network or
    client in the residual. p90s from the rollups' sketches."""
    terms = (*FIRST_CHUNK_SPLIT, ("first_chunk_ms", "first_chunk_stamped_ms"), ("residual_ms", "residual_ms"))
    return _series_rollup(d, [f"{_sketch(term, 0.9)} AS {name.removesuffix('_ms')}_p90_ms" for name, term in terms])


def goodput_over_time(d: Dialect) -> str:
    """Goodput: completed requests per second meeting every SLO; attainment: their fraction (goodput
    histogram of the rollups: a request less than 2 % under an SLO may count as missing it)."""
    s = _bucket_s(d)
    return _series_rollup(
        d,
        [
            f"{_good_from_hist(d)} / {s} AS goodput_rps",
            f"sum(ok_requests) / {s} AS completed_rps",
            f"goodput_rps * {s} / sum(requests) AS slo_attainment",
        ],
    )


def goodput_per_minute(d: Dialect) -> str:
    """goodput_over_time over every request (the cookbook's: exact, and plain SQL to read)."""
    good = f"countIf({_meets_slo(d)})"
    return _series(
        d,
        "start_time",
        _requests(d),
        [
            f"{good} / {d.bucket_seconds()} AS goodput_rps",
            f"countIf(status = 'ok') / {d.bucket_seconds()} AS completed_rps",
            f"{good} / count() AS slo_attainment",
        ],
    )


def throughput_over_time(d: Dialect) -> str:
    s = _bucket_s(d)
    return _series_rollup(
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
    parts = _DOMINANT
    comps = ", ".join(
        expr if expr == name else f"{expr} AS {name}"
        for name, expr in ((name, request_component(name, expr)) for name, expr in COMPONENTS)
    )
    return (
        f"SELECT trace_id, request_id, start_time, service, model, status, ttft_ms, client_ttft_ms,\n"
        f"    server_ttft_ms, {comps},\n"
        f"    tupleElement(arrayReverseSort(x -> tupleElement(x, 2), [{parts}])[1], 1) AS dominant_phase,\n"
        f"    input_tokens, output_tokens, preemptions, client_e2e_ms, client_harness, x_request_id\n"
        f"{_requests(d)}\nORDER BY ttft_ms DESC NULLS LAST\nLIMIT {d.limit(50)}"
    )


def slowest_requests_rollup(d: Dialect) -> str:
    """slowest_requests from the rollups: the merge of the rows' kept slowest (at most SLOWEST_KEPT),
    over whole minutes; the same rows as over every request of those minutes."""
    cols = ", ".join(f"r.{i + 2} AS {name}" for i, (name, _, _) in enumerate(SLOWEST_FIELDS))
    return (
        f"SELECT {cols}\nFROM (SELECT arrayJoin(groupArraySortedMerge({SLOWEST_KEPT})(slowest)) AS r\n    {_states(d)})\n"
        f"ORDER BY r.1, r.2\nLIMIT {d.limit(SLOWEST_KEPT)}"
    )


# --- engine-step rollups (analysis/rollup/step_rollup.py makes the table) ----------------------------

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
    return f"FROM {d.table(sk.STEPS_STATES_VIEW)}\n" + _where(d.bucket_filter("bucket"), d.match("service", "service"))


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
    return _series(
        d,
        "time",
        _steps(d),
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
    return _series(
        d,
        "time",
        _steps(d),
        [
            f"avg({ratio}) AS kv_used_ratio_mean",
            f"max({ratio}) AS kv_used_ratio_max",
            "max(kv_blocks_used) AS kv_blocks_used_max",
            "sum(preemptions) AS preemptions",
        ],
    )


def decode_stalls_over_time(d: Dialect) -> str:
    return _with_baseline(d, _series(d, "time", _steps(d), _stall_columns()[1:]))


def queue_depth_over_time(d: Dialect) -> str:
    return _series(
        d, "time", _steps(d), ["avg(queue_depth) AS queue_depth_mean", "max(queue_depth) AS queue_depth_max"]
    )


def _one_trace(d: Dialect, select: str, tail: str) -> str:
    """`select` over the spans of `${trace_id}`, the time range bounded by the lookup table (as
    Grafana's plugin does: its Start/End are whole seconds, so the end gets one more)."""
    lookup = d.table(TRACE_TIMES_VIEW)
    return (
        f"WITH {d.value('trace_id', 'String')} AS trace_id,\n"
        f"    (SELECT min(Start) FROM {lookup} WHERE TraceId = trace_id) AS trace_start,\n"
        f"    (SELECT max(End) + 1 FROM {lookup} WHERE TraceId = trace_id) AS trace_end\n"
        f"SELECT {select}\nFROM {d.table(SPANS_VIEW)}\n"
        f"WHERE TraceId = trace_id AND Timestamp >= trace_start AND Timestamp <= trace_end\n{tail}"
    )


def _key_values(column: str) -> str:
    """A Map as the trace view's list of {key, value} maps."""
    return f"arrayMap(key -> map('key', key, 'value', {column}[key]), mapKeys({column}))"


def request_trace(d: Dialect) -> str:
    """One trace in the columns Grafana's trace view expects (plugin QueryType.Traces, format 3)."""
    return _one_trace(
        d,
        (
            "TraceId AS traceID, SpanId AS spanID, ParentSpanId AS parentSpanID,\n"
            "    ServiceName AS serviceName, SpanName AS operationName,\n"
            "    multiply(toUnixTimestamp64Nano(Timestamp), 0.000001) AS startTime,\n"
            "    multiply(Duration, 0.000001) AS duration,\n"
            f"    {_key_values('SpanAttributes')} AS tags,\n    {_key_values('ResourceAttributes')} AS serviceTags,\n"
            f"    if(StatusCode IN {ERROR_CODES}, 2, 0) AS statusCode"
        ),
        f"LIMIT {d.limit(1000)}",
    )


# --- cookbook (docs/sql-cookbook.md) ------------------------------------------------------

TTFT_P50_P99 = (
    "quantileExactInclusive(0.5)(ttft_ms) AS ttft_p50_ms, quantileExactInclusive(0.99)(ttft_ms) AS ttft_p99_ms"
)


def _model_mean(name: str, expr: str) -> str:
    """A component's mean over a model's requests; NULL where none of them was stamped with it."""
    stamp = STAMPED_BY.get(name)
    return f"avg({expr})" if stamp is None else f"if(countIf({stamp} IS NOT NULL) = 0, NULL, avg({expr}))"


def budget_by_model(d: Dialect) -> str:
    means = ", ".join(f"{_model_mean(name, expr)} AS {name}_mean" for name, expr in COMPONENTS)
    return (
        f"SELECT model, count() AS requests, countIf({ERROR}) AS errors,\n    {TTFT_P50_P99},\n"
        f"    {means}\n{_requests(d)}\nGROUP BY model\nORDER BY requests DESC"
    )


def ttft_vs_prompt_length(d: Dialect) -> str:
    bucket = d.value("bucket_tokens", "UInt32", 128)
    computed_tokens = "sum(input_tokens - coalesce(cached_tokens, 0))"
    return (
        f"SELECT intDiv(input_tokens, {bucket}) * {bucket} AS prompt_tokens_from, count() AS requests,\n"
        f"    {TTFT_P50_P99},\n    quantileExactInclusive(0.5)(prefill_ms) AS prefill_p50_ms,\n"
        f"    sum(prefill_ms) / nullIf({computed_tokens}, 0) * 1000 AS prefill_ms_per_1k_tokens\n"
        f"{_requests(d)} AND input_tokens IS NOT NULL\nGROUP BY prompt_tokens_from\nORDER BY prompt_tokens_from"
    )


def queueing_vs_load(d: Dialect) -> str:
    return _series(
        d,
        "start_time",
        _requests(d),
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
    return _one_trace(
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
    return f"SELECT DISTINCT model {_states(d)} AND model != ''\nORDER BY model"


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


# --- report (phaselens report) --------------------------------------------------------------

REPORT_MAX_POINTS = 100_000
REPORT_MAX_STEPS = 200_000


def report_points(d: Dialect) -> str:
    """One row per selected request: the points of the report's CDFs and prompt-length scatter."""
    return (
        "SELECT trace_id, input_tokens, client_ttft_ms, server_ttft_ms, client_tpot_ms, server_tpot_ms,\n"
        f"    prefill_ms, ttft_ms, has_server\n{_requests(d)}\nORDER BY start_time\n"
        f"LIMIT {d.limit(REPORT_MAX_POINTS)}"
    )


def report_steps(d: Dialect) -> str:
    """Every engine step in range (the report's batch-composition chart buckets them)."""
    return (
        "SELECT toUnixTimestamp64Nano(time) AS t_ns, prefill_tokens, decode_tokens\n"
        f"{_steps(d)}\nORDER BY time\nLIMIT {d.limit(REPORT_MAX_STEPS)}"
    )


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
