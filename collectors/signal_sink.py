"""Inserts logs and metrics rows: one insert per table a batch has rows for, through the spans'
ClickHouseSink (its connection, deduplication settings and cluster target).

A batch's token gets the table's name appended, so each table's part is deduplicated on its own:
a retry after some tables took their part inserts only the rest. On a cluster the rows go through
each table's Distributed table (sharded by a deterministic key: a retry splits the same way).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from phaselens.collectors.clickhouse_sink import ClickHouseSink
from phaselens.collectors.signals import Signal


@dataclass(slots=True)
class SignalSink:
    signal: Signal
    connection: ClickHouseSink

    def render(self, payload: bytes) -> dict[str, bytes]:
        """One request's rows per table. Raises signals.INVALID."""
        assert self.signal.rows is not None  # logs and metrics only
        return self.signal.rows(payload)[0]

    def insert(self, blocks: Iterable[dict[str, bytes]], token: str) -> None:
        parts: dict[str, bytearray] = {}
        for block in blocks:
            for name, rows in block.items():
                parts.setdefault(name, bytearray()).extend(rows)
        for table in self.signal.tables:  # a fixed order: the same on every replay
            if table.name in parts:
                self.connection.insert_rows(
                    table.name, table.insert_columns(), [bytes(parts[table.name])], f"{token}:{table.name}"
                )

    def close(self) -> None:
        self.connection.close()
