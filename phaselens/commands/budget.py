"""`phaselens budget`: the TTFT latency budget, tails, TPOT/ITL, goodput and decode stalls; for
disaggregated requests also their budget across the router, prefill and decode instances."""

from __future__ import annotations

import sys

from phaselens.analysis.budget import AnalysisError, budget, budget_format
from phaselens.analysis.budget import pd_budget as pd
from phaselens.commands._analysis_args import add_selection, read
from phaselens.commands._flags import refuse


def register(subparsers) -> None:
    parser = subparsers.add_parser("budget", help="latency budget of the requests stored in ClickHouse")
    add_selection(parser, "15m", "SLOs for goodput")
    parser.add_argument(
        "--exact",
        action="store_true",
        help="read every request (default: the per-minute rollups, DDSketch quantiles within 1 %%)",
    )
    parser.add_argument(
        "--approx",
        action="store_true",
        help="read every request, with t-digest percentiles: constant memory on huge selections",
    )
    parser.add_argument("--format", choices=("table", "json", "csv"), default="table")
    parser.set_defaults(func=run, _parser=parser)


def run(args) -> int:
    refuse(args, ["--exact", "--approx"] if args.exact and args.approx else [], "choose how to read: give one")
    rc, both = read(
        args,
        lambda client, **sel: (
            budget(
                client,
                database=args.database,
                service=args.service,
                model=args.model,
                approx=args.approx,
                exact=args.exact,
                **sel,
            ),
            _disaggregated(client, args, sel["since"]),
        ),
    )
    if both is None:  # (1, None): the error was printed
        return rc
    report, disagg = both
    if args.format == "json":
        print(budget_format.to_json(report) if disagg is None or not disagg.requests else _json_with(report, disagg))
    elif args.format == "csv":
        sys.stdout.write(
            budget_format.to_csv(report, disagg.to_dict() if disagg is not None and disagg.requests else None)
        )
    else:
        from rich.console import Console

        console = Console()
        console.print(budget_format.to_rich(report))
        if disagg is not None and disagg.requests:
            console.print(pd.to_rich(disagg))
    return 0


def _disaggregated(client, args, since: str | None) -> pd.PdBudget | None:
    """The P/D budget, or None after a one-line warning when it alone failed: it reads every
    request (on a cluster through the Distributed tables, so a shard down fails it) while the
    rollup budget reads the asked node's complete copy and stands."""
    try:
        return pd.pd_budget(client, database=args.database, model=args.model, since=since)
    except AnalysisError as e:
        print(f"warning: no disaggregated budget: {e}", file=sys.stderr)
        return None


def _json_with(report, disagg) -> str:
    """The budget's JSON with the disaggregated budget under `disaggregated`."""
    import json

    return json.dumps({**json.loads(budget_format.to_json(report)), "disaggregated": disagg.to_dict()}, indent=2)
