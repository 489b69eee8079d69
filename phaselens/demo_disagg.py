"""`phaselens demo --disagg`: the demo's workload twice on one pipeline, colocated (one instance)
and disaggregated (one prefill + one decode instance behind the router), and both budgets side by
side (docs/disaggregation.md#prove-the-lever-demo---disagg). With `--server vllm` the instances are
vLLM with the plugin (colocated: as `demo --server vllm`; disaggregated: integrations/vllm/pd.py,
the router speaking vLLM's protocol).

Each run has its own time window (the colocated server stops before the instances start), so the
budgets of a run read only its requests. What disaggregation removed: decode steps that carried
prefill (the decode instance never runs a prefill), and the ITL/TPOT tail they cause; what it
added: the KV wait and transfer, the prefill answer, the two hops, the router's own terms.

Verdict rule: disaggregation paid when its SLO attainment is higher, or equal with a lower client
TPOT p99 and a client TTFT p99 no higher; otherwise it did not pay, on this workload and machine.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from phaselens.analysis.budget import BudgetReport, PdBudget, budget, pd_budget
from phaselens.demo import DemoOptions, LoadRun, run_guarded, run_load, wait_for_spans
from phaselens.pd_stack import PdStack
from phaselens.stack import Stack, StackError

if TYPE_CHECKING:
    from phaselens.integrations.vllm.pd import VllmInstances

PD_WAIT_S = 60.0


def vllm_instances(data_dir: Path) -> VllmInstances:
    """vLLM prefill and decode instances on the tiny model in `data_dir` (StackError without vLLM)."""
    from phaselens.integrations.vllm.launcher import default_python
    from phaselens.integrations.vllm.pd import VllmInstances
    from phaselens.integrations.vllm.tiny_model import save_tiny_llama

    python = default_python()
    if python is None:
        raise StackError("no vLLM found: run ./setup.sh --vllm, or set PHASELENS_VLLM_PYTHON to a python with vLLM")
    return VllmInstances(python, save_tiny_llama(data_dir / "tiny-llama"), data_dir / "kv")


@dataclass(slots=True)
class RunBudget:
    name: str
    load: LoadRun
    budget: BudgetReport
    pd: PdBudget | None = None


def run(opts: DemoOptions, console: Console) -> int:
    """Both runs and the comparison; every child stops on return, Ctrl-C or an error."""
    data_dir = opts.data_dir or tempfile.mkdtemp(prefix="phaselens-disagg-")
    stack = Stack(data_dir, model=opts.model, device=opts.device, server_kind=opts.server)
    pd = PdStack(stack)

    def session() -> bool:
        if opts.server == "vllm":
            pd.instances = vllm_instances(Path(data_dir))
        colocated, disagg = _session(stack, pd, opts, console)
        console.print(compare(colocated, disagg))
        console.print(verdict(colocated, disagg))
        return True

    return run_guarded(session, pd.stop, stack.log_dir, data_dir, opts.data_dir is None, console)


def _session(stack: Stack, pd: PdStack, opts: DemoOptions, console: Console) -> tuple[RunBudget, RunBudget]:
    with console.status("starting ClickHouse, collector and the colocated server…"):
        stack.start()
    colocated = _measure(stack, opts, console, "colocated", None)
    assert stack.server is not None  # started with the stack
    stack.server.stop(stack.stop_timeout_s)  # flushes its spans; the instances start after its window
    stack.server = None
    with console.status("starting the prefill and decode instances and the router…") as status:
        pd.start_servers(lambda phase: status.update(f"starting {phase}…"))
    disagg = _measure(stack, opts, console, "disaggregated", pd.router_url)
    return colocated, disagg


def _measure(stack: Stack, opts: DemoOptions, console: Console, name: str, url: str | None) -> RunBudget:
    begin = time.monotonic()
    run_dir = Path(stack.data_dir) / name
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"{name}: {opts.requests} requests, Poisson {opts.rate:g} req/s, mixed prompt lengths")
    load = run_load(stack, opts, run_dir, url)
    with console.status(f"{name}: waiting for spans…"):
        present = wait_for_spans(stack, load.trace_ids, opts.span_timeout_s, lambda n: None)
    since = f"{int(time.monotonic() - begin) + 5}s"
    with stack.client() as client:
        report = budget(client, database=stack.database, since=since, slo=opts.goodput_slo())
        pd = _wait_pd(client, stack.database, since, len(load.trace_ids)) if url else None
    console.print(f"[green]✓[/] {name}: {len(load.trace_ids)} ok, {load.failed} failed, {present} queryable")
    return RunBudget(name, load, report, pd)


def _wait_pd(client, database: str, since: str, expected: int) -> PdBudget:
    """The P/D budget once every request's instance spans are in (or after PD_WAIT_S)."""
    deadline = time.monotonic() + PD_WAIT_S
    report = pd_budget.pd_budget(client, database=database, since=since)
    while report.complete < expected and time.monotonic() < deadline:
        time.sleep(0.5)
        report = pd_budget.pd_budget(client, database=database, since=since)
    return report


def _ms(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def _sum(pd: PdBudget, *terms: str) -> float:
    return sum(pd.term(t).mean or 0.0 for t in terms)


def _mean(report: BudgetReport, *names: str) -> float:
    return sum(report.distributions[n].mean or 0.0 for n in names)


def compare(colocated: RunBudget, disagg: RunBudget) -> Table:
    """Means of the TTFT terms (they add up to the mean client TTFT) and the decode figures."""
    c, d, pd = colocated.budget, disagg.budget, disagg.pd
    assert pd is not None  # a disaggregated run has its P/D budget
    table = Table(title="colocated vs disaggregated (ms; means add up to TTFT)", title_justify="left")
    for i, h in enumerate(("", "colocated", "disaggregated")):
        table.add_column(h, justify="left" if i == 0 else "right")
    rows = [
        ("client TTFT mean", _mean(c, "client_ttft_ms"), _mean(d, "client_ttft_ms")),
        ("  ingress (both instances)", _mean(c, "ingress_ms"), _sum(pd, "prefill_ingress_ms", "decode_ingress_ms")),
        ("  queue", _mean(c, "queue_ms"), _sum(pd, "prefill_queue_ms", "decode_queue_ms")),
        ("  prefill", _mean(c, "prefill_ms"), _sum(pd, "prefill_compute_ms")),
        ("  first token", _mean(c, "first_token_ms"), _sum(pd, "prefill_first_token_ms", "decode_first_token_ms")),
        ("  first chunk", _mean(c, "first_chunk_ms"), _sum(pd, "decode_first_chunk_ms")),
        ("  added: KV wait + transfer", None, _sum(pd, "kv_wait_ms", "kv_transfer_ms")),
        ("  added: prefill answer", None, _sum(pd, "prefill_respond_ms")),
        ("  added: hops", None, _sum(pd, "prefill_hop_ms", "decode_hop_ms")),
        ("  added: router", None, _sum(pd, "router_ingress_ms", "router_gap_ms", "router_relay_ms")),
        ("  residual (network + client)", _mean(c, "residual_ms"), _sum(pd, "residual_ms")),
        ("client TTFT p99", c.distributions["client_ttft_ms"].p99, d.distributions["client_ttft_ms"].p99),
        ("client TPOT p50", c.distributions["client_tpot_ms"].p50, d.distributions["client_tpot_ms"].p50),
        ("client TPOT p99", c.distributions["client_tpot_ms"].p99, d.distributions["client_tpot_ms"].p99),
        (
            "client ITL p99 (per request), p99",
            c.distributions["client_itl_p99_ms"].p99,
            d.distributions["client_itl_p99_ms"].p99,
        ),
        (
            "server ITL p99 (per request), p99",
            c.distributions["server_itl_p99_ms"].p99,
            pd.side["decode_itl_p99_ms"].p99,
        ),
        ("decode steps carrying prefill", c.stalls.mixed_steps, d.stalls.mixed_steps),
        ("engine time lost to prefill in decode steps", c.stalls.stall_ms, d.stalls.stall_ms),
    ]
    for label, a, b in rows:
        table.add_row(
            label,
            _ms(a) if isinstance(a, float) or a is None else str(a),
            _ms(b) if isinstance(b, float) or b is None else str(b),
        )
    table.add_row(
        "SLO attainment",
        f"{100 * (c.goodput.attainment or 0):.1f}%",
        f"{100 * (d.goodput.attainment or 0):.1f}%",
    )
    return table


def verdict(colocated: RunBudget, disagg: RunBudget) -> str:
    """The module docstring's rule, with the figures it used."""
    c, d, pd = colocated.budget, disagg.budget, disagg.pd
    assert pd is not None  # a disaggregated run has its P/D budget
    att_c, att_d = c.goodput.attainment or 0.0, d.goodput.attainment or 0.0
    tpot_c, tpot_d = c.distributions["client_tpot_ms"].p99, d.distributions["client_tpot_ms"].p99
    ttft_c, ttft_d = c.distributions["client_ttft_ms"].p99, d.distributions["client_ttft_ms"].p99
    better_tail = (
        tpot_c is not None
        and tpot_d is not None
        and ttft_c is not None
        and ttft_d is not None
        and tpot_d < tpot_c
        and ttft_d <= ttft_c
    )
    paid = att_d > att_c or (att_d == att_c and better_tail)
    removed = (
        f"removed {c.stalls.mixed_steps - d.stalls.mixed_steps} decode steps carrying prefill "
        f"({_ms(c.stalls.stall_ms)} → {_ms(d.stalls.stall_ms)} ms engine time lost), "
        f"client TPOT p99 {_ms(tpot_c)} → {_ms(tpot_d)} ms"
    )
    added = (
        f"added {_ms(pd.added_mean_ms())} ms per request (mean; KV transfer {_ms(pd.term('kv_transfer_ms').mean)} ms "
        f"for {(pd.side['kv_bytes'].mean or 0) / 1024:.0f} KiB), client TTFT p99 {_ms(ttft_c)} → {_ms(ttft_d)} ms"
    )
    word = "[green]disaggregation paid[/]" if paid else "[yellow]disaggregation did not pay[/]"
    return (
        f"{removed}; {added}.\nverdict: {word} on this workload and machine: SLO attainment "
        f"{100 * att_c:.1f}% colocated vs {100 * att_d:.1f}% disaggregated"
    )
