"""`phaselens report`: one self-contained HTML report of whatever the ClickHouse holds."""

from __future__ import annotations

import sys
from pathlib import Path
from urllib.parse import urlsplit

from phaselens.analysis.budget import GOODPUT_SLO_KEYS, AnalysisError, open_client
from phaselens.common.slo import parse_slo
from phaselens.analysis.report import write_report


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="write an HTML report (budget, distributions, timelines, engine steps)")
    p.add_argument("--clickhouse", default="http://127.0.0.1:8123", metavar="URL")
    p.add_argument("--database", default="otel")
    p.add_argument("--since", default="1h", help="window back from now: 30s, 15m, 2h, 7d, or 'all'")
    p.add_argument("--service", default=None, help="only this service.name")
    p.add_argument("--model", default=None, help="only this model")
    p.add_argument("--slo", default=None, metavar="ttft:MS,tpot:MS", help="SLOs for goodput")
    p.add_argument("--out", default="phaselens-report.html", metavar="FILE.html")
    p.set_defaults(func=run)


def _without_credentials(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 8123}"


def run(args) -> int:
    try:
        slo = parse_slo(args.slo, GOODPUT_SLO_KEYS) if args.slo else None
    except ValueError as e:
        print(f"error: --slo: {e}", file=sys.stderr)
        return 1
    try:
        client = open_client(args.clickhouse)
        try:
            data = write_report(client, args.out, database=args.database,
                                since=None if args.since == "all" else args.since, service=args.service,
                                model=args.model, slo=slo, config={"command": "phaselens report",
                                                                  "ClickHouse": _without_credentials(args.clickhouse)})
        finally:
            client.close()
    except (AnalysisError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"report: {Path(args.out).resolve()} ({data.subtitle})")
    return 0
