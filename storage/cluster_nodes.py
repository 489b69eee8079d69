"""The nodes of a ClickHouse cluster as `system.clusters` lists them, each with an HTTP URL.

`system.clusters` gives every node's native TCP address; the HTTP port is asked of the node itself
(`getServerPort('http_port')` through `remote()`), so nodes with differing ports (the embedded
cluster, several servers on one host) are reached without configuration. The URL keeps the entry
URL's scheme and credentials.
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit, urlunsplit

from phaselens.storage.clickhouse_url import connect

_NODES_SQL = (
    "SELECT shard_num, shard_weight, replica_num, host_address, port FROM system.clusters "
    "WHERE cluster = {cluster:String} ORDER BY shard_num, replica_num"
)
_HTTP_PORT_SQL = "SELECT getServerPort('http_port') FROM remote({address:String}, system.one)"


class ClusterError(RuntimeError):
    pass


@dataclass(frozen=True, slots=True)
class Node:
    shard_num: int
    shard_weight: int  # the shard's share of a Distributed table's inserts
    replica_num: int
    tcp_address: str  # host:port as the cluster definition has it
    url: str


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _node_url(entry_url: str, host: str, http_port: int) -> str:
    parts = urlsplit(entry_url if "://" in entry_url else f"http://{entry_url}")
    credentials = parts.netloc.rpartition("@")[0]
    netloc = f"{credentials}@" if credentials else ""
    return urlunsplit((parts.scheme, netloc + _host_port(host, http_port), "", "", ""))


def cluster_nodes(client, entry_url: str, cluster: str) -> list[Node]:
    """Every node of `cluster`, through the server `client` talks to (at `entry_url`)."""
    rows = client.query(_NODES_SQL, parameters={"cluster": cluster}).result_rows
    if not rows:
        known = client.query("SELECT DISTINCT cluster FROM system.clusters ORDER BY cluster").result_rows
        raise ClusterError(
            f"no cluster {cluster!r} in system.clusters of {entry_url}; "
            f"it knows: {', '.join(r[0] for r in known) or 'none'}"
        )
    nodes = []
    for shard_num, shard_weight, replica_num, host, tcp_port in rows:
        address = _host_port(host, tcp_port)
        try:
            http_port = client.query(_HTTP_PORT_SQL, parameters={"address": address}).result_rows[0][0]
        except Exception as exc:
            raise ClusterError(
                f"node {address} (shard {shard_num}, replica {replica_num}) of cluster "
                f"{cluster!r} does not answer: {exc}"
            ) from exc
        nodes.append(Node(shard_num, shard_weight, replica_num, address, _node_url(entry_url, host, http_port)))
    return nodes


def node_urls(entry_url: str, cluster: str) -> list[str]:
    """The HTTP URL of every node of `cluster`, as the server at `entry_url` lists them."""
    client = connect(entry_url)
    try:
        return [node.url for node in cluster_nodes(client, entry_url, cluster)]
    finally:
        client.close()
