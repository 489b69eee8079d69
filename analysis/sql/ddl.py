"""Every statement `phaselens schema apply` runs, in order: the exporter's tables, the per-request
analysis tables and views (`analysis/schema/schema.py`), then the budget rollups (`analysis/rollup/rollup.py`).
Composed here, above both, because the rollups are generated from the queries that read the views."""

from __future__ import annotations

from phaselens.analysis.rollup import rollup, step_rollup
from phaselens.analysis.schema import schema as analysis_schema
from phaselens.collectors import schema as collector_schema


def all_statements(
    database: str = "otel",
    ttl: str | None = None,
    cluster: str | None = None,
    table_engine: str | None = None,
    on_cluster: bool = True,
    rollup_wait_s: int | None = None,
) -> list[str]:
    """Everything `phaselens schema apply` creates, in order: the exporter's tables
    (`phaselens.collectors.schema`), the per-request analysis tables and views, then the budget
    rollups (`phaselens.analysis.rollup.rollup`; `rollup_wait_s`: how long after its first part a request is sealed)."""
    wait = {} if rollup_wait_s is None else {"wait_s": rollup_wait_s}
    return (
        collector_schema.statements(
            database, ttl=ttl, cluster=cluster, table_engine=table_engine, on_cluster=on_cluster
        )
        + analysis_schema.statements(database, cluster=cluster, ttl=ttl, on_cluster=on_cluster)
        + rollup.statements(database, cluster=cluster, ttl=ttl, on_cluster=on_cluster, **wait)
        + step_rollup.statements(database, cluster=cluster, ttl=ttl, on_cluster=on_cluster)
    )
