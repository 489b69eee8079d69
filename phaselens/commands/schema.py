"""`phaselens schema apply`: create the exporter-compatible trace tables, then the analysis views.

With `--cluster NAME`, two ways (`--ddl`): `on-cluster` sends each statement once with ON CLUSTER
and Replicated engines (a cluster with Keeper and distributed DDL); `per-node` runs plain-engine
statements on every node `system.clusters` lists for NAME, in turn (a cluster without distributed
DDL, e.g. `phaselens clickhouse --shards N`). Both are idempotent: applying twice changes nothing.
"""

from __future__ import annotations

import sys

from phaselens.analysis.schema import schema as analysis_schema
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as collector_schema
from phaselens.commands._flags import given, refuse
from phaselens.storage.cluster_nodes import ClusterError, node_urls

DDL_MODES = ("on-cluster", "per-node")
_DDL_DISABLED = "Code: 392"  # QUERY_IS_PROHIBITED: "Replicated DDL queries are disabled"


def register(subparsers) -> None:
    parser = subparsers.add_parser("schema", help="manage the ClickHouse schema")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    apply_p = actions.add_parser("apply", help="create otel_traces (as the OTel exporter does) and the analysis views")
    apply_p.add_argument(
        "--clickhouse", default=None, metavar="URL", help="e.g. http://127.0.0.1:8123 (required unless --print)"
    )
    apply_p.add_argument("--database", default="otel")
    apply_p.add_argument("--ttl", default=None, help="row lifetime, e.g. 72h or 30d (default: keep)")
    apply_p.add_argument("--cluster", default=None, help="cluster name: Distributed tables sharded by trace id")
    apply_p.add_argument(
        "--ddl",
        choices=DDL_MODES,
        default=None,
        help="with --cluster: ON CLUSTER + Replicated engines (on-cluster, the default; needs Keeper), or the "
        "statements on every node of system.clusters with plain engines",
    )
    apply_p.add_argument(
        "--table-engine",
        default=None,
        help="e.g. ReplicatedMergeTree('/clickhouse/tables/{shard}/otel_traces', '{replica}')",
    )
    apply_p.add_argument("--print", action="store_true", help="print the statements instead of running them")
    apply_p.set_defaults(func=run, _parser=apply_p)


def run(args) -> int:
    if args.cluster is None:
        refuse(args, given(args, "ddl"), "says how to create a cluster's tables: give --cluster NAME")
    if args.print:
        refuse(args, given(args, "clickhouse"), "is not used by --print, which runs nothing")
    elif args.clickhouse is None:
        args._parser.error("--clickhouse URL is required (or --print the statements)")
    per_node = bool(args.cluster) and args.ddl == "per-node"
    statements = ddl.all_statements(
        args.database, ttl=args.ttl, cluster=args.cluster, table_engine=args.table_engine, on_cluster=not per_node
    )
    if args.print:
        print(analysis_schema.script(statements))
        return 0
    try:
        urls = node_urls(args.clickhouse, args.cluster) if per_node else [args.clickhouse]
        collector_schema.apply_each(urls, statements)
    except ClusterError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if args.cluster and _DDL_DISABLED in str(exc):
            print(
                f"error: this cluster runs no distributed DDL (ON CLUSTER refused: {_DDL_DISABLED}); "
                "apply the schema node by node with --ddl per-node",
                file=sys.stderr,
            )
            return 1
        raise
    where = f"{len(urls)} nodes of cluster {args.cluster}" if per_node else args.clickhouse
    print(f"applied {len(statements)} statements to database {args.database} on {where}")
    return 0
