"""Every panel's SQL, with the Grafana macros expanded by a STAND-IN for Grafana's macro engine
(tests/dashboards_fixtures.py), runs against the real embedded ClickHouse holding spans built with
the real OTel SDK (tests/spangen.py) and returns the columns the panel expects."""

from __future__ import annotations

import itertools
import subprocess
import sys
import time

import clickhouse_connect
import pytest

from phaselens.analysis import queries as queries
from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema import schema as analysis_schema
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as collector_schema
from phaselens.dashboards import generate
from phaselens.instrumentation import names as n
from phaselens.stack import CLIENT_SERVICE, SERVER_SERVICE, Stack
from tests import spangen
from tests.dashboards_fixtures import ALL, GrafanaQueryContext, expand_grafana_sql

DATABASE = "dashboards_panels"
N_REQUESTS = 80
INTERVAL_S = 10
# the rate panels read the per-minute rollups: a point per minute at least, its rate per second of it
BUCKET_S = max(INTERVAL_S, 60)
_names = itertools.count()


@pytest.fixture(scope="module")
def loaded(clickhouse):
    """A database with the schema and a workload: 80 requests (some preempted, aborted or
    server-only) and 120 engine steps over the last ~2 minutes."""
    client = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port)
    database = f"{DATABASE}_{next(_names)}"
    client.command(f"DROP DATABASE IF EXISTS {database}")
    collector_schema.apply(client, ddl.all_statements(database))
    rollup.stop_refreshes(client, database)
    workload = spangen.generate(
        N_REQUESTS,
        seed=7,
        rate_rps=2.0,
        start_ns=time.time_ns() - 60 * 10**9,
        preempt_every=5,
        abort_every=11,
        server_only_every=9,
        n_steps=120,
    )
    spangen.emit(workload, clickhouse_url=clickhouse.url, database=database, seed=7)
    rollup.refresh_live(client, database)
    client.close()
    yield database, workload


@pytest.fixture()
def client(clickhouse, loaded):
    c = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port, database=loaded[0])
    yield c
    c.close()


def _context(workload, **variables) -> GrafanaQueryContext:
    now = int(time.time())
    start = min(r.start_ns for r in workload.requests) // 10**9
    values = {
        "service": ALL,
        "model": ALL,
        "ttft_slo_ms": "500",
        "tpot_slo_ms": "50",
        "trace_id": workload.requests[0].trace_id,
        **variables,
    }
    return GrafanaQueryContext(
        start - 60,
        now + 60,
        INTERVAL_S,
        values,
        options={"service": [workload.server_service, workload.client_service], "model": ["tiny"]},
    )


def _targets(database: str) -> list[tuple[str, str, dict]]:
    """(dashboard uid, panel title, target) for every panel target of every dashboard."""
    return [
        (board["uid"], p["title"], t)
        for board in generate.dashboards(database)
        for p in board["panels"]
        for t in p["targets"]
    ]


def _query_name(database: str, sql: str) -> str:
    matches = [name for name in queries.PANEL_COLUMNS if queries.render_grafana(name, database) == sql]
    assert len(matches) == 1, f"panel SQL is not exactly one analysis query: {matches}"
    return matches[0]


def _run(client, sql: str, ctx: GrafanaQueryContext):
    return client.query(expand_grafana_sql(sql, ctx))


def test_every_panel_query_returns_its_columns_and_rows(client, loaded):
    database, workload = loaded
    ctx = _context(workload)
    seen = set()
    for uid, title, tgt in _targets(database):
        name = _query_name(database, tgt["rawSql"])
        seen.add(name)
        result = _run(client, tgt["rawSql"], ctx)
        assert tuple(result.column_names) == tuple(queries.PANEL_COLUMNS[name]), (uid, title)
        assert result.result_rows, f"{uid} / {title}: no rows although spans exist"
        if name.endswith("_over_time"):  # time series: the first column is the bucket time
            assert tgt["format"] == 0 and result.column_names[0] == "time"
            values = [v for row in result.result_rows for v in row[1:] if v is not None]
            assert any(v > 0 for v in values), f"{uid} / {title}: every value is zero or NULL"
    assert seen == set(queries.PANEL_COLUMNS)


def test_throughput_counts_every_request_once(client, loaded):
    database, workload = loaded
    result = _run(client, queries.render_grafana("throughput_over_time", database), _context(workload))
    rows = list(result.named_results())
    assert sum(r["requests_per_s"] * BUCKET_S for r in rows) == pytest.approx(N_REQUESTS)
    assert sum(r["output_tokens_per_s"] * BUCKET_S for r in rows) == pytest.approx(
        sum(r.output_tokens for r in workload.requests)
    )


def test_slowest_requests_rank_by_ttft_and_link_traces(client, loaded):
    database, workload = loaded
    rows = list(_run(client, queries.render_grafana("slowest_requests", database), _context(workload)).named_results())
    truth = {r.trace_id: r for r in workload.requests}
    ttfts = [r["ttft_ms"] for r in rows]
    assert ttfts == sorted(ttfts, reverse=True)
    top = max(workload.requests, key=lambda r: r.client_ttft_ms if r.has_client else r.server_ttft_ms)
    assert rows[0]["trace_id"] == top.trace_id and rows[0]["trace_id"] in truth


def test_request_trace_returns_that_trace_only(client, loaded):
    database, workload = loaded
    r = workload.requests[4]  # preempted: two queue waits
    rows = list(
        _run(
            client, queries.render_grafana("request_trace", database), _context(workload, trace_id=r.trace_id)
        ).named_results()
    )
    assert {row["traceID"] for row in rows} == {r.trace_id}
    names = sorted(row["operationName"] for row in rows)
    assert names.count(n.SPAN_QUEUE) == 2 and n.SPAN_PREFILL in names and n.SPAN_DECODE in names
    server = next(row for row in rows if row["spanID"] == r.server_span_id)
    phases = [row for row in rows if row["operationName"] in n.PHASE_SPANS]
    assert len(phases) >= 6 and {row["parentSpanID"] for row in phases} == {server["spanID"]}
    assert server["duration"] == pytest.approx(r.server_e2e_ms, abs=0.01)


def test_model_and_service_variables_filter(client, loaded):
    database, workload = loaded
    sql = queries.render_grafana("throughput_over_time", database)
    assert _run(client, sql, _context(workload, model=["tiny"])).result_rows
    assert _run(client, sql, _context(workload, model="tiny")).result_rows  # one value, not a list
    assert _run(client, sql, _context(workload, model=["no-such-model"])).result_rows == []
    assert _run(client, sql, _context(workload, service=["no-such-service"])).result_rows == []


def test_time_range_filters(client, loaded):
    database, workload = loaded
    sql = queries.render_grafana("latency_over_time", database)
    ctx = _context(workload)
    ctx.from_unix_s, ctx.to_unix_s = ctx.from_unix_s - 7200, ctx.from_unix_s - 3600
    assert _run(client, sql, ctx).result_rows == []


def test_variable_queries_list_models_and_services(client, loaded):
    database, workload = loaded
    ctx = _context(workload)
    board = generate.dashboards(database)[0]
    found = {}
    for var in board["templating"]["list"]:
        if var["type"] == "query":
            found[var["name"]] = {row[0] for row in _run(client, var["query"]["rawSql"], ctx).result_rows}
    assert found["model"] == {"tiny"}
    # the services the panels can select, from the rollups: the requests' (server, else client:
    # every request here has a server) and the engine steps'
    assert found["service"] == {workload.server_service}


def test_slo_variables_change_goodput(client, loaded):
    database, workload = loaded
    sql = queries.render_grafana("goodput_over_time", database)

    def attained(ttft: str, tpot: str) -> float:
        rows = list(_run(client, sql, _context(workload, ttft_slo_ms=ttft, tpot_slo_ms=tpot)).named_results())
        return sum(r["goodput_rps"] for r in rows) * BUCKET_S

    loose, tight = attained("100000", "100000"), attained("1", "1")
    completed = sum(1 for r in workload.requests if not r.aborted)
    assert loose == pytest.approx(completed) and tight == 0


def test_every_panel_on_a_real_run(tmp_path):
    """The real pipeline (phaselens.stack: embedded ClickHouse, collector, reference server with the
    tiny model) under a short `phaselens bench` load: every panel query has its columns and rows."""
    with Stack(str(tmp_path), server_args=("--max-num-seqs", "4")) as stack:
        bench = subprocess.run(
            [
                sys.executable,
                "-m",
                "phaselens",
                "bench",
                "--url",
                stack.server_url,
                "--model",
                "tiny",
                "--rate",
                "inf",
                "--requests",
                "10",
                "--input-len",
                "24",
                "--output-len",
                "6",
                "--quiet",
            ],
            env=stack.otel_env(CLIENT_SERVICE),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert bench.returncode == 0, bench.stderr[-2000:]
        assert stack.server.stop(30) == 0 and stack.collector.stop(30) == 0  # flush, then drain
        with stack.client() as ch:
            rollup.refresh_now(ch, stack.database)
            trace_id = ch.query(
                f"SELECT any(TraceId) FROM {stack.database}.otel_traces WHERE SpanKind = 'Client'"
            ).result_rows[0][0]
            now = int(time.time())
            ctx = GrafanaQueryContext(
                now - 600,
                now + 60,
                1,
                {"service": ALL, "model": ALL, "ttft_slo_ms": "60000", "tpot_slo_ms": "60000", "trace_id": trace_id},
                options={"service": [SERVER_SERVICE, CLIENT_SERVICE], "model": ["tiny"]},
            )
            for name, cols in queries.PANEL_COLUMNS.items():
                result = _run(ch, queries.render_grafana(name, stack.database), ctx)
                assert tuple(result.column_names) == tuple(cols), name
                assert result.result_rows, f"{name}: no rows from a real run"
            rows = _run(ch, queries.render_grafana("throughput_over_time", stack.database), ctx).named_results()
            assert sum(r["requests_per_s"] * 60 for r in rows) == pytest.approx(10)  # minutes of the rollup
