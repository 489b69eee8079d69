"""`phaselens schema apply`: create the exporter-compatible trace tables, then the analysis views."""

from __future__ import annotations

from phaselens.analysis import schema as analysis_schema
from phaselens.collectors import schema as collector_schema
from phaselens.storage.clickhouse_url import connect


def register(subparsers) -> None:
    parser = subparsers.add_parser("schema", help="manage the ClickHouse schema")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    apply_p = actions.add_parser("apply", help="create otel_traces (as the OTel exporter does) and the analysis views")
    apply_p.add_argument("--clickhouse", required=True, metavar="URL", help="e.g. http://127.0.0.1:8123")
    apply_p.add_argument("--database", default="otel")
    apply_p.add_argument("--ttl", default=None, help="row lifetime, e.g. 72h or 30d (default: keep)")
    apply_p.add_argument("--cluster", default=None, help="cluster name: ON CLUSTER, Replicated engines, Distributed table")
    apply_p.add_argument("--table-engine", default=None, help="e.g. ReplicatedMergeTree('/clickhouse/tables/{shard}/otel_traces', '{replica}')")
    apply_p.add_argument("--print", action="store_true", help="print the statements instead of running them")
    apply_p.set_defaults(func=run)


def run(args) -> int:
    statements = analysis_schema.all_statements(args.database, ttl=args.ttl, cluster=args.cluster,
                                                table_engine=args.table_engine)
    if args.print:
        print(analysis_schema.script(statements))
        return 0
    client = connect(args.clickhouse)
    try:
        collector_schema.apply(client, statements)
    finally:
        client.close()
    print(f"applied {len(statements)} statements to database {args.database}")
    return 0
