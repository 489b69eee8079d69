"""Columns of `otel_logs` and `otel_metrics_*`, as the OpenTelemetry Collector (contrib) ClickHouse
exporter creates them (its `internal/sqltemplates/*_table.sql`; docs/collectors.md names the layout).

One description per table gives both the DDL (schema.py) and the RowBinary insert columns (the
renderers write in exactly this order). Nested columns are inserted as their flattened arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

_MAP = "Map(LowCardinality(String), String)"
_Z = "CODEC(ZSTD(1))"
_DELTA = "CODEC(Delta, ZSTD(1))"


@dataclass(frozen=True, slots=True)
class Column:
    name: str
    type: str  # `Nested` for a Nested column
    tail: str = _Z  # codec, or `DEFAULT expr` for a column the server computes (not inserted)
    sub_columns: tuple[tuple[str, str], ...] = ()  # a Nested column's (name, type)

    @property
    def inserted(self) -> bool:
        return not self.tail.startswith("DEFAULT")

    def ddl(self) -> str:
        subs = ", ".join(f"{name} {type_}" for name, type_ in self.sub_columns)
        return f"{self.name} {self.type}{f' ({subs})' if subs else ''} {self.tail}"

    def insert_types(self) -> list[tuple[str, str]]:
        if not self.sub_columns:
            return [(self.name, self.type)]
        return [(f"{self.name}.{sub}", f"Array({sub_type})") for sub, sub_type in self.sub_columns]


@dataclass(frozen=True, slots=True)
class SignalTable:
    name: str
    columns: tuple[Column, ...]
    indexes: tuple[str, ...]
    partition_by: str
    order_by: str
    ttl_time: str  # a DateTime expression the TTL counts from
    shard_key: str  # deterministic, so a retried batch splits over the shards as before (dedup)
    primary_key: str | None = None

    def insert_column_types(self) -> tuple[tuple[str, str], ...]:
        return tuple(t for c in self.columns if c.inserted for t in c.insert_types())

    def insert_columns(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.insert_column_types())


def _attr_indexes(*columns: tuple[str, str]) -> tuple[str, ...]:
    return tuple(
        f"INDEX idx_{short}_{part} map{part.title()}s({column}) TYPE bloom_filter(0.01) GRANULARITY 1"
        for short, column in columns
        for part in ("key", "value")
    )


LOGS = SignalTable(
    "otel_logs",
    (
        Column("Timestamp", "DateTime64(9)", "CODEC(Delta(8), ZSTD(1))"),
        Column("TimestampTime", "DateTime", "DEFAULT toDateTime(Timestamp)"),
        Column("TraceId", "String"),
        Column("SpanId", "String"),
        Column("TraceFlags", "UInt8", ""),
        Column("SeverityText", "LowCardinality(String)"),
        Column("SeverityNumber", "UInt8", ""),
        Column("ServiceName", "LowCardinality(String)"),
        Column("Body", "String"),
        Column("ResourceSchemaUrl", "LowCardinality(String)"),
        Column("ResourceAttributes", _MAP),
        Column("ScopeSchemaUrl", "LowCardinality(String)"),
        Column("ScopeName", "String"),
        Column("ScopeVersion", "LowCardinality(String)"),
        Column("ScopeAttributes", _MAP),
        Column("LogAttributes", _MAP),
    ),
    (
        "INDEX idx_trace_id TraceId TYPE bloom_filter(0.001) GRANULARITY 1",
        *_attr_indexes(
            ("res_attr", "ResourceAttributes"), ("scope_attr", "ScopeAttributes"), ("log_attr", "LogAttributes")
        ),
        "INDEX idx_body Body TYPE tokenbf_v1(32768, 3, 0) GRANULARITY 8",
        "INDEX idx_body_ngrambf Body TYPE ngrambf_v1(4, 32768, 3, 0) GRANULARITY 1",
    ),
    partition_by="toDate(TimestampTime)",
    primary_key="(ServiceName, TimestampTime)",
    order_by="(ServiceName, TimestampTime, Timestamp)",
    ttl_time="TimestampTime",
    shard_key="cityHash64(ServiceName, Timestamp)",
)

_EXEMPLARS = Column(
    "Exemplars",
    "Nested",
    sub_columns=(
        ("FilteredAttributes", _MAP),
        ("TimeUnix", "DateTime64(9)"),
        ("Value", "Float64"),
        ("SpanId", "String"),
        ("TraceId", "String"),
    ),
)
_METRIC_HEAD = (
    Column("ResourceAttributes", _MAP),
    Column("ResourceSchemaUrl", "String"),
    Column("ScopeName", "String"),
    Column("ScopeVersion", "String"),
    Column("ScopeAttributes", _MAP),
    Column("ScopeDroppedAttrCount", "UInt32"),
    Column("ScopeSchemaUrl", "String"),
    Column("ServiceName", "LowCardinality(String)"),
    Column("MetricName", "String"),
    Column("MetricDescription", "String"),
    Column("MetricUnit", "String"),
    Column("Attributes", _MAP),
    Column("StartTimeUnix", "DateTime64(9)", _DELTA),
    Column("TimeUnix", "DateTime64(9)", _DELTA),
)
_COUNT_SUM = (Column("Count", "UInt64", _DELTA), Column("Sum", "Float64"))
_MIN_MAX_TEMPORALITY = (Column("Min", "Float64"), Column("Max", "Float64"), Column("AggregationTemporality", "Int32"))


def _metric_table(suffix: str, *columns: Column) -> SignalTable:
    return SignalTable(
        f"otel_metrics_{suffix}",
        (*_METRIC_HEAD, *columns),
        _attr_indexes(("res_attr", "ResourceAttributes"), ("scope_attr", "ScopeAttributes"), ("attr", "Attributes")),
        partition_by="toDate(TimeUnix)",
        # Attributes is hashed, not a sort key itself: ClickHouse refuses a Map in ORDER BY by default
        order_by="(ServiceName, MetricName, toStartOfHour(TimeUnix), cityHash64(Attributes), TimeUnix)",
        ttl_time="toDateTime(TimeUnix)",
        shard_key="cityHash64(MetricName, TimeUnix)",
    )


GAUGE = _metric_table("gauge", Column("Value", "Float64"), Column("Flags", "UInt32"), _EXEMPLARS)
SUM = _metric_table(
    "sum",
    Column("Value", "Float64"),
    Column("Flags", "UInt32"),
    _EXEMPLARS,
    Column("AggregationTemporality", "Int32"),
    Column("IsMonotonic", "Bool", _DELTA),
)
HISTOGRAM = _metric_table(
    "histogram",
    *_COUNT_SUM,
    Column("BucketCounts", "Array(UInt64)"),
    Column("ExplicitBounds", "Array(Float64)"),
    _EXEMPLARS,
    Column("Flags", "UInt32"),
    *_MIN_MAX_TEMPORALITY,
)
EXPONENTIAL_HISTOGRAM = _metric_table(
    "exponential_histogram",
    *_COUNT_SUM,
    Column("Scale", "Int32"),
    Column("ZeroCount", "UInt64"),
    Column("PositiveOffset", "Int32"),
    Column("PositiveBucketCounts", "Array(UInt64)"),
    Column("NegativeOffset", "Int32"),
    Column("NegativeBucketCounts", "Array(UInt64)"),
    _EXEMPLARS,
    Column("Flags", "UInt32"),
    *_MIN_MAX_TEMPORALITY,
)
SUMMARY = _metric_table(
    "summary",
    *_COUNT_SUM,
    Column("ValueAtQuantiles", "Nested", sub_columns=(("Quantile", "Float64"), ("Value", "Float64"))),
    Column("Flags", "UInt32"),
)
METRIC_TABLES = {t.name: t for t in (GAUGE, SUM, HISTOGRAM, EXPONENTIAL_HISTOGRAM, SUMMARY)}
SIGNAL_TABLES = (LOGS, *METRIC_TABLES.values())
