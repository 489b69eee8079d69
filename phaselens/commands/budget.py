"""`phaselens budget`: the TTFT latency budget, tails, TPOT/ITL, goodput and decode stalls."""

from __future__ import annotations

import sys

from phaselens.analysis import budget_format
from phaselens.analysis.budget import GOODPUT_SLO_KEYS, AnalysisError, budget, open_client
from phaselens.common.slo import parse_slo


def register(subparsers) -> None:
    parser = subparsers.add_parser("budget", help="latency budget of the requests stored in ClickHouse")
    parser.add_argument("--clickhouse", default="http://127.0.0.1:8123", metavar="URL",
                        help="ClickHouse HTTP URL, http://[user[:password]@]host:port")
    parser.add_argument("--database", default="otel", help="database holding otel_traces and the views")
    parser.add_argument("--service", default=None, help="only this service.name")
    parser.add_argument("--model", default=None, help="only this model")
    parser.add_argument("--since", default="15m", help="window back from now: 30s, 15m, 2h, 7d, or 'all'")
    parser.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS", help="SLOs for goodput")
    parser.add_argument("--approx", action="store_true",
                        help="t-digest percentiles: constant memory on huge selections (default: exact)")
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table")
    parser.set_defaults(func=run)


def run(args) -> int:
    try:
        slo = parse_slo(args.slo, GOODPUT_SLO_KEYS) if args.slo else None
    except ValueError as e:
        print(f"error: --slo: {e}", file=sys.stderr)
        return 1
    try:
        client = open_client(args.clickhouse)
        try:
            report = budget(client, database=args.database, service=args.service, model=args.model,
                            since=None if args.since == "all" else args.since, slo=slo, approx=args.approx)
        finally:
            client.close()
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(budget_format.to_json(report))
    elif args.format == "csv":
        sys.stdout.write(budget_format.to_csv(report))
    else:
        from rich.console import Console

        Console().print(budget_format.to_rich(report))
    return 0
