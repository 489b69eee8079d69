"""Helpers for the analysis tests: a database with both schemas, loaded with spangen workloads."""

from __future__ import annotations

import itertools

import clickhouse_connect
import numpy as np
import pytest

from phaselens.analysis.rollup import rollup
from phaselens.analysis.schema import schema as analysis_schema
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as collector_schema
from tests import spangen

_counter = itertools.count()


@pytest.fixture(scope="module")
def client(clickhouse):
    """A clickhouse-connect client shared by one test module."""
    c = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port)
    yield c
    c.close()


def new_database(client, prefix: str = "analysis") -> str:
    """A fresh database holding otel_traces (collector schema) and the analysis schema, its rollup
    views stopped."""
    name = f"{prefix}_{next(_counter)}"
    client.command(f"DROP DATABASE IF EXISTS {name}")
    collector_schema.apply(client, ddl.all_statements(name))
    rollup.stop_refreshes(client, name)  # the tests seal and refresh when they need to: no idle load
    return name


def loaded(clickhouse, workload: spangen.Workload, transport: str = "otlp", **emit_kw) -> str:
    client = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port)
    try:
        database = new_database(client)
        spangen.emit(workload, clickhouse.url, database, transport=transport, **emit_kw)
        rollup.refresh_live(client, database)  # the rollup path sees them now, not at the next refresh
        return database
    finally:
        client.close()


def stat(values) -> tuple[float, float, float, float]:
    """p50, p90, p99 (linear interpolation, as quantileExactInclusive) and mean."""
    arr = np.asarray([v for v in values if v is not None], dtype=float)
    return (*np.percentile(arr, [50, 90, 99]).tolist(), float(arr.mean()))


def rows_by_trace(client, database: str, view: str = "phaselens_requests") -> dict[str, dict]:
    result = client.query(f"SELECT * FROM {database}.{view}")
    return {r["trace_id"]: r for r in result.named_results()}
