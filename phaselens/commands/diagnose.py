"""`phaselens diagnose`: why is it slow? Six steps over the stored requests, then the verdict."""

from __future__ import annotations

import sys

from phaselens.analysis import diagnose_format
from phaselens.analysis.budget import GOODPUT_SLO_KEYS, AnalysisError, open_client
from phaselens.analysis.diagnose import diagnose
from phaselens.common.slo import parse_slo


def register(subparsers) -> None:
    parser = subparsers.add_parser("diagnose", help="why is it slow? a verdict from the requests in ClickHouse")
    parser.add_argument("--clickhouse", default="http://127.0.0.1:8123", metavar="URL",
                        help="ClickHouse HTTP URL, http://[user[:password]@]host:port")
    parser.add_argument("--database", default="otel", help="database holding otel_traces and the views")
    parser.add_argument("--service", default=None, help="only this service.name")
    parser.add_argument("--model", default=None, help="only this model")
    parser.add_argument("--since", default="15m", help="window back from now: 30s, 15m, 2h, 7d, or 'all'")
    parser.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS",
                        help="the SLOs the verdict judges against (default ttft:500,tpot:50)")
    parser.add_argument("--format", choices=("table", "json", "markdown"), default="table")
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
            result = diagnose(client, database=args.database, service=args.service, model=args.model,
                              since=None if args.since == "all" else args.since, slo=slo)
        finally:
            client.close()
    except AnalysisError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.format == "json":
        print(diagnose_format.to_json(result))
    elif args.format == "markdown":
        sys.stdout.write(diagnose_format.to_markdown(result))
    else:
        from rich.console import Console

        Console(width=160).print(diagnose_format.to_rich(result))
    return 0
