"""The queries of `phaselens diagnose`, the report's verdict and the Grafana verdict panel: the
figures per request, the engine's figures, and the causes judged against analysis/thresholds.py.
"""

from __future__ import annotations

from phaselens.analysis import thresholds as th
from phaselens.analysis.queries.budget import CLIENT_HARNESSES, stall_columns, with_baseline
from phaselens.analysis.queries.dialect import Dialect
from phaselens.analysis.queries.facts import ERROR, from_requests, from_steps, slo_value, window_s
from phaselens.analysis.schema.schema import (
    CLIENT_KINDS,
    SPANS_VIEW,
)
from phaselens.instrumentation import names as n

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


def diagnosis_figures(d: Dialect) -> str:
    """One row: counts, goodput against the SLOs (defaults in analysis/thresholds.py), the p50 and
    p99 of every figure (`<name>_q` = [p50, p99]), the prefix-cache hit rate
    min(1, Σ cached_tokens / Σ input_tokens) (a preempted request's re-admission can hit its own
    output's blocks too) and the share of requests preempted at least once."""
    levels = ", ".join(map(str, DIAGNOSIS_LEVELS))
    dists = ",\n    ".join(f"quantilesExactInclusive({levels})({expr}) AS {name}_q" for name, expr in DIAGNOSIS_FIGURES)
    return (
        f"SELECT count() AS requests, countIf({ERROR}) AS errors, countIf(has_client) AS with_client,\n"
        f"    countIf({_meets_diagnosis_slo(d)}) AS good, {window_s()} AS window_s,\n"
        "    least(sum(cached_tokens) / nullIf(sum(input_tokens), 0), 1) AS prefix_hit_rate,\n"
        "    countIf(preemptions > 0) / count() AS preempted_share,\n"
        f"    arraySort(groupUniqArrayIf(model, model IS NOT NULL)) AS models,\n"
        f"    {CLIENT_HARNESSES} AS client_harnesses,\n    {dists}\n{from_requests(d)}"
    )


def diagnosis_target(d: Dialect) -> str:
    """The server the selection's clients called (`server.address`, `server.port` of their CLIENT
    spans): the URL of the second `phaselens bench` run the load-dependence step may ask for."""
    addr, port = f"SpanAttributes['{n.SERVER_ADDRESS}']", f"SpanAttributes['{n.SERVER_PORT}']"
    return (
        f"SELECT any({addr}) AS server_address, any({port}) AS server_port\nFROM {d.table(SPANS_VIEW)}\n"
        f"WHERE {d.time_filter('Timestamp')} AND SpanKind IN {CLIENT_KINDS} AND {addr} != ''\n"
        f"    AND TraceId IN (SELECT trace_id {from_requests(d)})"
    )


def _meets_diagnosis_slo(d: Dialect) -> str:
    ttft, tpot = slo_value(d, "ttft", th.DEFAULT_TTFT_SLO_MS), slo_value(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
    return f"status = 'ok' AND ttft_ms <= {ttft} AND (tpot_ms IS NULL OR tpot_ms <= {tpot})"


def diagnosis_engine(d: Dialect) -> str:
    """One row over the engine steps: batch size, KV use (used / total blocks) at the steps' p90 and
    max, preemptions, decode-only and mixed step durations (p50), and the stall share:
        stall_share = request_stall_ms / Σ_{decode steps} decode_tokens × duration_ms
    (request_stall_ms as in decode_stalls: the decode-token time lost to prefill in mixed steps)."""
    kv = "kv_blocks_used / nullIf(kv_blocks_total, 0)"
    return with_baseline(
        d,
        (
            f"SELECT {', '.join(stall_columns())},\n"
            "    request_stall_ms / nullIf(sumIf(decode_tokens * duration_ms, decode_tokens > 0), 0) AS stall_share,\n"
            "    any(step_baseline_ms) AS decode_step_p50_ms,\n"
            "    quantileExactInclusiveIf(0.5)(duration_ms, prefill_tokens > 0 AND decode_tokens > 0) AS mixed_step_p50_ms,\n"
            f"    quantileExactInclusive(0.9)({kv}) AS kv_used_p90, max({kv}) AS kv_used_max,\n"
            "    sum(preemptions) AS preemptions, avg(batch_size) AS batch_size_mean, max(queue_depth) AS queue_depth_max\n"
            f"{from_steps(d)}"
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
    return causes(d, diagnosis_figures(d), diagnosis_engine(d))


def causes(d: Dialect, figures: str, engine: str) -> str:
    """diagnosis_causes over a figures row `figures` and an engine row `engine` (SELECTs)."""
    ttft, tpot = slo_value(d, "ttft", th.DEFAULT_TTFT_SLO_MS), slo_value(d, "tpot", th.DEFAULT_TPOT_SLO_MS)
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
