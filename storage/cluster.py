"""A ClickHouse cluster of N embedded servers on loopback: one shard each, no replicas.

Every node gets the same `<remote_servers>` definition (all nodes' native TCP ports) and its own
`<macros>` ({shard}, {replica}), so `Distributed` tables, `_shard_num` and `clusterAllReplicas`
work across the processes. What chdb lacks (docs/contracts.md#embedded-clickhouse): Keeper, the
distributed-DDL worker (ON CLUSTER) and interserver HTTP, hence no replication; the schema is
applied per node (`phaselens schema apply --cluster NAME --ddl per-node`, `collectors.schema.apply_each`).

chdb sets `background_distributed_schedule_pool_size` to 0, which leaves asynchronous Distributed
inserts queued on disk for ever; the generated config raises it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Self

from phaselens.common.process import LOOPBACK, free_port, on_fresh_ports
from phaselens.storage.embedded import EmbeddedClickHouse, EmbeddedClickHouseError

DEFAULT_CLUSTER = "phaselens"
DISTRIBUTED_POOL_THREADS = 16


def cluster_config(name: str, tcp_endpoints: list[tuple[str, int]], shard: int) -> str:
    """The XML (inside `<clickhouse>`) of node `shard` (1-based) in a cluster of one-node shards."""
    shards = "".join(
        f"<shard><replica><host>{host}</host><port>{port}</port></replica></shard>" for host, port in tcp_endpoints
    )
    return (
        f"  <remote_servers><{name}>{shards}</{name}></remote_servers>\n"
        f"  <macros><cluster>{name}</cluster><shard>{shard}</shard><replica>r{shard}</replica></macros>\n"
        f"  <background_distributed_schedule_pool_size>{DISTRIBUTED_POOL_THREADS}"
        "</background_distributed_schedule_pool_size>\n"
    )


@dataclass(slots=True)
class EmbeddedCluster:
    """Start/stop handle for `shards` embedded nodes named `name`; node i keeps `data_dir/node<i>`
    and logs to `clickhouse-node<i>.log` in `log_dir` (default: clickhouse.log in its data directory)."""

    data_dir: str
    shards: int = 2
    name: str = DEFAULT_CLUSTER
    host: str = LOOPBACK
    log_dir: str | None = None
    nodes: list[EmbeddedClickHouse] = field(default_factory=list, init=False)

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    def start(self, timeout_s: float = 30.0) -> Self:
        """Every node's TCP port is picked first (each node's config names them all); another process
        may bind one before its node does: the whole cluster then starts again on fresh ports."""
        if self.shards < 1:
            raise ValueError(f"a cluster needs at least one shard, not {self.shards}")

        def run() -> None:
            try:
                self._start_nodes(timeout_s)
            except BaseException:  # Ctrl-C while starting, too: no node left running
                self.stop()
                raise

        on_fresh_ports(run, lambda exc: isinstance(exc, EmbeddedClickHouseError))
        return self

    def _start_nodes(self, timeout_s: float) -> None:
        tcp_ports = [free_port(self.host) for _ in range(self.shards)]
        endpoints = [(self.host, port) for port in tcp_ports]
        self.nodes = [
            EmbeddedClickHouse(
                str(Path(self.data_dir) / f"node{i + 1}"),
                tcp_port=port,
                host=self.host,
                log_path=self._log_path(i + 1),
                extra_config=cluster_config(self.name, endpoints, i + 1),
            )
            for i, port in enumerate(tcp_ports)
        ]
        for node in self.nodes:
            node.start(timeout_s)

    def _log_path(self, shard: int) -> str | None:
        return str(Path(self.log_dir) / f"clickhouse-node{shard}.log") if self.log_dir else None

    def running(self) -> bool:
        return bool(self.nodes) and all(node.running() for node in self.nodes)

    def stop(self, timeout_s: float = 10.0) -> None:
        for node in self.nodes:
            node.stop(timeout_s)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
