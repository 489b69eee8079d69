"""`phaselens clickhouse`: run the embedded ClickHouse server (or, with `--shards N`, a cluster of N
one-node shards on loopback) in the foreground until SIGTERM/Ctrl-C."""

from __future__ import annotations

import signal
import sys
import threading

from phaselens.commands._flags import given, refuse
from phaselens.storage.cluster import DEFAULT_CLUSTER, EmbeddedCluster
from phaselens.storage.embedded import EmbeddedClickHouse, EmbeddedClickHouseError


def register(subparsers) -> None:
    parser = subparsers.add_parser("clickhouse", help="run an embedded ClickHouse server (loopback only)")
    parser.add_argument("--data", required=True, metavar="DIR", help="data directory (kept across restarts)")
    parser.add_argument("--http-port", type=int, default=8123, help="(one node only; a cluster takes free ports)")
    parser.add_argument("--tcp-port", type=int, default=9000, help="(one node only)")
    parser.add_argument(
        "--shards",
        type=int,
        default=None,
        metavar="N",
        help="start N nodes, one shard each, defined as cluster --cluster-name",
    )
    parser.add_argument("--cluster-name", default=DEFAULT_CLUSTER, help="with --shards: the cluster's name")
    parser.set_defaults(func=run, _parser=parser)


def run(args) -> int:
    if args.shards is None:
        refuse(args, given(args, "cluster_name"), "names the cluster of --shards: give --shards N")
    else:
        refuse(args, given(args, "http_port", "tcp_port"), "set one node's ports; a cluster takes free ports")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server: EmbeddedCluster | EmbeddedClickHouse
    if args.shards is not None:
        server = EmbeddedCluster(args.data, shards=args.shards, name=args.cluster_name)
    else:
        server = EmbeddedClickHouse(args.data, http_port=args.http_port, tcp_port=args.tcp_port)
    try:
        server.start()
    except (EmbeddedClickHouseError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    try:
        urls = server.urls if isinstance(server, EmbeddedCluster) else [server.url]
        print(f"READY clickhouse {' '.join(urls)}", flush=True)
        while not stop.is_set() and server.running():
            stop.wait(0.5)
        return 0 if stop.is_set() else 1
    finally:
        server.stop()
