"""Inserts straight into each shard's `otel_traces`, every row on the shard the cluster's
Distributed table would give it; and the choice of sink for a collector.

Why not through the Distributed table: the same spans went in 1.8× faster split here, one insert per
shard in parallel, than through a foreground Distributed insert (benchmarks/cluster_scaleout.py).
Placement: a Distributed table sharded by cityHash64(TraceId) over shards of weights w₁…wₙ puts a
row in slot cityHash64(TraceId) mod Σw, the slots laid out shard after shard, wᵢ slots each; the
renderer splits rows by that slot (`render.render_slots`), so reads and the per-request view see
exactly what a Distributed insert would have made.
Guarantees: a batch counts as written only when every shard has its part; each part carries the
batch's token plus its shard number, so a retry after a partial success is dropped by the shards
that have their part already (`non_replicated_deduplication_window`, or replication's own). A shard
that is down fails the insert: the batch stays spooled and is retried. A shard's part goes to its
first replica that answers.
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from phaselens.collectors import render
from phaselens.collectors.clickhouse_sink import ClickHouseSink
from phaselens.storage.clickhouse_url import connect
from phaselens.storage.cluster_nodes import ClusterError, Node, cluster_nodes

CLUSTER_INSERTS = ("direct", "distributed")


@dataclass(slots=True)
class _Shard:
    number: int
    sinks: list[ClickHouseSink]  # one per replica, in system.clusters order

    def insert(self, rows: bytes, token: str) -> None:
        """Into the first replica that takes it; the last failure is raised."""
        for i, sink in enumerate(self.sinks):
            try:
                sink.insert([rows], f"{token}:shard{self.number}")
                return
            except Exception:
                if i == len(self.sinks) - 1:
                    raise


@dataclass(slots=True)
class ShardedSink:
    """`render` + `insert` as ClickHouseSink's, rows split over the shards of `cluster`."""

    url: str
    database: str
    cluster: str
    ca_cert: str | None = None  # for https:// nodes
    _shards: list[_Shard] = field(default_factory=list, init=False)
    _slot_shard: list[int] = field(default_factory=list, init=False)  # slot → index in _shards
    _pool: ThreadPoolExecutor | None = field(default=None, init=False)

    def _discover(self) -> None:
        """The shards and their slots, from system.clusters (on first use, so that a cluster that
        is not up yet is retried like any failed insert)."""
        if self._shards:
            return
        client = connect(self.url, ca_cert=self.ca_cert)
        try:
            nodes = cluster_nodes(client, self.url, self.cluster)
        finally:
            client.close()
        by_shard: dict[int, list[Node]] = {}
        for node in nodes:
            by_shard.setdefault(node.shard_num, []).append(node)
        self._slot_shard = [
            i for i, (_, replicas) in enumerate(sorted(by_shard.items())) for _ in range(replicas[0].shard_weight)
        ]
        if not self._slot_shard:  # render_slots(…, 0) would return one unsplit block
            raise ClusterError(f"cluster {self.cluster!r} has no shard with a weight above 0")
        self._shards = [
            _Shard(num, [ClickHouseSink(node.url, self.database, ca_cert=self.ca_cert) for node in replicas])
            for num, replicas in sorted(by_shard.items())
        ]
        self._pool = ThreadPoolExecutor(len(self._shards), thread_name_prefix="shard-insert")

    def render(self, payload: bytes) -> list[bytes]:
        """One request's rows per shard. Raises render.InvalidSpans."""
        self._discover()
        slots, _ = render.render_slots(payload, len(self._slot_shard))
        rows = [b""] * len(self._shards)
        for slot, block in enumerate(slots):
            rows[self._slot_shard[slot]] += block
        return rows

    def insert(self, blocks: Iterable[list[bytes]], token: str) -> None:
        """Blocks from `render`, one insert per shard that has rows, the shards in parallel."""
        self._discover()  # before `blocks` renders: the shard count sizes the parts
        assert self._pool is not None  # made by _discover
        parts = [bytearray() for _ in self._shards]
        for block in blocks:
            for part, rows in zip(parts, block, strict=False):
                part += rows
        futures = [
            self._pool.submit(shard.insert, bytes(part), token)
            for shard, part in zip(self._shards, parts, strict=False)
            if part
        ]
        # every shard is waited for before a failure is raised: a retry must not reach a shard whose
        # previous part is still in flight (same token, and the shard's client is not thread-safe)
        wait(futures)
        for future in futures:
            future.result()

    def close(self) -> None:
        for shard in self._shards:
            for sink in shard.sinks:
                sink.close()
        if self._pool is not None:
            self._pool.shutdown()


def make_sink(
    url: str, database: str, cluster: str | None, cluster_insert: str = "direct", ca_cert: str | None = None
) -> ClickHouseSink | ShardedSink:
    """One node, or a cluster written `direct` (ShardedSink) or through its Distributed table.
    `ca_cert`: the CA bundle that verifies an https:// ClickHouse (None: the system's)."""
    if cluster is None or cluster_insert == "distributed":
        return ClickHouseSink(url, database, cluster, ca_cert)
    if cluster_insert != "direct":
        raise ValueError(f"cluster insert must be one of {CLUSTER_INSERTS}, not {cluster_insert!r}")
    return ShardedSink(url, database, cluster, ca_cert)
