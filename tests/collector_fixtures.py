"""Private helpers of the collector tests: a running Collector on a fresh database, row polling."""

from __future__ import annotations

import time

import pytest

from phaselens.collectors import schema
from phaselens.collectors.service import Collector


def wait_rows(ch_client, database: str, expected: int, timeout_s: float = 15.0, table: str = "otel_traces") -> int:
    """Polls until `expected` rows of `table` are visible (or the timeout); returns the last count."""
    deadline = time.monotonic() + timeout_s
    count = -1
    while time.monotonic() < deadline:
        count = int(ch_client.command(f"SELECT count() FROM {database}.{table}"))
        if count >= expected:
            return count
        time.sleep(0.05)
    return count


def rows(ch_client, database: str, order_by: str = "SpanName") -> list[dict]:
    return list(ch_client.query(f"SELECT * FROM {database}.otel_traces ORDER BY {order_by}").named_results())


@pytest.fixture()
def traces_db(ch_client, fresh_database) -> str:
    schema.apply(ch_client, schema.statements(fresh_database))
    return fresh_database


@pytest.fixture()
def collector(clickhouse, traces_db, tmp_path):
    c = Collector(
        clickhouse.url,
        database=traces_db,
        spool_dir=str(tmp_path / "spool"),
        flush_interval_s=0.05,
        max_body_bytes=1 << 20,
    ).start()
    yield c
    c.stop()
