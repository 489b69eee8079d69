"""`phaselens demo`: ClickHouse + collector + reference server + load, then the budget and a report."""

from __future__ import annotations

import sys

from rich.console import Console

from phaselens.commands._flags import given
from phaselens.common.slo import DEFAULT_TPOT_SLO_MS, DEFAULT_TTFT_SLO_MS
from phaselens.demo import DEFAULT_RATE, DemoOptions
from phaselens.demo import run as run_demo
from phaselens.stack import SERVER_KINDS


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "demo",
        help="run the whole pipeline on this machine and show where the time went",
        description="Starts an embedded ClickHouse, the collector and the reference server, "
        "runs a mixed workload with client spans, prints the latency budget and "
        "goodput, writes an HTML report, and shuts everything down.",
    )
    p.add_argument("--requests", type=int, default=200, help="measured requests (default 200)")
    p.add_argument(
        "--rate",
        type=float,
        default=DEFAULT_RATE,
        help=f"Poisson arrivals, requests/s (default {DEFAULT_RATE:g}: near the tiny model's capacity on 2 cores)",
    )
    p.add_argument("--model", default="tiny", help="'tiny' (built in, random weights) or a local HF model folder")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument(
        "--server",
        choices=(*SERVER_KINDS, "dynamo"),
        default="reference",
        help="reference (default); vllm: a real vLLM on the tiny model with the phaselens plugin; "
        "vllm-native: the same vLLM with its own spans only (needs ./setup.sh --vllm); dynamo: NVIDIA "
        "Dynamo's frontend and mocker workers, budgeted from Dynamo's spans (needs ./setup.sh --dynamo)",
    )
    p.add_argument(
        "--shards",
        type=int,
        default=1,
        metavar="N",
        help="ClickHouse as an embedded cluster of N shards, the collector writing with --cluster "
        "(default 1: one node)",
    )
    p.add_argument(
        "--data",
        metavar="DIR",
        default=None,
        help="keep ClickHouse data, spool and logs here (default: a temporary directory, removed)",
    )
    p.add_argument(
        "--slo",
        default=None,
        metavar="ttft:MS,tpot:MS",
        help=f"goodput SLOs (default ttft:{DEFAULT_TTFT_SLO_MS:g},tpot:{DEFAULT_TPOT_SLO_MS:g}; "
        "a key left out takes its default)",
    )
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed")
    p.add_argument("--keep-running", action="store_true", help="leave everything up afterwards (until Ctrl-C)")
    p.add_argument("--report", default="phaselens-report.html", metavar="FILE.html", help="where to write the report")
    p.add_argument(
        "--disagg",
        action="store_true",
        help="run the workload colocated and as 1 prefill + 1 decode instance behind a router, and compare "
        "both budgets (docs/disaggregation.md; the reference server, or --server vllm: vLLM instances with "
        "a KV connector; one ClickHouse node); with --server dynamo: one Dynamo prefill and one decode worker",
    )
    p.set_defaults(func=run, _parser=p)


def run(args) -> int:
    opts = DemoOptions(
        requests=args.requests,
        rate=args.rate,
        model=args.model,
        device=args.device,
        server=args.server,
        data_dir=args.data,
        keep_running=args.keep_running,
        report_path=args.report,
        slo=args.slo,
        seed=args.seed,
        shards=args.shards,
    )
    try:
        opts.validate()
        if args.disagg and (
            opts.server not in ("reference", "vllm", "dynamo") or opts.shards != 1 or opts.keep_running
        ):
            raise ValueError(
                "--disagg runs the reference server, vLLM with the plugin (--server vllm) or Dynamo on one node, "
                "without --keep-running"
            )
        if opts.server == "dynamo" and (opts.shards != 1 or opts.keep_running or given(args, "report")):
            raise ValueError(
                "--server dynamo runs on one ClickHouse node, without --keep-running, and writes no report"
            )
        if args.disagg and given(args, "report"):
            raise ValueError("--report: --disagg writes no HTML report; it prints both budgets and its verdict")
    except ValueError as e:
        print(f"phaselens demo: {e}", file=sys.stderr)
        return 2
    if opts.server == "dynamo":
        from phaselens.demo_dynamo import run as run_dynamo

        return run_dynamo(opts, Console(), disagg=args.disagg)
    if args.disagg:
        from phaselens.demo_disagg import run as run_disagg

        return run_disagg(opts, Console())
    return run_demo(opts, Console())
