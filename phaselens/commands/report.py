"""`phaselens report`: one self-contained HTML report of whatever the ClickHouse holds."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import urlsplit

from phaselens.analysis.report import write_report
from phaselens.commands._analysis_args import add_selection, read


def register(subparsers) -> None:
    p = subparsers.add_parser("report", help="write an HTML report (budget, distributions, timelines, engine steps)")
    add_selection(p, "1h", "SLOs for goodput and the diagnosis")
    p.add_argument("--out", default="phaselens-report.html", metavar="FILE.html")
    p.set_defaults(func=run)


def _without_credentials(url: str) -> str:
    parts = urlsplit(url if "://" in url else f"http://{url}")
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 8123}"


def run(args) -> int:
    config = {"command": "phaselens report", "ClickHouse": _without_credentials(args.clickhouse)}
    rc, data = read(
        args,
        lambda client, **sel: write_report(
            client, args.out, database=args.database, service=args.service, model=args.model, config=config, **sel
        ),
    )
    if data is None:  # (1, None): the error was printed
        return rc
    print(f"report: {Path(args.out).resolve()} ({data.subtitle})")
    return 0
