"""Engine-step rollups: per minute × service, -State aggregates of the engine steps
(`queries.step_rollup_columns`), so the decode stalls of a budget and the engine half of the verdict
merge one row per minute instead of reading every step.

A step is one span, inserted once, so a plain materialized view on the spans table fills the rollup
as the spans arrive (no sealing, unlike the per-request rollups of analysis/rollup/rollup.py). Each row
names the node whose steps it counts (`origin`). On a cluster each node rolls up the steps of its
own shard and writes them through a Distributed table sharded by `copy_to`, a row per shard, so
every node keeps a complete copy and reads its own table (as the request rollups do). Steps
inserted before this table existed are not in it until `analysis/rollup/step_backfill.py` recomputes their
minutes (`phaselens rollup backfill`).
"""

from __future__ import annotations

from phaselens.analysis import queries as q
from phaselens.analysis.queries import sketch as sk
from phaselens.analysis.rollup.rollup_copies import copies_ddl, copies_select
from phaselens.analysis.schema import schema as s
from phaselens.collectors.schema import TRACES_TABLE, ident, ttl_interval
from phaselens.instrumentation import names as n

ROLLUP_MV = f"{sk.STEPS_ROLLUP_TABLE}_mv"
# a cluster's view, into the copies table (a view's target cannot be altered: a view of its own)
COPIES_MV = f"{sk.STEPS_ROLLUP_TABLE}_copies_mv"
DISTRIBUTED = f"{sk.STEPS_ROLLUP_TABLE}_distributed"  # dropped: reads are local (upgrade)
COPIES = f"{sk.STEPS_ROLLUP_TABLE}_copies"
# the node a row's steps were stored on (as the request rollups' `sealer`)
ORIGIN = "concat(hostName(), ':', toString(getServerPort('tcp_port')))"


def column_names() -> list[str]:
    return ["bucket", "service", "origin", *(name for name, _, _ in q.step_rollup_columns())]


def rollup_select(traces: str) -> str:
    """The rows the view appends: the steps of one insert, per minute × service."""
    columns = ", ".join(f"{expr} AS {name}" for name, expr in s.STEP_COLUMNS)
    steps = f"SELECT {columns}\nFROM {traces}\nWHERE SpanName = '{n.SPAN_ENGINE_STEP}'"
    cols = ",\n    ".join(f"{expr} AS {name}" for name, _, expr in q.step_rollup_columns())
    return (
        f"SELECT toStartOfMinute(time) AS bucket, service, {ORIGIN} AS origin,\n    {cols}\n"
        f"FROM ({steps})\nGROUP BY bucket, service"
    )


def _columns(copy_to: str) -> str:
    return ",\n    ".join(
        ["bucket DateTime CODEC(Delta, ZSTD(1))", "service LowCardinality(String)", "origin LowCardinality(String)"]
        + [f"{name} {ch_type}" for name, ch_type, _ in q.step_rollup_columns()]
        + [f"copy_to UInt16 {copy_to}"]
    )


def statements(
    database: str = "otel", cluster: str | None = None, ttl: str | None = None, on_cluster: bool = True
) -> list[str]:
    """CREATE statements (idempotent; an upgrade adds `origin` to the key: the rows before it
    are the node's own, `origin` ''), after the exporter's tables."""
    db = ident(database)
    on = f" ON CLUSTER {ident(cluster)}" if cluster and on_cluster else ""
    engine = "ReplicatedAggregatingMergeTree()" if cluster and on_cluster else "AggregatingMergeTree()"
    table = f"{db}.{ident(sk.STEPS_ROLLUP_TABLE)}"
    select = copies_select(rollup_select(f"{db}.{ident(TRACES_TABLE)}"), cluster)
    out = [
        (
            f"CREATE TABLE IF NOT EXISTS {table}{on} (\n    {_columns('EPHEMERAL')}\n) ENGINE = {engine}\n"
            "PARTITION BY toYYYYMM(bucket)\nORDER BY (bucket, service, origin)"
            + (f"\nTTL bucket + {ttl_interval(ttl)}" if ttl else "")
        ),
        (
            f"ALTER TABLE {table}{on} ADD COLUMN IF NOT EXISTS origin LowCardinality(String), "
            "MODIFY ORDER BY (bucket, service, origin), ADD COLUMN IF NOT EXISTS copy_to UInt16 EPHEMERAL"
        ),
    ]
    view, into = f"{db}.{ident(ROLLUP_MV)}", table
    if cluster:
        into = f"{db}.{ident(COPIES)}"
        out += [
            copies_ddl(into, sk.STEPS_ROLLUP_TABLE, _columns("DEFAULT 0"), on, cluster, database),
            f"DROP TABLE IF EXISTS {db}.{ident(DISTRIBUTED)}{on}",
            # the upgrade: steps inserted before the new view exists are recomputed by the backfill
            f"DROP VIEW IF EXISTS {view}{on}",
        ]
        view = f"{db}.{ident(COPIES_MV)}"
    out += [
        f"CREATE MATERIALIZED VIEW IF NOT EXISTS {view}{on} TO {into}\nAS {select}",
        f"ALTER TABLE {view}{on} MODIFY QUERY {select}",
        f"CREATE OR REPLACE VIEW {db}.{ident(sk.STEPS_STATES_VIEW)}{on} AS\nSELECT * FROM {table}",
    ]
    return out
