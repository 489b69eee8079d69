"""Idle ranges and unobserved terms on every surface: every dashboard panel (macros expanded by the
stand-in for Grafana's engine, tests/dashboards_fixtures.py), every cookbook and checked-in SQL
query and `phaselens budget` run without error on a fresh schema with no rows, on server-only
traffic, on server spans whose client spans have not arrived, and on full data; a term no request
stamped is NULL (JSON null, CSV empty), never 0. Spans go through the real OTel SDK, OTLP exporter
and collector (tests/spangen.py)."""

from __future__ import annotations

import argparse
import csv
import io
import json
import time

import pytest

from phaselens.analysis import queries as queries
from phaselens.analysis.sql import cookbook, sql_files
from phaselens.commands import budget as budget_command
from phaselens.dashboards import generate
from tests import spangen
from tests.analysis_fixtures import client, loaded, new_database
from tests.dashboards_fixtures import ALL, GrafanaQueryContext, expand_grafana_sql

CLIENT_TERMS = ("client_ms", "client_late_est_ms")
N_REQUESTS = 12
DATASETS = ("empty", "server_only", "client_pending", "full")
CHECKED_IN = sql_files.PACKAGE_DIR / sql_files.SQL_DIR


@pytest.fixture(scope="module")
def data(clickhouse, client) -> dict[str, tuple[str, spangen.Workload | None]]:
    """One database per data set, one ClickHouse for the module."""
    server_only = spangen.generate(N_REQUESTS, seed=5, server_only_every=1)
    pending = spangen.generate(N_REQUESTS, seed=6)
    full = spangen.generate(N_REQUESTS, seed=7, server_only_every=4, n_steps=10)
    return {
        "empty": (new_database(client), None),
        "server_only": (loaded(clickhouse, server_only), server_only),
        "client_pending": (loaded(clickhouse, pending, services=(pending.server_service,)), pending),
        "full": (loaded(clickhouse, full), full),
    }


def _context(workload: spangen.Workload | None) -> GrafanaQueryContext:
    now = int(time.time())
    trace_id = workload.requests[0].trace_id if workload else "0" * 32
    return GrafanaQueryContext(
        now - 600,
        now + 60,
        10,
        {"service": ALL, "model": ALL, "ttft_slo_ms": "500", "tpot_slo_ms": "50", "trace_id": trace_id},
        options={"service": ["phaselens-server", "phaselens-loadgen"], "model": ["tiny"]},
    )


def _panel_queries(database: str) -> list[tuple[str, str]]:
    """(title, SQL) of every panel target and query variable of every generated dashboard."""
    out = []
    for board in generate.dashboards(database):
        out += [(p["title"], t["rawSql"]) for p in board["panels"] for t in p["targets"]]
        out += [(v["name"], v["query"]["rawSql"]) for v in board["templating"]["list"] if v["type"] == "query"]
    return out


def _rows(client, sql: str, **params) -> list[dict]:
    return list(client.query(sql, parameters=params or None).named_results())


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_panel_query_runs(client, data, dataset):
    database, workload = data[dataset]
    ctx = _context(workload)
    panels = _panel_queries(database)
    assert len(panels) >= 16
    for title, sql in panels:
        try:
            client.query(expand_grafana_sql(sql, ctx))
        except Exception as e:  # noqa: BLE001 — name the panel that failed
            pytest.fail(f"{dataset}: panel {title!r} failed: {str(e)[:400]}")


def _budget_panel(client, database: str, workload) -> list[dict]:
    sql = queries.render_grafana("budget_stack", database)
    return _rows(client, expand_grafana_sql(sql, _context(workload)))


def test_budget_panel_on_an_empty_range_has_no_rows(client, data):
    assert _budget_panel(client, *data["empty"]) == []


@pytest.mark.parametrize("dataset", ["server_only", "client_pending"])
def test_budget_panel_client_terms_are_null_without_client_spans(client, data, dataset):
    rows = _budget_panel(client, *data[dataset])
    assert [r["statistic"] for r in rows] == ["p50", "p90", "p99", "mean"]
    for r in rows:
        assert all(r[t] is None for t in CLIENT_TERMS), r
        assert r["inbound_ms"] is None  # no kernel receive stamps in these spans either
        assert r["prefill_ms"] > 0 and r["queue_ms"] > 0 and r["before_engine_ms"] is None


def test_budget_panel_stamped_terms_are_figures_with_full_data(client, data):
    """A gated term that was stamped (first_chunk: loop_wait) is a figure; these client spans carry
    no client send/read stamps, so the client terms stay unobserved beside a residual."""
    rows = _budget_panel(client, *data["full"])
    assert len(rows) == 4, rows
    assert all(r["first_chunk_ms"] > 0 and r["residual_ms"] > 0 and r["client_ms"] is None for r in rows), rows


@pytest.mark.parametrize("dataset", ["server_only", "client_pending"])
def test_slowest_requests_panel_client_terms_are_null(client, data, dataset):
    database, workload = data[dataset]
    sql = queries.render_grafana("slowest_requests_rollup", database)
    rows = _rows(client, expand_grafana_sql(sql, _context(workload)))
    assert len(rows) == N_REQUESTS
    assert all(r[t] is None for r in rows for t in (*CLIENT_TERMS, "inbound_ms")), rows[0]
    assert all(r["first_chunk_ms"] > 0 and r["dominant_phase"] for r in rows)


@pytest.mark.parametrize("dataset", DATASETS)
def test_every_cookbook_and_checked_in_query_runs(client, data, dataset):
    database, workload = data[dataset]
    trace = {"trace_id": workload.requests[0].trace_id} if workload else {}
    for name, _, example in cookbook.ENTRIES:
        sql, params = queries.render_cli(name, database=database, **{**example, **trace})
        client.query(sql, parameters=params)
    for name in queries.QUERIES:
        _, params = queries.render_cli(name, **sql_files.EXAMPLE_FILTERS)
        params = {**params, "database": database, **(trace if "trace_id" in params else {})}
        client.query((CHECKED_IN / f"{name}.sql").read_text(), parameters=params)


def test_cookbook_budget_by_model_and_slowest_say_null_for_client_terms(client, data):
    database, _ = data["server_only"]
    sql, params = queries.render_cli("budget_by_model", database=database, since="1h")
    (row,) = _rows(client, sql, **params)
    assert row["requests"] == N_REQUESTS and row["prefill_ms_mean"] > 0
    assert all(row[f"{t}_mean"] is None for t in (*CLIENT_TERMS, "inbound_ms")), row
    sql, params = queries.render_cli("slowest_requests", database=database, since="1h")
    rows = _rows(client, sql, **params)
    assert len(rows) == N_REQUESTS and all(r[t] is None for r in rows for t in CLIENT_TERMS)
    assert all(r["first_chunk_ms"] > 0 for r in rows)  # stamped (loop_wait): a figure
    assert row["first_chunk_ms_mean"] == pytest.approx(sum(r["first_chunk_ms"] for r in rows) / N_REQUESTS)


def _cli(capsys, *argv) -> str:
    parser = argparse.ArgumentParser(prog="phaselens")
    budget_command.register(parser.add_subparsers())
    args = parser.parse_args(["budget", *argv])
    assert args.func(args) == 0
    return capsys.readouterr().out


@pytest.mark.parametrize("exact", [False, True])
def test_budget_cli_json_null_and_csv_empty_for_client_terms(clickhouse, data, capsys, exact):
    database, _ = data["server_only"]
    common = ("--clickhouse", clickhouse.url, "--database", database, "--since", "1h", *(["--exact"] * exact))
    got = json.loads(_cli(capsys, *common, "--format", "json"))
    components = {c["name"]: c for c in got["components"]}
    assert got["requests"] == N_REQUESTS and components["prefill_ms"]["ms"]["p50"] > 0
    for t in CLIENT_TERMS:
        assert set(components[t]["ms"].values()) == {None}, components[t]
    rows = dict(csv.reader(io.StringIO(_cli(capsys, *common, "--format", "csv"))))
    assert float(rows["components.prefill_ms.ms.mean"]) > 0
    assert {rows[f"components.{t}.ms.{s}"] for t in CLIENT_TERMS for s in ("p50", "p90", "p99", "mean")} == {""}
