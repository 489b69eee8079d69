"""Inserts rendered rows into `<database>.otel_traces` as RowBinary.

Why RowBinary: the C decoder writes it directly (collectors/render.py) and ClickHouse reads it with
no parsing and no transform (timestamps are already DateTime64(9) ticks); blocks of several
requests make one insert. The body is streamed, the statement travels in the URL (`query=`): the
server parses one block while the next is rendered, and a first row that begins with a whitespace
byte stays whole (tested).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from phaselens.storage.clickhouse_url import connect
from phaselens.collectors.schema import INSERT_COLUMNS, TRACES_TABLE, ident


@dataclass(slots=True)
class ClickHouseSink:
    """Row-binary inserts into `<database>.otel_traces`, deduplicated by a per-batch token."""

    url: str
    database: str = "otel"
    _client: object = field(default=None, init=False)

    def insert(self, blocks: Iterable[bytes], token: str) -> None:
        """Blocks from `render.render` (a generator renders them as they are sent), as one insert."""
        if self._client is None:
            self._client = connect(self.url, compress=False, autogenerate_session_id=False)
        try:
            self._client.raw_insert(
                f"{ident(self.database)}.{ident(TRACES_TABLE)}", INSERT_COLUMNS, iter(blocks), fmt="RowBinary",
                settings={"insert_deduplicate": 1, "insert_deduplication_token": token,
                          "deduplicate_blocks_in_dependent_materialized_views": 1})
        except Exception:
            self.close()  # a fresh connection for the retry
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
