"""`phaselens budget`: the TTFT latency budget, tails, TPOT/ITL, goodput and decode stalls; for
disaggregated requests also their budget across the router, prefill and decode instances, and for
requests served by NVIDIA Dynamo the budget from Dynamo's own spans."""

from __future__ import annotations

import sys

from phaselens.analysis.budget import AnalysisError, budget, budget_format
from phaselens.analysis.budget import dynamo_budget as dyn
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
            *_besides(client, args, sel["since"]),
        ),
    )
    if both is None:  # (1, None): the error was printed
        return rc
    report, disagg, dynamo = both
    disagg = disagg if disagg is not None and disagg.requests else None
    dynamo = dynamo if dynamo is not None and dynamo.requests else None
    if args.format == "json":
        print(_json_with(report, disagg, dynamo))
    elif args.format == "csv":
        sys.stdout.write(budget_format.to_csv(report, disagg.to_dict() if disagg is not None else None))
    else:
        from rich.console import Console

        console = Console()
        console.print(budget_format.to_rich(report))
        if disagg is not None:
            console.print(pd.to_rich(disagg))
        if dynamo is not None:
            console.print(dyn.to_rich(dynamo))
    return 0


def _besides(client, args, since: str | None) -> tuple[pd.PdBudget | None, dyn.DynamoBudget | None]:
    """The P/D and the Dynamo budgets, or (None, None) after a one-line warning when they failed: they
    read every request (on a cluster through the Distributed tables, so a shard down fails them) while
    the rollup budget reads the asked node's complete copy and stands. Both read `phaselens_requests`
    the same way: the second is not tried when the first failed."""
    try:
        selection = {"database": args.database, "model": args.model, "since": since}
        return pd.pd_budget(client, **selection), dyn.dynamo_budget(client, **selection)
    except AnalysisError as e:
        print(f"warning: no disaggregated budget: {e}", file=sys.stderr)
        return None, None


def _json_with(report, disagg, dynamo) -> str:
    """The budget's JSON, with the disaggregated budget under `disaggregated` and Dynamo's under
    `dynamo` when the selection holds such requests."""
    import json

    extra = {"disaggregated": disagg, "dynamo": dynamo}
    out = json.loads(budget_format.to_json(report)) | {k: v.to_dict() for k, v in extra.items() if v is not None}
    return json.dumps(out, indent=2, default=str)
