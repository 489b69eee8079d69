"""phaselens.collectors.schema: the exporter's DDL, applied to the embedded ClickHouse; cluster DDL generated."""

from __future__ import annotations

import argparse

import pytest

from phaselens.analysis.rollup import rollup
from phaselens.collectors import schema
from phaselens.commands import schema as schema_command

EXPORTER_COLUMNS = [
    ("Timestamp", "DateTime64(9)"),
    ("TraceId", "String"),
    ("SpanId", "String"),
    ("ParentSpanId", "String"),
    ("TraceState", "String"),
    ("SpanName", "LowCardinality(String)"),
    ("SpanKind", "LowCardinality(String)"),
    ("ServiceName", "LowCardinality(String)"),
    ("ResourceAttributes", "Map(LowCardinality(String), String)"),
    ("ScopeName", "String"),
    ("ScopeVersion", "String"),
    ("SpanAttributes", "Map(LowCardinality(String), String)"),
    ("Duration", "UInt64"),
    ("StatusCode", "LowCardinality(String)"),
    ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9))"),
    ("Events.Name", "Array(LowCardinality(String))"),
    ("Events.Attributes", "Array(Map(LowCardinality(String), String))"),
    ("Links.TraceId", "Array(String)"),
    ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"),
    ("Links.Attributes", "Array(Map(LowCardinality(String), String))"),
]


def test_applied_table_matches_the_exporter(ch_client, fresh_database):
    statements = schema.statements(fresh_database, ttl="72h")
    schema.apply(ch_client, statements)
    schema.apply(ch_client, statements)  # idempotent
    columns = ch_client.query(
        "SELECT name, type, compression_codec FROM system.columns WHERE database = %(db)s AND table = 'otel_traces' "
        "ORDER BY position",
        parameters={"db": fresh_database},
    ).result_rows
    assert [(n, t) for n, t, _ in columns] == EXPORTER_COLUMNS
    assert [(n, t) for n, t in schema.INSERT_COLUMN_TYPES] == EXPORTER_COLUMNS
    codecs = {n: c for n, _, c in columns}
    assert codecs["Timestamp"] == "CODEC(Delta(8), ZSTD(1))" and codecs["Duration"] == "CODEC(T64, ZSTD(1))"
    table = ch_client.query(
        "SELECT engine, partition_key, sorting_key, primary_key, create_table_query FROM system.tables "
        "WHERE database = %(db)s AND name = 'otel_traces'",
        parameters={"db": fresh_database},
    ).first_row
    assert table[:4] == (
        "MergeTree",
        "toDate(Timestamp)",
        "ServiceName, SpanName, toDateTime(Timestamp), Timestamp",
        "ServiceName, SpanName, toDateTime(Timestamp)",
    )
    ddl = table[4]
    assert "TTL toDateTime(Timestamp) + toIntervalDay(3)" in ddl
    assert "INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1" in ddl
    assert "non_replicated_deduplication_window = 10000" in ddl
    tables = {
        r[0]: r[1]
        for r in ch_client.query(
            "SELECT name, engine FROM system.tables WHERE database = %(db)s", parameters={"db": fresh_database}
        ).result_rows
    }
    assert tables["otel_traces_trace_id_ts"] == "AggregatingMergeTree"
    assert tables["otel_traces_trace_id_ts_mv"] == "MaterializedView"


def test_deduplication_token_works_on_plain_mergetree(ch_client, fresh_database):
    schema.apply(ch_client, schema.statements(fresh_database))
    insert = (
        f"INSERT INTO {fresh_database}.otel_traces (Timestamp, TraceId, SpanId) "
        "SETTINGS insert_deduplication_token = 'batch-1' VALUES (now64(9), 'a', 'b')"
    )
    ch_client.command(insert)
    ch_client.command(insert)
    assert ch_client.command(f"SELECT count() FROM {fresh_database}.otel_traces") == 1


def test_cluster_ddl():
    statements = schema.statements(
        "obs", ttl="90m", cluster="prod", table_engine="ReplicatedMergeTree('/ch/{shard}/otel_traces', '{replica}')"
    )
    assert all(' ON CLUSTER "prod"' in s for s in statements)
    traces, lookup, dist = statements[1], statements[2], statements[4]
    assert "ENGINE = ReplicatedMergeTree('/ch/{shard}/otel_traces', '{replica}')" in traces
    assert "TTL toDateTime(Timestamp) + toIntervalMinute(90)" in traces
    assert "non_replicated_deduplication_window" not in traces
    assert "ENGINE = ReplicatedAggregatingMergeTree()" in lookup  # its own Keeper path
    assert "ENGINE = Distributed('prod', 'obs', 'otel_traces', cityHash64(TraceId))" in dist
    default = schema.statements(cluster="c")[1]
    assert "ENGINE = ReplicatedMergeTree()" in default


@pytest.mark.parametrize(
    "ttl,expected",
    [
        ("72h", "toIntervalDay(3)"),
        ("30s", "toIntervalSecond(30)"),
        ("2h", "toIntervalHour(2)"),
        ("7d", "toIntervalDay(7)"),
    ],
)
def test_ttl_interval(ttl, expected):
    assert schema.ttl_interval(ttl) == expected


@pytest.mark.parametrize(
    "bad", [{"ttl": "3 weeks"}, {"database": "otel; DROP"}, {"cluster": "a b"}, {"table_engine": "Log"}]
)
def test_bad_arguments_are_refused(bad):
    with pytest.raises(schema.SchemaError):
        schema.statements(**bad)


@pytest.mark.parametrize("names", [("c", "otel'", "otel_traces"), ("c", "otel", "t', 'x"), ("c d", "otel", "t")])
def test_distributed_engine_takes_plain_names_only(names):
    # its arguments are quoted as string literals in the engine clause
    with pytest.raises(schema.SchemaError):
        schema.distributed_engine(*names)


def test_cli_schema_apply(clickhouse, ch_client, fresh_database, capsys):
    # Only this command's parser: phaselens.cli would import every command (some import torch).
    parser = argparse.ArgumentParser(prog="phaselens")
    schema_command.register(parser.add_subparsers())
    args = parser.parse_args(["schema", "apply", "--clickhouse", clickhouse.url, "--database", fresh_database])
    assert args.func(args) == 0
    assert "applied" in capsys.readouterr().out
    assert ch_client.command(f"EXISTS TABLE {fresh_database}.otel_traces") == 1
    rollup.stop_refreshes(ch_client, fresh_database)  # no idle passes on the session's server
