"""Where a Stack keeps its spans: one embedded ClickHouse node, or an embedded cluster of N one-node
shards (`phaselens demo --shards N`).

Both answer the same questions, so the Stack and the demo never ask which one runs: the entry URL
that clients, queries and printed commands use (on the cluster any node's views read every shard
through Distributed tables), how the schema is applied (on the cluster: plain engines on every node
`system.clusters` lists, as `schema apply --ddl per-node` does), and the flags the collector and the
schema command need.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from phaselens.analysis.sql import all_statements
from phaselens.collectors.schema import apply_each
from phaselens.storage.cluster import DEFAULT_CLUSTER, EmbeddedCluster
from phaselens.storage.cluster_nodes import node_urls
from phaselens.storage.embedded import EmbeddedClickHouse


@dataclass(slots=True)
class SingleNode:
    """One embedded server in `data_dir`, its log in `log_dir/clickhouse.log`."""

    data_dir: Path
    log_dir: Path
    server: EmbeddedClickHouse | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return self.server.url if self.server else ""

    @property
    def collector_flags(self) -> tuple[str, ...]:
        return ()

    @property
    def schema_flags(self) -> tuple[str, ...]:
        return ()

    def node_urls(self) -> list[str]:
        return [self.url]

    def describe(self) -> str:
        return f"ClickHouse {self.url}"

    def start(self) -> None:
        # the handle is kept before it starts, so that an interrupted start is stopped too
        self.server = EmbeddedClickHouse(str(self.data_dir), log_path=str(self.log_dir / "clickhouse.log"))
        self.server.start()

    def apply_schema(self, database: str) -> None:
        apply_each([self.url], all_statements(database))

    def stop(self, timeout_s: float) -> None:
        if self.server is not None:
            self.server.stop(timeout_s)
            self.server = None


@dataclass(slots=True)
class ShardedCluster:
    """`shards` embedded nodes defined as cluster `name`; node i in `data_dir/node<i>`, logs in
    `log_dir/clickhouse-node<i>.log`. The entry URL is node 1's."""

    data_dir: Path
    log_dir: Path
    shards: int
    name: str = DEFAULT_CLUSTER
    cluster: EmbeddedCluster | None = field(default=None, init=False)

    @property
    def url(self) -> str:
        return self.cluster.urls[0] if self.cluster and self.cluster.nodes else ""

    @property
    def collector_flags(self) -> tuple[str, ...]:
        return ("--cluster", self.name)

    @property
    def schema_flags(self) -> tuple[str, ...]:
        return ("--cluster", self.name, "--ddl", "per-node")

    def node_urls(self) -> list[str]:
        return list(self.cluster.urls) if self.cluster else []

    def describe(self) -> str:
        return f"ClickHouse cluster {self.name}, {self.shards} shards: {' '.join(self.node_urls())}"

    def start(self) -> None:
        self.cluster = EmbeddedCluster(
            str(self.data_dir), shards=self.shards, name=self.name, log_dir=str(self.log_dir)
        )
        self.cluster.start()

    def apply_schema(self, database: str) -> None:
        apply_each(node_urls(self.url, self.name), all_statements(database, cluster=self.name, on_cluster=False))

    def stop(self, timeout_s: float) -> None:
        if self.cluster is not None:
            self.cluster.stop(timeout_s)
            self.cluster = None


def make_storage(data_dir: Path, log_dir: Path, shards: int) -> SingleNode | ShardedCluster:
    """One node for `shards` == 1, else a cluster; its data under `data_dir/clickhouse`."""
    if shards < 1:
        raise ValueError(f"--shards must be ≥ 1, not {shards}")
    where = data_dir / "clickhouse"
    return SingleNode(where, log_dir) if shards == 1 else ShardedCluster(where, log_dir, shards)
