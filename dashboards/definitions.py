"""The three phaselens dashboards, as data. Panel SQL comes only from `phaselens.analysis.queries.render_grafana`
(one source of queries: the CLI's `phaselens budget` and the dashboards read the same SQL).

Each panel's description states the question it answers; docs/dashboards.md repeats them.
"""

from __future__ import annotations

from dataclasses import dataclass

from phaselens.analysis import queries as queries
from phaselens.analysis import terms
from phaselens.analysis import thresholds as th
from phaselens.analysis.queries import sketch
from phaselens.dashboards.datasource import DATASOURCE_NAME, DATASOURCE_UID
from phaselens.dashboards.model import (
    FORMAT_TABLE,
    FORMAT_TIME_SERIES,
    FORMAT_TRACES,
    dashboard,
    dashboard_link,
    datasource_variable,
    keep_fields,
    link_override,
    panel,
    query_variable,
    target,
    textbox_variable,
)

UID_BUDGET = "phaselens-latency-budget"
UID_ENGINE = "phaselens-engine"
UID_TRACE = "phaselens-request-trace"
DEFAULT_TTFT_SLO_MS = f"{th.DEFAULT_TTFT_SLO_MS:g}"  # the SLOs `phaselens diagnose` judges by default
DEFAULT_TPOT_SLO_MS = f"{th.DEFAULT_TPOT_SLO_MS:g}"
TIME_COLUMN = "time"


@dataclass(slots=True, frozen=True)
class Source:
    """The analysis queries rendered for Grafana against one database (`otel` unless pushed elsewhere)."""

    database: str = "otel"

    def sql(self, name: str) -> str:
        return queries.render_grafana(name, database=self.database)

    def target(self, name: str, fmt: int) -> dict:
        return target(self.sql(name), fmt)


def columns(name: str) -> list[str]:
    return list(queries.PANEL_COLUMNS[name])


def series(name: str, *, exclude: tuple[str, ...] = (), only: tuple[str, ...] = ()) -> list[dict]:
    """`keep_fields` for a time-series panel that shows some of a query's columns."""
    keep = [c for c in columns(name) if c == TIME_COLUMN or (c in only if only else c not in exclude)]
    return [keep_fields(keep)] if len(keep) < len(columns(name)) else []


def time_series(
    src: Source,
    name: str,
    title: str,
    description: str,
    *,
    unit: str,
    width: int = 12,
    height: int = 8,
    stacked: bool = False,
    bars: bool = False,
    transformations: list[dict] | None = None,
    overrides: list[dict] | None = None,
) -> dict:
    custom = {
        "drawStyle": "bars" if bars else "line",
        "lineWidth": 1,
        "fillOpacity": 40 if stacked else 10,
        "stacking": {"mode": "normal" if stacked else "none", "group": "A"},
        "showPoints": "never",
        "spanNulls": False,
    }
    return panel(
        "timeseries",
        title,
        description,
        [src.target(name, FORMAT_TIME_SERIES)],
        width=width,
        height=height,
        unit=unit,
        custom=custom,
        transformations=transformations,
        overrides=overrides,
        options={
            "legend": {"displayMode": "table", "placement": "bottom", "calcs": ["mean", "max", "lastNotNull"]},
            "tooltip": {"mode": "multi", "sort": "desc"},
        },
    )


def from_rollups(description: str) -> str:
    """A panel description that says the panel reads the rollups, and what that approximates."""
    return f"{description} {sketch.PANEL_NOTE}"


def unit_override(pattern: str, unit: str, *, right_axis: bool = False) -> dict:
    """Columns whose name matches `pattern` (regex) get `unit`, optionally on the right axis."""
    props = [{"id": "unit", "value": unit}]
    if right_axis:
        props.append({"id": "custom.axisPlacement", "value": "right"})
    return {"matcher": {"id": "byRegexp", "options": pattern}, "properties": props}


def unobserved_override(names: list[str]) -> dict:
    """Columns `names` (budget terms) read `unobserved` where NULL: a term no request stamped, never 0."""
    pattern = f"^({'|'.join(names)})$"
    return {
        "matcher": {"id": "byRegexp", "options": pattern},
        "properties": [{"id": "noValue", "value": queries.UNOBSERVED}],
    }


# --- variables -----------------------------------------------------------------------------------
# Value lists for the drop-downs; their SQL, like the panels', is in phaselens.analysis.queries.


def service_variable(src: Source) -> dict:
    return query_variable(
        "service",
        "Service",
        queries.render_grafana("services", src.database),
        "service.name of the instrumented servers and load generators",
    )


def model_variable(src: Source) -> dict:
    return query_variable(
        "model",
        "Model",
        queries.render_grafana("models", src.database),
        "gen_ai.response.model, else gen_ai.request.model",
    )


def slo_variables() -> list[dict]:
    return [
        textbox_variable(
            "ttft_slo_ms", "TTFT SLO (ms)", DEFAULT_TTFT_SLO_MS, "a request meets the SLO when its TTFT is at most this"
        ),
        textbox_variable(
            "tpot_slo_ms",
            "TPOT SLO (ms)",
            DEFAULT_TPOT_SLO_MS,
            "...and its TPOT, (e2e - TTFT) / (output tokens - 1), at most this",
        ),
    ]


# --- LLM latency budget --------------------------------------------------------------------------


def _per_token() -> tuple[str, ...]:
    return tuple(c for c in columns("latency_over_time") if "_tpot_" in c or "_itl_" in c)


def _term_override(term: terms.Term) -> dict:
    """A term's segment in its declared colour (as in the report); an estimate says so in the legend
    and the tooltip."""
    props: list[dict] = [{"id": "color", "value": {"mode": "fixed", "fixedColor": term.colour}}]
    if term.estimate:
        props.append({"id": "displayName", "value": f"{term.name} (estimate)"})
    return {"matcher": {"id": "byName", "options": term.name}, "properties": props}


def budget_bars(src: Source, query: str, title: str, description: str, *, width: int) -> dict:
    """A budget as horizontal stacked bars, one bar per statistic (`query`'s first column), a segment per term."""
    return panel(
        "barchart",
        title,
        description,
        [src.target(query, FORMAT_TABLE)],
        width=width,
        height=9,
        unit="ms",
        custom={"fillOpacity": 80, "lineWidth": 1},
        overrides=[
            *(_term_override(terms.REGISTRY.term(name)) for name in columns(query)[1:]),
            unobserved_override(columns(query)[1:]),
        ],
        options={
            "orientation": "horizontal",
            "stacking": "normal",
            "showValue": "auto",
            "xField": columns(query)[0],
            "legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
        },
    )


def _diagnosis_panel(src: Source) -> dict:
    """The verdict table; its description quotes the thresholds the SQL uses (analysis/thresholds.py)."""
    return panel(
        "table",
        "Diagnosis: why is it slow?",
        "Why is it slow? The verdict of `phaselens diagnose`, from the same SQL over the rollups "
        f"(figures' p50 and p99 and the engine's from DDSketch states within {sketch.ALPHA:.0%}): one row per cause, "
        "primary first. A cause is flagged at p50 or p99 when its signal reaches its threshold while "
        f"the SLO it acts on is at risk there (above {th.MARGIN:g} x $ttft_slo_ms ms TTFT or $tpot_slo_ms ms "
        "TPOT). Signals: a TTFT term's share of TTFT (queue, prefill, ingress, delivery, network), the "
        "server's share of TPOT (decode) and the client's (client), the decode-token time lost to "
        f"prefill in mixed steps (prefill_stalls), KV use p90 / {th.KV_USED:g} or preempted share / "
        f"{th.PREEMPTED_SHARE:g} (kv_pressure). role none: every SLO holds with margin.",
        [src.target("diagnosis_causes_rollup", FORMAT_TABLE)],
        width=24,
        height=8,
        unit="none",
        options={"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
    )


def budget_panels(src: Source) -> list[dict]:
    trace_url = (
        f"/d/{UID_TRACE}/request-trace?var-trace_id=${{__value.raw}}&${{datasource:queryparam}}&${{__url_time_range}}"
    )
    return [
        _diagnosis_panel(src),
        budget_bars(
            src,
            "budget_stack",
            "TTFT budget: p50 / p90 / p99 / mean",
            from_rollups(
                "Where does time to first token go? Each bar is one statistic (p50, p90, p99 of each term, "
                "and the mean, whose terms add up exactly): TTFT = inbound + ingress + queue + prefill + first "
                "token + held back + first chunk + client + client_late_est + residual. Every term but one is a "
                "duration on one clock; first chunk = the server's delivery of the first output (token handed to "
                "the stream -> chunk handed to the server's send); inbound and client = the waits of the request's "
                "and the first chunk's bytes in the server's and the client's kernel (kernel receive stamps); "
                "client_late_est is an ESTIMATE: the wait a late client's read hid because TCP stamped it with "
                "a later chunk's packet (the server's send gap to that chunk); residual = what no stamp explains "
                "(network both ways). "
                "A server whose own spans give no first-token term (span_model vllm-native, sglang-native) "
                "fills before_engine = server TTFT - ingress - queue - prefill instead, and its first chunk's "
                "delivery stays in residual; TGI's spans (tgi-native) give no TTFT: only ingress and queue."
            ),
            width=10,
        ),
        time_series(
            src,
            "latency_over_time",
            "TTFT, TTFO and e2e percentiles",
            from_rollups(
                "How long do users wait for the first token (TTFT, client and server view), the first "
                "non-reasoning output (TTFO) and the whole response (e2e), over time?"
            ),
            unit="ms",
            width=14,
            height=9,
            transformations=series("latency_over_time", exclude=_per_token()),
        ),
        time_series(
            src,
            "latency_over_time",
            "TPOT and ITL percentiles",
            from_rollups(
                "How fast does text stream once it starts? TPOT = (e2e - TTFT) / (output tokens - 1) per "
                "request; ITL = the gaps between streamed chunks (p99 within each request). Different "
                "statistics, both shown, client and server view."
            ),
            unit="ms",
            transformations=series("latency_over_time", only=_per_token()),
        ),
        time_series(
            src,
            "delivery_over_time",
            "Server delivery of the first chunk vs the residual (p90)",
            from_rollups(
                "Is my event loop starved or is my network slow? first chunk = the server's time from "
                "the first token handed to the stream to its chunk handed to the server's send = loop wait "
                "(the event loop was late) + encode (SSE) + write (send); residual = client TTFT - "
                "server time to first chunk (network both ways + client)."
            ),
            unit="ms",
        ),
        time_series(
            src,
            "goodput_over_time",
            "Goodput and SLO attainment",
            from_rollups(
                "How many completed requests per second meet every SLO (TTFT <= $ttft_slo_ms ms and "
                "TPOT <= $tpot_slo_ms ms), against all completed requests, and what fraction of "
                "requests is that (right axis)?"
            ),
            unit="reqps",
            overrides=[unit_override("^slo_attainment$", "percentunit", right_axis=True)],
        ),
        time_series(
            src,
            "throughput_over_time",
            "Throughput: requests and tokens per second",
            from_rollups(
                "How much work is finished per second: requests (and errors, right axis), input "
                "(prompt) and output (generated) tokens? Throughput is not TPOT."
            ),
            unit="short",
            overrides=[unit_override("^(requests|errors)_per_s$", "reqps", right_axis=True)],
        ),
        panel(
            "table",
            "Slowest requests",
            "Which requests had the longest TTFT, and which phase dominated each? Click a trace id to "
            "open that request's client and server spans in the Request trace dashboard. Exact: each "
            "minute of the rollups keeps its 50 slowest requests, whose merge is the range's (whole minutes).",
            [src.target("slowest_requests_rollup", FORMAT_TABLE)],
            width=24,
            height=10,
            unit="ms",
            overrides=[
                link_override("trace_id", "Open request trace", trace_url),
                unit_override("^(input_tokens|output_tokens|preemptions)$", "none"),
                unobserved_override([name for name, _ in queries.COMPONENTS]),
            ],
            options={"showHeader": True, "cellHeight": "sm", "footer": {"show": False}},
        ),
        _pd_budget_panel(src),
    ]


def _pd_budget_panel(src: Source) -> dict:
    """The disaggregated TTFT budget of `phaselens budget` (analysis/queries/pd_queries.py), from the rollups
    (`pd_budget_stack_rollup`; `phaselens budget` reads every request: `pd_summary`)."""
    return budget_bars(
        src,
        "pd_budget_stack_rollup",
        "Disaggregated TTFT budget: router, prefill, KV transfer, decode",
        from_rollups(
            "Where does time to first token go when prefill and decode run on separate instances? Each bar "
            "is one statistic over the requests that went router -> prefill -> decode with every term known "
            "(p50, p90, p99 of each term, and the mean, whose terms add up to the mean client TTFT). Every "
            "term is a duration on one host's clock: the router's terms, the prefill instance's (ingress, "
            "queue, compute, first token, KV wait, kv_transfer = send start -> the decode side's "
            "acknowledgement, answer), the decode instance's (ingress, queue, first token, first chunk); "
            "the hops between hosts are residuals of durations (the caller's span minus the callee's), "
            "never differences of two hosts' clocks. Filtered by model, not service. Empty without "
            "disaggregated requests; SGLang's P/D spans never complete it (its instances run in parallel)."
        ),
        width=24,
    )


def latency_budget(src: Source) -> dict:
    return dashboard(
        UID_BUDGET,
        "phaselens - LLM latency budget",
        "Client and server view of every request: TTFT split into phases, percentiles, goodput against "
        "the SLO variables, throughput, and the slowest requests.",
        budget_panels(src),
        [
            datasource_variable(DATASOURCE_UID, DATASOURCE_NAME),
            service_variable(src),
            model_variable(src),
            *slo_variables(),
        ],
        links=[dashboard_link("phaselens")],
    )


# --- Engine --------------------------------------------------------------------------------------


def engine_panels(src: Source) -> list[dict]:
    tokens = tuple(c for c in columns("engine_batch_over_time") if "tokens" in c)
    preempt = tuple(c for c in columns("engine_kv_over_time") if "preempt" in c)
    return [
        time_series(
            src,
            "engine_batch_over_time",
            "Batch size per engine step",
            "How many sequences does each engine step run together (mean and max per interval), "
            "and how many steps run per second (right axis)? Small batches under load point at the "
            "scheduler, not the model, as the limit.",
            unit="short",
            transformations=series("engine_batch_over_time", exclude=tokens),
            overrides=[unit_override("^steps_per_s$", "short", right_axis=True)],
        ),
        time_series(
            src,
            "engine_batch_over_time",
            "Prefill vs decode tokens per step",
            "How is each step's work split between prompt processing (prefill tokens) and "
            "generation (decode tokens)? Prefill-heavy steps are the ones that stall decoding.",
            unit="short",
            stacked=True,
            bars=True,
            transformations=series("engine_batch_over_time", only=tokens),
        ),
        time_series(
            src,
            "engine_kv_over_time",
            "KV-cache use",
            "How full is the KV cache (blocks used / total, mean and max; blocks used on the right "
            "axis)? Near 100 % the scheduler must queue or preempt requests.",
            unit="percentunit",
            transformations=series("engine_kv_over_time", exclude=preempt),
            overrides=[unit_override("^kv_blocks_used_max$", "short", right_axis=True)],
        ),
        time_series(
            src,
            "engine_kv_over_time",
            "Preemptions",
            "How many running requests are evicted for lack of KV cache? Each one waits in the "
            "queue again and recomputes its prefill.",
            unit="short",
            bars=True,
            transformations=series("engine_kv_over_time", only=preempt),
        ),
        time_series(
            src,
            "decode_stalls_over_time",
            "Decode stalls caused by prefill",
            "How much time do decoding requests lose because a prefill shares their step? A mixed "
            "step's stall is its duration beyond the median decode-only step; request stall weights "
            "it by the decode tokens delayed. Step counts on the right axis.",
            unit="ms",
            overrides=[unit_override("^(mixed_steps|decode_steps|delayed_decodes)$", "short", right_axis=True)],
        ),
        time_series(
            src,
            "queue_depth_over_time",
            "Queue depth",
            "How many requests wait for admission at each engine step (mean and max)? A growing "
            "queue means arrivals exceed capacity, and TTFT grows with it.",
            unit="short",
        ),
    ]


def engine(src: Source) -> dict:
    return dashboard(
        UID_ENGINE,
        "phaselens - Engine",
        "The serving loop from the inside: batch composition, KV-cache pressure, preemptions, "
        "prefill-induced decode stalls and the admission queue, from llm.engine_step spans.",
        engine_panels(src),
        [datasource_variable(DATASOURCE_UID, DATASOURCE_NAME), service_variable(src)],
        links=[dashboard_link("phaselens")],
    )


# --- Request trace -------------------------------------------------------------------------------


def request_trace(src: Source) -> dict:
    trace = panel(
        "traces",
        "Request trace",
        "What happened to this one request, phase by phase? The client span, the server span "
        "and its ingress, queue, prefill, first-token, decode and delivery children on one "
        "timeline, found through the trace-id lookup table.",
        [src.target("request_trace", FORMAT_TRACES)],
        width=24,
        height=22,
    )
    return dashboard(
        UID_TRACE,
        "phaselens - Request trace",
        "One request's spans, client and server. Enter a trace id, or follow a link from the Slowest requests table.",
        [trace],
        [
            datasource_variable(DATASOURCE_UID, DATASOURCE_NAME),
            textbox_variable("trace_id", "Trace ID", "", "32 hex digits, e.g. from the Slowest requests table"),
        ],
        time_from="now-24h",
        refresh="",
        links=[dashboard_link("phaselens")],
    )


def all_dashboards(database: str = "otel") -> list[dict]:
    src = Source(database)
    return [latency_budget(src), engine(src), request_trace(src)]
