"""Every named query runs in both renderings, returns its declared columns, and binds user values."""

from __future__ import annotations

import inspect
import re

import pytest

from phaselens.analysis import queries as Q
from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.queries.dialect import CliDialect, Dialect, GrafanaDialect, QueryError
from phaselens.analysis.schema import schema as S
from phaselens.analysis.schema.pd_schema import PD_COLUMN_NAMES
from phaselens.analysis.sql import cookbook, ddl
from phaselens.instrumentation import names as n
from tests import spangen
from tests.analysis_fixtures import client, loaded

EVIL = "tiny' OR 1=1; DROP TABLE otel_traces; --"


@pytest.fixture(scope="module")
def data(clickhouse):
    w = spangen.generate(
        40, seed=9, models=("tiny", "small"), server_only_every=5, abort_every=6, preempt_every=7, n_steps=30
    )
    return w, loaded(clickhouse, w, transport="insert")


def _expand_grafana(sql: str, variables: dict[str, str]) -> str:
    """A stand-in for the Grafana ClickHouse plugin's macro expansion (no Grafana server here):
    the time range is the last hour, buckets are 10 s, `All` leaves a conditionalAll out."""
    sql = re.sub(r"\$__timeFilter\(([^)]*)\)", r"\1 >= toDateTime(now() - 3600) AND \1 <= toDateTime(now() + 60)", sql)
    sql = re.sub(r"\$__timeInterval\(([^)]*)\)", r"toStartOfInterval(toDateTime(\1), INTERVAL 10 second)", sql)
    sql = sql.replace("$__interval_s", "10").replace("$__fromTime", "toDateTime(now() - 3600)")
    sql = sql.replace("$__toTime", "toDateTime(now() + 60)")
    while "$__conditionalAll(" in sql:
        start = sql.index("$__conditionalAll(")
        depth, i = 0, start + len("$__conditionalAll")
        while True:
            depth += {"(": 1, ")": -1}.get(sql[i], 0)
            if depth == 0:
                break
            i += 1
        condition, _, var = sql[start + len("$__conditionalAll(") : i].rpartition(",")
        sql = sql[:start] + ("1=1" if variables[var.strip().lstrip("$")] == "$__all" else condition) + sql[i + 1 :]
    for name, value in variables.items():
        sql = sql.replace(f"${{{name}:singlequote}}", f"'{value}'").replace(f"${{{name}}}", value)
    return sql


def test_every_cli_query_runs_and_returns_its_columns(client, data):
    w, db = data
    for name, query in Q.QUERIES.items():
        sql, params = Q.render_cli(name, database=db, since="1h", trace_id=w.requests[0].trace_id, bucket_s=5)
        result = client.query(sql, parameters=params)
        assert tuple(result.column_names) == query.columns, name
        assert result.result_rows, name


def test_every_panel_query_runs_as_grafana_renders_it(client, data):
    w, db = data
    variables = {
        "service": "$__all",
        "model": "tiny",
        "ttft_slo_ms": "40",
        "tpot_slo_ms": "15",
        "trace_id": w.requests[1].trace_id,
    }
    assert set(Q.PANEL_COLUMNS) == {
        "budget_stack",
        "latency_over_time",
        "delivery_over_time",
        "goodput_over_time",
        "throughput_over_time",
        "slowest_requests_rollup",
        "engine_batch_over_time",
        "engine_kv_over_time",
        "decode_stalls_over_time",
        "queue_depth_over_time",
        "request_trace",
        "diagnosis_causes_rollup",
        "pd_budget_stack_rollup",
    }
    for name, columns in Q.PANEL_COLUMNS.items():
        sql = Q.render_grafana(name, database=db)
        assert "{" not in sql.replace("${", ""), name  # no bound-parameter placeholder left
        result = client.query(_expand_grafana(sql, variables))
        assert tuple(result.column_names) == columns and result.result_rows, name


def test_request_trace_returns_every_span_of_the_trace(client, data):
    w, db = data
    r = w.requests[0]
    sql, params = Q.render_cli("request_trace", database=db, trace_id=r.trace_id)
    rows = list(client.query(sql, parameters=params).named_results())
    assert len(rows) == 9 + r.prefill_chunks + r.preemptions
    server = next(x for x in rows if x["spanID"] == r.server_span_id)
    assert server["duration"] == pytest.approx(r.server_e2e_ms, abs=1e-6)
    assert {t["key"] for t in server["tags"]} >= {n.PL_SERVER_TTFT_MS, n.GEN_AI_REQUEST_MODEL}


def test_slowest_requests_names_the_dominant_phase(client, data):
    _w, db = data
    sql, params = Q.render_cli("slowest_requests", database=db, limit=3)
    rows = list(client.query(sql, parameters=params).named_results())
    assert len(rows) == 3 and rows[0]["ttft_ms"] >= rows[1]["ttft_ms"] >= rows[2]["ttft_ms"]
    for row in rows:
        terms = {name.removesuffix("_ms"): row[name] or 0 for name, _ in Q.COMPONENTS}
        assert row["dominant_phase"] == max(terms, key=terms.get)


def test_a_malicious_model_value_is_only_ever_a_bound_value(client, data):
    _, db = data
    sql, params = Q.render_cli("budget_summary", database=db, model=EVIL)
    assert EVIL not in sql and params["model"] == EVIL
    report = budget(client, database=db, model=EVIL, since=None)
    assert report.requests == 0
    assert client.query(f"SELECT count() FROM {db}.otel_traces").result_rows[0][0] > 0
    assert budget(client, database=db, model="tiny", since=None).requests == 20


def test_filters_select_the_right_requests(client, data):
    w, db = data
    assert budget(client, database=db, service="nobody", since=None).requests == 0
    assert budget(client, database=db, service=w.server_service, since="1h").requests == 40
    sql, params = Q.render_cli("budget_by_model", database=db)
    by_model = {r["model"]: r for r in client.query(sql, parameters=params).named_results()}
    assert {m: r["requests"] for m, r in by_model.items()} == {"tiny": 20, "small": 20}
    small = [r for r in w.requests if r.model == "small"]
    assert by_model["small"]["prefill_ms_mean"] == pytest.approx(sum(r.prefill_ms for r in small) / 20)


def test_bad_names_and_values_are_clear_errors():
    with pytest.raises(QueryError, match="unknown query"):
        Q.render_cli("drop_everything")
    with pytest.raises(QueryError, match="unknown filter"):
        Q.render_cli("budget_summary", modle="tiny")
    with pytest.raises(QueryError, match="duration"):
        Q.render_cli("budget_summary", since="yesterday")


def test_schema_statements_for_a_cluster(client):
    """No cluster here: the DDL is checked for syntax by ClickHouse's own parser (formatQuery)."""
    stmts = S.statements("otel", cluster="main")
    for sql in stmts:
        assert client.query("SELECT formatQuery({q:String})", parameters={"q": sql}).result_rows
    assert all(' ON CLUSTER "main"' in s for s in stmts)
    assert "ReplicatedAggregatingMergeTree()" in stmts[0]
    assert any("Distributed('main', 'otel', 'phaselens_request_parts'" in s for s in stmts)
    assert all("otel_traces_distributed" in s for s in stmts if 'VIEW "otel"."phaselens_steps"' in s)
    assert "TTL toDateTime(first_seen) + toIntervalDay(3)" in S.statements("otel", ttl="72h")[0]


def test_requests_view_has_exactly_the_documented_columns(client, data):
    _, db = data
    names = [r[0] for r in client.query(f"DESCRIBE {db}.phaselens_requests").result_rows]
    assert names == [
        "trace_id",
        "request_id",
        "service",
        "model",
        "server_start_time",
        "status",
        "error_type",
        "input_tokens",
        "output_tokens",
        "cached_tokens",
        "reasoning_tokens",
        "client_ttft_ms",
        "client_ttfo_ms",
        "client_tpot_ms",
        "client_e2e_ms",
        "server_ttft_ms",
        "server_ttfc_ms",
        "ingress_ms",
        "queue_ms",
        "prefill_ms",
        "prefill_chunks",
        "first_token_ms",
        "held_back_ms",
        "first_chunk_ms",
        "decode_ms",
        "delivery_ms",
        "server_tpot_ms",
        "itl_p99_ms",
        "stall_ms",
        "preemptions",
        "inbound_ms",
        "client_ms",
        "client_late_est_ms",
        "residual_ms",
        "e2e_residual_ms",
        "clock_offset_estimate_ms",
        "span_model",
        "before_engine_ms",
        "x_request_id",
        "client_harness",
        *PD_COLUMN_NAMES,  # a disaggregated request's columns (docs/disaggregation.md), NULL otherwise
    ]
    steps = [r[0] for r in client.query(f"DESCRIBE {db}.phaselens_steps").result_rows]
    assert tuple(steps) == S.STEPS_VIEW_COLUMNS


def test_cookbook_renders_six_named_queries_with_their_parameters():
    text = cookbook.markdown()
    assert len(cookbook.ENTRIES) >= 6 and all(f"`{name}`" in text for name, _, _ in cookbook.ENTRIES)
    assert {
        "slowest_requests",
        "budget_by_model",
        "ttft_vs_prompt_length",
        "queueing_vs_load",
        "goodput_per_minute",
        "request_spans",
    } <= {name for name, _, _ in cookbook.ENTRIES}
    assert "--param_ttft_slo_ms='200'" in text and "{ttft_slo_ms:Float64}" in text


def test_request_spans_places_each_service_on_its_own_clock(client, data):
    w, db = data
    r = next(x for x in w.requests if x.has_client and not x.preemptions)
    sql, params = Q.render_cli("request_spans", database=db, trace_id=r.trace_id)
    rows = list(client.query(sql, parameters=params).named_results())
    offsets = {(x["service"], x["span"]): x["offset_ms"] for x in rows}
    root = n.root_span_name(n.OP_TEXT_COMPLETION, r.model)
    assert offsets[(w.client_service, root)] == offsets[(w.server_service, root)] == 0
    assert offsets[(w.server_service, n.SPAN_DECODE)] == pytest.approx(r.server_ttft_ms, abs=1e-6)


def test_both_dialects_answer_every_question_a_template_may_ask():
    asked = {
        name: inspect.signature(fn) for name, fn in vars(Dialect).items() if callable(fn) and not name.startswith("_")
    }
    assert len(asked) == 9
    for dialect in (CliDialect, GrafanaDialect):
        answered = {name: inspect.signature(getattr(dialect, name, None) or (lambda: None)) for name in asked}
        assert {n: list(s.parameters) for n, s in answered.items()} == {n: list(s.parameters) for n, s in asked.items()}


def test_a_schema_from_an_older_phaselens_is_upgraded_in_place(clickhouse, client, monkeypatch):
    """A parts table and view made before the first-chunk columns existed: applying the schema again
    adds the columns and points the view at them, so new spans fill them and old rows stay."""
    db = "upgrade_test"
    client.command(f"DROP DATABASE IF EXISTS {db}")
    new_columns = {
        "d_first_chunk",
        "a_first_chunk_ms",
        "a_loop_wait_ms",
        "a_encode_ms",
        "a_write_ms",
        "a_server_ttfc_ms",
        "a_server_last_chunk_ms",
    }
    with monkeypatch.context() as m:  # what an older phaselens created: the tables and the parts view
        m.setattr(S, "PARTS", tuple(p for p in S.PARTS if p.column not in new_columns))
        S.collector_schema.apply(client, S.collector_schema.statements(db) + S.statements(db)[:-3])
    described = {r[0] for r in client.query(f"DESCRIBE {db}.{S.PARTS_TABLE}").result_rows}
    assert not described & new_columns
    S.collector_schema.apply(client, ddl.all_statements(db))
    described = {r[0] for r in client.query(f"DESCRIBE {db}.{S.PARTS_TABLE}").result_rows}
    assert new_columns <= described
    w = spangen.generate(6, seed=3)
    spangen.emit(w, clickhouse.url, db)
    rows = {
        r["trace_id"]: r
        for r in client.query(f"SELECT trace_id, first_chunk_ms FROM {db}.phaselens_requests").named_results()
    }
    assert all(rows[r.trace_id]["first_chunk_ms"] == pytest.approx(r.first_chunk_ms) for r in w.requests)
