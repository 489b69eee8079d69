"""`phaselens diagnose`: why is it slow? Six steps over the stored requests, then the verdict."""

from __future__ import annotations

import sys

from phaselens.analysis.diagnose import diagnose, diagnose_format
from phaselens.commands._analysis_args import add_selection, read


def register(subparsers) -> None:
    parser = subparsers.add_parser("diagnose", help="why is it slow? a verdict from the requests in ClickHouse")
    add_selection(parser, "15m", "the SLOs the verdict judges against")
    parser.add_argument("--format", choices=("table", "json", "markdown"), default="table")
    parser.set_defaults(func=run)


def run(args) -> int:
    rc, result = read(
        args,
        lambda client, **sel: diagnose(client, database=args.database, service=args.service, model=args.model, **sel),
    )
    if result is None:  # (1, None): the error was printed
        return rc
    if args.format == "json":
        print(diagnose_format.to_json(result))
    elif args.format == "markdown":
        sys.stdout.write(diagnose_format.to_markdown(result))
    else:
        from rich.console import Console

        Console(width=160).print(diagnose_format.to_rich(result))
    return 0
