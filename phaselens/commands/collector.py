"""`phaselens collector`: OTLP gRPC + HTTP receivers → durable spool → ClickHouse, in the foreground."""

from __future__ import annotations

import logging
import signal
import sys
import threading

from phaselens.collectors.service import Collector, default_spool_dir
from phaselens.collectors.shard_sink import CLUSTER_INSERTS
from phaselens.commands._flags import given, refuse
from phaselens.common.exposure import InsecureBindError
from phaselens.common.tls import TlsConfigError, server_tls


def register(subparsers) -> None:
    p = subparsers.add_parser("collector", help="receive OTLP traces and write them to ClickHouse")
    p.add_argument("--clickhouse", required=True, metavar="URL", help="e.g. http://127.0.0.1:8123 or https://…:8443")
    p.add_argument(
        "--clickhouse-ca",
        metavar="PEM",
        default=None,
        help="CA bundle that verifies an https:// ClickHouse (default: the system's trust store)",
    )
    p.add_argument("--database", default="otel")
    p.add_argument(
        "--cluster",
        default=None,
        metavar="NAME",
        help="a ClickHouse cluster (schema apply --cluster NAME): rows sharded by trace id",
    )
    p.add_argument(
        "--cluster-insert",
        choices=CLUSTER_INSERTS,
        default=None,
        help="with --cluster: straight to each shard (direct, the default), or through the Distributed table",
    )
    p.add_argument(
        "--host",
        default="127.0.0.1",
        help="listen address (non-loopback needs --auth-token or --tls-client-ca, or --insecure)",
    )
    p.add_argument("--grpc-port", type=int, default=4317)
    p.add_argument("--http-port", type=int, default=4318)
    p.add_argument(
        "--spool",
        metavar="DIR",
        default=None,
        help="spool directory, replayed on restart (default: ~/.local/state/phaselens/collector-spool-<grpc port>)",
    )
    p.add_argument("--auth-token", default=None, help="require 'Authorization: Bearer TOKEN' on both protocols")
    p.add_argument(
        "--insecure", action="store_true", help="allow a non-loopback listen address without a token or mutual TLS"
    )
    p.add_argument(
        "--tls-cert", metavar="PEM", default=None, help="serve OTLP/gRPC and OTLP/HTTP over TLS: certificate chain"
    )
    p.add_argument("--tls-key", metavar="PEM", default=None, help="the certificate's private key")
    p.add_argument(
        "--tls-client-ca",
        metavar="PEM",
        default=None,
        help="mutual TLS: clients must present a certificate signed by this CA",
    )
    p.add_argument(
        "--max-spool-bytes", type=int, default=1 << 30, help="backlog cap; beyond it exports get retryable errors"
    )
    p.add_argument("--max-body-bytes", type=int, default=16 << 20, help="request size cap, after decompression")
    p.add_argument("--batch-spans", type=int, default=50_000, help="spans per ClickHouse insert (at most)")
    p.add_argument(
        "--flush-interval",
        type=float,
        default=0.2,
        metavar="SECONDS",
        help="longest wait before a partial batch is written",
    )
    p.set_defaults(func=run, _parser=p)


def run(args) -> int:
    if args.cluster is None:
        refuse(args, given(args, "cluster_insert"), "routes rows to a cluster's shards: give --cluster NAME")
    if not args.clickhouse.lower().startswith("https://"):
        refuse(args, given(args, "clickhouse_ca"), "verifies an https:// ClickHouse; --clickhouse is not one")
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        tls = server_tls(args.tls_cert, args.tls_key, args.tls_client_ca)
    except TlsConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    collector = Collector(
        clickhouse_url=args.clickhouse,
        clickhouse_ca=args.clickhouse_ca,
        database=args.database,
        cluster=args.cluster,
        cluster_insert=args.cluster_insert or "direct",
        host=args.host,
        grpc_port=args.grpc_port,
        http_port=args.http_port,
        spool_dir=args.spool or default_spool_dir(args.grpc_port),
        auth_token=args.auth_token,
        insecure=args.insecure,
        tls=tls,
        max_spool_bytes=args.max_spool_bytes,
        max_body_bytes=args.max_body_bytes,
        batch_spans=args.batch_spans,
        flush_interval_s=args.flush_interval,
    )
    try:
        collector.start()
    except (InsecureBindError, TlsConfigError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(f"READY collector grpc={collector.grpc_endpoint} http={collector.http_endpoint}", flush=True)
    while not stop.wait(0.5):
        pass
    drained = collector.stop()
    if not drained:
        print("warning: ClickHouse unreachable; unwritten spans stay in the spool for the next start", file=sys.stderr)
    return 0


if __name__ == "__main__":
    # `python -m phaselens.commands.collector …`: this command alone, without importing every other
    # command module (some import torch), so tests and the benchmark start it in well under a second.
    import argparse

    _parser = argparse.ArgumentParser(prog="phaselens")
    register(_parser.add_subparsers())
    sys.exit(run(_parser.parse_args(["collector", *sys.argv[1:]])))
