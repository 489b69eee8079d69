"""`phaselens import HARNESS PATH`: another harness's per-request records as client views, joined to
the server requests by the X-Request-ID they sent (docs/harness-import.md)."""

from __future__ import annotations

import sys

from phaselens.commands._analysis_args import add_store

HARNESSES = ("aiperf",)


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "import", help="join a harness's per-request export (AIPerf) to the stored server requests"
    )
    parser.add_argument("harness", choices=HARNESSES, help="who wrote the export")
    parser.add_argument("path", help="aiperf: its artifact directory (or its profile_export.jsonl)")
    add_store(parser)
    parser.add_argument("--list", type=int, default=10, metavar="N", help="unmatched ids to print (default 10)")
    parser.set_defaults(func=run)


def run(args) -> int:
    from phaselens.analysis.budget import AnalysisError, open_client
    from phaselens.analysis.harness import HarnessFormatError, import_run, read_export, summary_lines

    try:
        exported = read_export(args.harness, args.path)
    except HarnessFormatError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    try:
        client = open_client(args.clickhouse)
        try:
            report = import_run(client, args.clickhouse, exported, args.database)
        finally:
            client.close()
    except (AnalysisError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    out, warnings = summary_lines(report, exported, args.list)
    print("\n".join(out))
    for line in warnings:
        print(line, file=sys.stderr)
    return 1 if exported.bad_lines or report.rollup_error else 0
