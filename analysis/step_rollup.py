"""Engine-step rollups: per minute × service, -State aggregates of the engine steps
(`queries.step_rollup_columns`), so the decode stalls of a budget and the engine half of the verdict
merge one row per minute instead of reading every step.

A step is one span, inserted once, so a plain materialized view on the spans table fills the rollup
as the spans arrive (no sealing, unlike the per-request rollups of analysis/rollup.py). On a cluster
each node rolls up the steps of its own shard and reads go through a Distributed table. Steps
inserted before this table existed are not in it until `analysis/step_backfill.py` recomputes their
minutes (`phaselens rollup backfill`).
"""

from __future__ import annotations

from phaselens.analysis import queries as q
from phaselens.analysis import schema as s
from phaselens.analysis import sketch as sk
from phaselens.collectors.schema import TRACES_TABLE, ident, ttl_interval
from phaselens.instrumentation import names as n

ROLLUP_MV = f"{sk.STEPS_ROLLUP_TABLE}_mv"
DISTRIBUTED = f"{sk.STEPS_ROLLUP_TABLE}_distributed"


def rollup_select(traces: str) -> str:
    """The rows the view appends: the steps of one insert, per minute × service."""
    columns = ", ".join(f"{expr} AS {name}" for name, expr in s.STEP_COLUMNS)
    steps = f"SELECT {columns}\nFROM {traces}\nWHERE SpanName = '{n.SPAN_ENGINE_STEP}'"
    cols = ",\n    ".join(f"{expr} AS {name}" for name, _, expr in q.step_rollup_columns())
    return f"SELECT toStartOfMinute(time) AS bucket, service,\n    {cols}\nFROM ({steps})\nGROUP BY bucket, service"


def statements(
    database: str = "otel", cluster: str | None = None, ttl: str | None = None, on_cluster: bool = True
) -> list[str]:
    """CREATE statements (idempotent), after the exporter's tables."""
    db = ident(database)
    on = f" ON CLUSTER {ident(cluster)}" if cluster and on_cluster else ""
    engine = "ReplicatedAggregatingMergeTree()" if cluster and on_cluster else "AggregatingMergeTree()"
    table = f"{db}.{ident(sk.STEPS_ROLLUP_TABLE)}"
    cols = ",\n    ".join(
        ["bucket DateTime CODEC(Delta, ZSTD(1))", "service LowCardinality(String)"]
        + [f"{name} {ch_type}" for name, ch_type, _ in q.step_rollup_columns()]
    )
    select = rollup_select(f"{db}.{ident(TRACES_TABLE)}")
    out = [
        (
            f"CREATE TABLE IF NOT EXISTS {table}{on} (\n    {cols}\n) ENGINE = {engine}\n"
            "PARTITION BY toYYYYMM(bucket)\nORDER BY (bucket, service)"
            + (f"\nTTL bucket + {ttl_interval(ttl)}" if ttl else "")
        ),
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {db}.{ident(ROLLUP_MV)}{on} TO {table}\nAS {select}",
        f"ALTER TABLE {db}.{ident(ROLLUP_MV)}{on} MODIFY QUERY {select}",
    ]
    read = table
    if cluster:
        for name in (cluster, database, sk.STEPS_ROLLUP_TABLE):
            ident(name)
        dist = f"{db}.{ident(DISTRIBUTED)}"
        out += [
            f"DROP TABLE IF EXISTS {dist}{on}",
            f"CREATE TABLE {dist}{on} AS {table}\nENGINE = Distributed('{cluster}', '{database}', '{sk.STEPS_ROLLUP_TABLE}')",
        ]
        read = dist
    out.append(f"CREATE OR REPLACE VIEW {db}.{ident(sk.STEPS_STATES_VIEW)}{on} AS\nSELECT * FROM {read}")
    return out
