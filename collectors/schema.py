"""DDL for `otel_traces` (and `otel_logs`, `otel_metrics_*`: signal_schema.py), as the
OpenTelemetry Collector (contrib) ClickHouse exporter creates them.

Same columns, types, order, codecs, skip indexes, partition and order key, so a user of the real
collector (docker-compose) and of ours query one schema (docs/contracts.md#otlp-to-clickhouse-rows).
Additions of ours: `non_replicated_deduplication_window` on plain MergeTree tables, so that replaying
a spool batch with the same `insert_deduplication_token` inserts nothing twice, and, with a cluster, a
Distributed table for reads.
"""

from __future__ import annotations

import re

from clickhouse_connect.driver.client import Client

from phaselens.collectors.signal_schema import SIGNAL_TABLES, SignalTable
from phaselens.storage.clickhouse_url import connect

TRACES_TABLE = "otel_traces"
TRACE_ID_TS_TABLE = f"{TRACES_TABLE}_trace_id_ts"
TRACE_ID_TS_MV = f"{TRACE_ID_TS_TABLE}_mv"
DISTRIBUTED_TABLE = f"{TRACES_TABLE}_distributed"
TRACE_ID_TS_DISTRIBUTED = f"{TRACE_ID_TS_TABLE}_distributed"
# How many recent insert blocks a non-replicated MergeTree remembers for deduplication.
DEDUP_WINDOW_BLOCKS = 10_000

_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_ENGINE = re.compile(r"^(?P<name>[A-Za-z]+)(?P<params>\(.*\))?$", re.DOTALL)
_TTL = re.compile(r"^(?P<n>\d+)(?P<unit>[smhd])$")
_TTL_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}

_TRACES_COLUMNS = """
    Timestamp DateTime64(9) CODEC(Delta(8), ZSTD(1)),
    TraceId String CODEC(ZSTD(1)),
    SpanId String CODEC(ZSTD(1)),
    ParentSpanId String CODEC(ZSTD(1)),
    TraceState String CODEC(ZSTD(1)),
    SpanName LowCardinality(String) CODEC(ZSTD(1)),
    SpanKind LowCardinality(String) CODEC(ZSTD(1)),
    ServiceName LowCardinality(String) CODEC(ZSTD(1)),
    ResourceAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    ScopeName String CODEC(ZSTD(1)),
    ScopeVersion String CODEC(ZSTD(1)),
    SpanAttributes Map(LowCardinality(String), String) CODEC(ZSTD(1)),
    Duration UInt64 CODEC(T64, ZSTD(1)),
    StatusCode LowCardinality(String) CODEC(ZSTD(1)),
    StatusMessage String CODEC(ZSTD(1)),
    Events Nested (
        Timestamp DateTime64(9),
        Name LowCardinality(String),
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    Links Nested (
        TraceId String,
        SpanId String,
        TraceState String,
        Attributes Map(LowCardinality(String), String)
    ) CODEC(ZSTD(1)),
    INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1,
    INDEX idx_res_attr_key mapKeys(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_res_attr_value mapValues(ResourceAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_key mapKeys(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_span_attr_value mapValues(SpanAttributes) TYPE bloom_filter(0.01) GRANULARITY 1,
    INDEX idx_duration Duration TYPE minmax GRANULARITY 1"""

# Insert columns and their types, in table order; Events/Links are Nested, inserted as their
# flattened array sub-columns. Giving the types spares clickhouse-connect a DESCRIBE per insert.
_MAP = "Map(LowCardinality(String), String)"
INSERT_COLUMN_TYPES = (
    ("Timestamp", "DateTime64(9)"),
    ("TraceId", "String"),
    ("SpanId", "String"),
    ("ParentSpanId", "String"),
    ("TraceState", "String"),
    ("SpanName", "LowCardinality(String)"),
    ("SpanKind", "LowCardinality(String)"),
    ("ServiceName", "LowCardinality(String)"),
    ("ResourceAttributes", _MAP),
    ("ScopeName", "String"),
    ("ScopeVersion", "String"),
    ("SpanAttributes", _MAP),
    ("Duration", "UInt64"),
    ("StatusCode", "LowCardinality(String)"),
    ("StatusMessage", "String"),
    ("Events.Timestamp", "Array(DateTime64(9))"),
    ("Events.Name", "Array(LowCardinality(String))"),
    ("Events.Attributes", f"Array({_MAP})"),
    ("Links.TraceId", "Array(String)"),
    ("Links.SpanId", "Array(String)"),
    ("Links.TraceState", "Array(String)"),
    ("Links.Attributes", f"Array({_MAP})"),
)
INSERT_COLUMNS = tuple(name for name, _ in INSERT_COLUMN_TYPES)


class SchemaError(ValueError):
    pass


def ident(name: str) -> str:
    """A quoted identifier; only plain names are accepted (they end up in DDL text)."""
    if not _IDENT.match(name):
        raise SchemaError(f"not a plain identifier: {name!r}")
    return f'"{name}"'


def ttl_interval(ttl: str) -> str:
    """`72h` → `toIntervalDay(3)`: the largest whole unit, as the exporter renders its TTL."""
    m = _TTL.match(ttl.strip())
    if not m:
        raise SchemaError(f"TTL must look like 30s, 15m, 72h or 7d, not {ttl!r}")
    seconds = int(m["n"]) * _TTL_SECONDS[m["unit"]]
    if seconds <= 0:
        raise SchemaError("TTL must be positive")
    for fn, unit_s in (("Day", 86400), ("Hour", 3600), ("Minute", 60)):
        if seconds % unit_s == 0:
            return f"toInterval{fn}({seconds // unit_s})"
    return f"toIntervalSecond({seconds})"


def _engine(table_engine: str | None, cluster: str | None, family: str, keep_params: bool) -> str:
    """`family` is MergeTree or AggregatingMergeTree. Only the traces table keeps explicit
    parameters: a second table must not share its Keeper path, so it takes the server defaults."""
    if not table_engine:
        return f"Replicated{family}()" if cluster else f"{family}()"
    m = _ENGINE.match(table_engine.strip())
    if not m or not m["name"].endswith("MergeTree"):
        raise SchemaError(f"table engine must be a *MergeTree engine, not {table_engine!r}")
    replicated = m["name"].startswith("Replicated")
    params = m["params"] if keep_params and m["params"] else "()"
    return f"{'Replicated' if replicated else ''}{family}{params}"


def distributed_engine(cluster: str, database: str, table: str, shard_key: str = "cityHash64(TraceId)") -> str:
    """Spans sharded by the trace id: a request's spans, inserted by different processes in different
    batches, meet on one shard, so the per-request materialized view stays shard-local."""
    for name in (cluster, database, table):  # quoted as string literals below: plain names only
        ident(name)
    return f"Distributed('{cluster}', '{database}', '{table}', {shard_key})"


def distributed_name(table: str) -> str:
    return f"{table}_distributed"


def _settings(engine: str) -> str:
    dedup = "" if engine.startswith("Replicated") else f", non_replicated_deduplication_window = {DEDUP_WINDOW_BLOCKS}"
    return f"SETTINGS index_granularity = 8192, ttl_only_drop_parts = 1{dedup}"


def statements(
    database: str = "otel",
    ttl: str | None = None,
    cluster: str | None = None,
    table_engine: str | None = None,
    on_cluster: bool = True,
) -> list[str]:
    """CREATE statements (idempotent, IF NOT EXISTS) in the order they must run.

    With `cluster`: a Distributed table sharded by cityHash64(TraceId) over the local tables, and
    either ON CLUSTER DDL with Replicated engines (`on_cluster`, needs Keeper and distributed DDL)
    or statements to run on every node in turn, with plain engines unless `table_engine` says.
    The logs and metrics tables come last, with the same ON CLUSTER, engine family and TTL (their
    own Keeper paths), and on a cluster Distributed tables sharded by a deterministic key."""
    db = ident(database)
    replicated_cluster = cluster if on_cluster else None
    on_clause = f" ON CLUSTER {ident(replicated_cluster)}" if replicated_cluster else ""
    interval = ttl_interval(ttl) if ttl else None
    traces_engine = _engine(table_engine, replicated_cluster, "MergeTree", keep_params=True)
    lookup_engine = _engine(table_engine, replicated_cluster, "AggregatingMergeTree", keep_params=False)
    traces, lookup = f"{db}.{ident(TRACES_TABLE)}", f"{db}.{ident(TRACE_ID_TS_TABLE)}"
    out = [
        f"CREATE DATABASE IF NOT EXISTS {db}{on_clause}",
        f"CREATE TABLE IF NOT EXISTS {traces}{on_clause} ({_TRACES_COLUMNS}\n) ENGINE = {traces_engine}\n"
        "PARTITION BY toDate(Timestamp)\n"
        "PRIMARY KEY (ServiceName, SpanName, toDateTime(Timestamp))\n"
        "ORDER BY (ServiceName, SpanName, toDateTime(Timestamp), Timestamp)\n"
        + (f"TTL toDateTime(Timestamp) + {interval}\n" if interval else "")
        + _settings(traces_engine),
        f"CREATE TABLE IF NOT EXISTS {lookup}{on_clause} (\n"
        "    TraceId String CODEC(ZSTD(1)),\n"
        "    Start SimpleAggregateFunction(min, DateTime) CODEC(ZSTD(1)),\n"
        "    End SimpleAggregateFunction(max, DateTime) CODEC(ZSTD(1))\n"
        f") ENGINE = {lookup_engine}\nPARTITION BY toStartOfWeek(Start)\nORDER BY (TraceId)\n"
        + (f"TTL Start + {interval}\n" if interval else "")
        + _settings(lookup_engine),
        (
            f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{ident(TRACE_ID_TS_MV)}{on_clause} TO {lookup}\n"
            f"AS SELECT TraceId, min(Timestamp) AS Start, max(Timestamp) AS End\n"
            f"FROM {traces} WHERE TraceId != '' GROUP BY TraceId"
        ),
    ]
    if cluster:
        out += [
            f"CREATE TABLE IF NOT EXISTS {db}.{ident(read)}{on_clause} AS {db}.{ident(local)}\n"
            f"ENGINE = {distributed_engine(cluster, database, local)}"
            for read, local in ((DISTRIBUTED_TABLE, TRACES_TABLE), (TRACE_ID_TS_DISTRIBUTED, TRACE_ID_TS_TABLE))
        ]
    signal_engine = _engine(table_engine, replicated_cluster, "MergeTree", keep_params=False)
    out += [_signal_table(db, table, on_clause, signal_engine, interval) for table in SIGNAL_TABLES]
    if cluster:
        out += [
            f"CREATE TABLE IF NOT EXISTS {db}.{ident(distributed_name(t.name))}{on_clause} AS {db}.{ident(t.name)}\n"
            f"ENGINE = {distributed_engine(cluster, database, t.name, t.shard_key)}"
            for t in SIGNAL_TABLES
        ]
    return out


def _signal_table(db: str, table: SignalTable, on_clause: str, engine: str, interval: str | None) -> str:
    """A logs or metrics table as the exporter creates it, with the traces table's engine, TTL and
    deduplication window choices."""
    body = ",\n    ".join([*(c.ddl() for c in table.columns), *table.indexes])
    return (
        f"CREATE TABLE IF NOT EXISTS {db}.{ident(table.name)}{on_clause} (\n    {body}\n) ENGINE = {engine}\n"
        f"PARTITION BY {table.partition_by}\n"
        + (f"PRIMARY KEY {table.primary_key}\n" if table.primary_key else "")
        + f"ORDER BY {table.order_by}\n"
        + (f"TTL {table.ttl_time} + {interval}\n" if interval else "")
        + _settings(engine)
    )


def apply(client: Client, statements: list[str]) -> None:
    """Run each statement through a clickhouse-connect client, in order."""
    for sql in statements:
        client.command(sql)


def apply_each(urls: list[str], statements: list[str]) -> None:
    """Run the statements on each server in turn (every node of a cluster without distributed DDL)."""
    for url in urls:
        client = connect(url)
        try:
            apply(client, statements)
        finally:
            client.close()
