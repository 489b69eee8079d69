"""Inserts rendered rows into `<database>.otel_traces` as RowBinary.

Why RowBinary: the C decoder writes it directly (collectors/render.py) and ClickHouse reads it with
no parsing and no transform (timestamps are already DateTime64(9) ticks); blocks of several
requests make one insert. The body is streamed, the statement travels in the URL (`query=`): the
server parses one block while the next is rendered, and a first row that begins with a whitespace
byte stays whole (tested).

With a cluster: the rows go to `otel_traces_distributed` as a synchronous (foreground) Distributed
insert, which ClickHouse splits by cityHash64(TraceId) and writes to every shard before answering,
so an acknowledged batch is on its shards (never in a queue on the entry node), and a shard that is
down fails the insert: the batch stays spooled and is retried. Each shard receives the batch's
token (settings travel with the remote insert), so a retry after a partial success is dropped by
the shards that already have their part. The collector's default on a cluster is
the faster direct split (`collectors/shard_sink.py`); this path is `--cluster-insert distributed`.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from clickhouse_connect.driver.client import Client

from phaselens.collectors import render
from phaselens.collectors.schema import INSERT_COLUMNS, TRACES_TABLE, distributed_name, ident
from phaselens.storage.clickhouse_url import connect


@dataclass(slots=True)
class ClickHouseSink:
    """Row-binary inserts into `<database>.otel_traces` (or, with `cluster`, its Distributed
    table), deduplicated by a per-batch token."""

    url: str
    database: str = "otel"
    cluster: str | None = None
    ca_cert: str | None = None  # verifies an https:// server (None: the system's trust store)
    _client: Client | None = field(default=None, init=False)

    def _target(self, table: str) -> tuple[str, dict[str, int]]:
        settings = {"insert_deduplicate": 1, "deduplicate_blocks_in_dependent_materialized_views": 1}
        if self.cluster is None:
            return f"{ident(self.database)}.{ident(table)}", settings
        distributed = ident(distributed_name(table))
        return f"{ident(self.database)}.{distributed}", {**settings, "distributed_foreground_insert": 1}

    def render(self, payload: bytes) -> bytes:
        """One request's rows. Raises render.InvalidSpans."""
        return render.render(payload)[0]

    def insert(self, blocks: Iterable[bytes], token: str) -> None:
        """Blocks from `render` (a generator renders them as they are sent), as one insert."""
        self.insert_rows(TRACES_TABLE, INSERT_COLUMNS, blocks, token)

    def insert_rows(self, table: str, columns: tuple[str, ...], blocks: Iterable[bytes], token: str) -> None:
        """RowBinary `blocks` of `columns` into `table` (its Distributed table on a cluster) as one
        insert, deduplicated by `token`; a failure closes the connection (the retry opens a fresh one)."""
        if self._client is None:
            self._client = connect(self.url, compress=False, autogenerate_session_id=False, ca_cert=self.ca_cert)
        target, settings = self._target(table)
        try:
            self._client.raw_insert(
                target,
                columns,
                iter(blocks),  # type: ignore[arg-type]  # streams any iterator of bytes; annotated Generator
                fmt="RowBinary",
                settings={**settings, "insert_deduplication_token": token},
            )
        except Exception:
            self.close()  # a fresh connection for the retry
            raise

    def close(self) -> None:
        if self._client is not None:
            self._client.close()
            self._client = None
