"""`phaselens demo --server dynamo [--disagg]`: NVIDIA Dynamo's frontend and mocker workers
(aggregated, or one prefill + one decode worker) behind the stack's pipeline, the demo's workload
from the load generator with `traceparent`, then the budget from Dynamo's own spans
(docs/disaggregation.md#dynamo): the client's view, Dynamo's frontend TTFT and, through a prefill
worker, the frontend's dispatch, its call to the prefill worker and the KV-transfer estimate, and
each worker's busy and idle time.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path

from rich.console import Console

from phaselens.analysis.budget import budget, budget_format, dynamo_budget
from phaselens.demo import DemoOptions, run_guarded, run_load, wait_for_spans
from phaselens.dynamo_stack import DynamoStack
from phaselens.stack import Stack


def run(opts: DemoOptions, console: Console, disagg: bool) -> int:
    """The demo; every child stops on return, Ctrl-C or an error. A temporary data directory (with
    Dynamo's model folder and state) is removed afterwards unless something failed."""
    data_dir = opts.data_dir or tempfile.mkdtemp(prefix="phaselens-dynamo-")
    served = DynamoStack(Stack(data_dir), disagg=disagg)
    return run_guarded(
        lambda: _session(served, opts, console),
        served.stop,
        served.stack.log_dir,
        data_dir,
        opts.data_dir is None,
        console,
    )


def _session(served: DynamoStack, opts: DemoOptions, console: Console) -> bool:
    """Start, load, wait, budget; True when every request of the run was queryable."""
    begin = time.monotonic()
    mode = "1 prefill + 1 decode worker" if served.disagg else "1 aggregated worker"
    with console.status("starting…") as status:
        served.start(lambda phase: status.update(f"starting {phase}…"))
    console.print(f"[green]✓[/] Dynamo ({mode}, mocker) at {served.url} · up in {time.monotonic() - begin:.1f} s")
    run_dir = Path(served.stack.data_dir) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"load: {opts.requests} requests, Poisson {opts.rate:g} req/s, mixed prompt lengths")
    load = run_load(served.stack, opts, run_dir, served.url)
    with console.status("waiting for spans…"):
        present = wait_for_spans(served.stack, load.trace_ids, opts.span_timeout_s, lambda n: None)
    console.print(f"[green]✓[/] {len(load.trace_ids)} ok, {load.failed} failed, {present} queryable with both views")
    since = f"{int(time.monotonic() - begin) + 30}s"
    with served.stack.client() as client:
        summary = budget(client, database=served.stack.database, since=since, exact=True, slo=opts.goodput_slo())
        dynamo = dynamo_budget.dynamo_budget(client, database=served.stack.database, since=since)
    console.print(budget_format.to_rich(summary))
    console.print(dynamo_budget.to_rich(dynamo))
    return bool(load.trace_ids) and present == len(load.trace_ids)
