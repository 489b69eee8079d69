"""The selection options and the run of the commands that read ClickHouse (budget, diagnose, report):
shared, not a command."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

from phaselens.analysis.budget import AnalysisError, open_client
from phaselens.common.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS, goodput_slo

T = TypeVar("T")


def add_store(parser, url_note: str = "") -> None:
    """--clickhouse, --database: where the spans and the views are (`url_note` follows the URL's help)."""
    parser.add_argument(
        "--clickhouse",
        default="http://127.0.0.1:8123",
        metavar="URL",
        help=f"ClickHouse HTTP URL, http://[user[:password]@]host:port{url_note}",
    )
    parser.add_argument("--database", default="otel", help="database holding otel_traces and the views")


def add_selection(parser, since: str, slo_help: str) -> None:
    """--clickhouse, --database, --service, --model, --since, --slo."""
    add_store(parser)
    parser.add_argument("--service", default=None, help="only this service.name")
    parser.add_argument("--model", default=None, help="only this model")
    parser.add_argument("--since", default=since, help="window back from now: 30s, 15m, 2h, 7d, or 'all'")
    parser.add_argument(
        "--slo",
        default=None,
        metavar="ttft:MS,tpot:MS",
        help=f"{slo_help} (default ttft:{DEFAULT_TTFT_SLO_MS:g},tpot:{DEFAULT_TPOT_SLO_MS:g}; a key left out takes its default)",
    )


def read(args, fn: Callable[..., T]) -> tuple[int, T | None]:
    """(0, fn(client, since=…, slo=…)) over a client of `--clickhouse`, or (1, None) after a one-line
    error on stderr (bad --slo, ClickHouse unreachable or failing, a file that cannot be written)."""
    try:
        slo = goodput_slo(args.slo)
    except ValueError as e:
        print(f"error: --slo: {e}", file=sys.stderr)
        return 1, None
    try:
        client = open_client(args.clickhouse)
        try:
            return 0, fn(client, since=None if args.since == "all" else args.since, slo=slo)
        finally:
            client.close()
    except (AnalysisError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1, None
