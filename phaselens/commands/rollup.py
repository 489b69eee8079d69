"""`phaselens rollup backfill`: recompute the sealed per-minute rollup rows of a window from every
request (analysis/rollup/rollup_backfill.py): after client views were imported late, or to repair; and the
engine-step rollup's minutes that miss steps (analysis/rollup/step_backfill.py): steps stored before it existed."""

from __future__ import annotations

import sys

from phaselens.commands._analysis_args import add_store


def register(subparsers) -> None:
    parser = subparsers.add_parser("rollup", help="maintain the per-minute budget rollups")
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    backfill = actions.add_parser(
        "backfill",
        help="recompute the sealed minutes of a window from every request (each request once), and the "
        "engine-step minutes that miss steps",
    )
    add_store(backfill, " (on a cluster: any node)")
    backfill.add_argument("--since", default="1h", help="window start back from now: 30s, 15m, 2h, 7d")
    backfill.add_argument("--until", default="0s", help="window end back from now (default: now)")
    backfill.set_defaults(func=run_backfill)


def run_backfill(args) -> int:
    from clickhouse_connect.driver.exceptions import ClickHouseError

    from phaselens.analysis.budget import AnalysisError, open_client
    from phaselens.analysis.harness import distributed_cluster
    from phaselens.analysis.queries import QueryError, duration_ms
    from phaselens.analysis.rollup import (
        BackfillError,
        backfill_minutes,
        backfill_steps,
        minutes_between,
        on_each_node,
        push,
    )

    try:
        since_ms, until_ms = duration_ms(args.since), duration_ms(args.until)
    except QueryError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        client = open_client(args.clickhouse)
        try:
            minutes = minutes_between(client, args.database, since_ms, until_ms)
            cluster = distributed_cluster(client, args.database)
            # rollups built before every node kept a copy of every node's rows: copied once
            pushed = on_each_node(
                client, args.clickhouse, cluster, lambda node, nodes: push(node, args.database, nodes)
            )
            nodes = backfill_minutes(client, args.clickhouse, args.database, cluster, minutes)
            steps = on_each_node(
                client,
                args.clickhouse,
                cluster,
                lambda node, nodes: backfill_steps(node, args.database, since_ms, until_ms, nodes),
            )
        finally:
            client.close()
    except (AnalysisError, BackfillError, ClickHouseError, OSError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        return 1
    for i, (node, step_minutes, (requests_sent, steps_named)) in enumerate(zip(nodes, steps, pushed, strict=True), 1):
        if requests_sent or steps_named:
            print(
                f"node {i}: copied {requests_sent} request rows to the other nodes, {steps_named} engine-step rows named"
            )
        print(
            f"node {i}: {_minutes(node.minutes)} recomputed, {node.requests} requests sealed already "
            f"({node.rounds} round{'s' if node.rounds > 1 else ''}); engine steps: {_minutes(step_minutes)} recomputed"
        )
    return 0


def _minutes(count: int) -> str:
    return f"{count} minute{'s' if count != 1 else ''}"
