"""`phaselens demo`: the whole pipeline on one machine, one run, one budget, one report.

Sequence: Stack up (ClickHouse, or a cluster of `shards` nodes; schema, collector, reference server)
→ a mixed workload from the load generator (`phaselens bench`, client spans on) → wait until every
request of the run is queryable with its client and server views and ingestion has gone quiet → the
budget (the analysis API, printed by the renderer `phaselens budget` uses) → the HTML report → stop
(or keep running).

Workload: Poisson arrivals at `rate` req/s, near the tiny model's capacity on a 2-core CPU so that
queueing shows; prompts of two kinds, most short and some long (which need chunked prefill and
delay the decodes batched with them), outputs of 16-48 tokens.
"""

from __future__ import annotations

import json
import shlex
import shutil
import signal
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from rich.console import Console

from phaselens.analysis.budget import AnalysisError, budget, budget_format
from phaselens.analysis.report import build as build_report
from phaselens.analysis.report import report_page
from phaselens.analysis.rollup import rollup
from phaselens.common.slo import SLO, goodput_slo
from phaselens.loadgen.workloads import words
from phaselens.stack import CLIENT_SERVICE, SERVER_SERVICE, Stack, StackError
from phaselens.storage.clickhouse_url import connect

DEFAULT_RATE = 5.0  # req/s: near the tiny model's capacity with this workload on 2 CPU cores (measured)
SHORT_WORDS, LONG_WORDS, LONG_SHARE = (8, 40), (150, 300), 0.2
OUTPUT_TOKENS = (16, 48)


@dataclass(slots=True)
class DemoOptions:
    requests: int = 200
    rate: float = DEFAULT_RATE
    model: str = "tiny"
    device: str = "cpu"
    server: str = "reference"  # stack.SERVER_KINDS
    data_dir: str | None = None  # None: a temporary directory, removed at the end
    keep_running: bool = False
    report_path: str = "phaselens-report.html"
    slo: str | None = None  # `--slo` text; None: common.slo.DEFAULT_SLO
    seed: int = 0
    shards: int = 1  # >1: an embedded ClickHouse cluster of that many shards
    span_timeout_s: float = 120.0

    def validate(self) -> None:
        """ValueError naming the first bad option."""
        if self.requests < 1:
            raise ValueError(f"--requests must be ≥ 1, not {self.requests}")
        if self.shards < 1:
            raise ValueError(f"--shards must be ≥ 1, not {self.shards}")
        if self.server != "reference" and self.model != "tiny":
            raise ValueError("--server vllm runs the tiny model (built offline); --model is for the reference server")
        if not 0 < self.rate < float("inf"):
            raise ValueError(f"--rate must be a positive number of requests/s, not {self.rate}")
        try:
            self.goodput_slo()
        except ValueError as e:
            raise ValueError(f"--slo: {e}") from None

    def goodput_slo(self) -> SLO:
        return goodput_slo(self.slo)


@dataclass(slots=True)
class LoadRun:
    trace_ids: list[str]
    failed: int
    wall_s: float
    workload: dict = field(default_factory=dict)
    summary: dict = field(default_factory=dict)


def make_dataset(path: Path, count: int, seed: int) -> dict:
    """A JSONL of `count` prompts: LONG_SHARE long ones, the rest short; returns its description."""
    rng = np.random.default_rng(seed)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(count):
            lo, hi = LONG_WORDS if rng.random() < LONG_SHARE else SHORT_WORDS
            row = {
                "prompt": words(rng, int(rng.integers(lo, hi + 1))),
                "output_len": int(rng.integers(OUTPUT_TOKENS[0], OUTPUT_TOKENS[1] + 1)),
            }
            f.write(json.dumps(row) + "\n")
    return {
        "dataset": str(path),
        "prompts": f"{1 - LONG_SHARE:.0%} of {SHORT_WORDS[0]}-{SHORT_WORDS[1]} words, "
        f"{LONG_SHARE:.0%} of {LONG_WORDS[0]}-{LONG_WORDS[1]} words",
        "output_tokens": f"{OUTPUT_TOKENS[0]}-{OUTPUT_TOKENS[1]} (ignore_eos)",
    }


def run_load(stack: Stack, opts: DemoOptions, run_dir: Path, url: str | None = None) -> LoadRun:
    """One `phaselens bench` run against the stack's server (or `url`); trace ids from its per-request file."""
    dataset, per_request, summary = run_dir / "workload.jsonl", run_dir / "requests.jsonl", run_dir / "bench.json"
    workload = make_dataset(dataset, opts.requests, opts.seed)
    slo = opts.goodput_slo()
    argv = [
        "--model",
        stack.served_model() if url is None else opts.model,
        "--rate",
        str(opts.rate),
        "--requests",
        str(opts.requests),
        "--dataset",
        str(dataset),
        "--ignore-eos",
        "--seed",
        str(opts.seed),
        "--goodput",
        *(f"{key}:{ms:g}" for key, ms in (("ttft", slo.ttft_ms), ("tpot", slo.tpot_ms))),
        "--per-request",
        str(per_request),
        "--json",
        str(summary),
    ]
    start = time.monotonic()
    code = stack.bench(argv, timeout_s=max(600.0, 10 * opts.requests / opts.rate), url=url)
    wall_s = time.monotonic() - start
    if not per_request.exists():
        raise RuntimeError(f"phaselens bench failed (exit {code}); see {stack.log_dir / 'bench.log'}")
    rows = [json.loads(line) for line in per_request.read_text().splitlines() if line.strip()]
    ok = [r["trace_id"] for r in rows if r.get("trace_id") and r.get("error_type") is None]
    return LoadRun(
        ok, len(rows) - len(ok), wall_s, workload, json.loads(summary.read_text()) if summary.exists() else {}
    )


def wait_for_spans(stack: Stack, trace_ids: list[str], timeout_s: float, on_progress) -> int:
    """Poll until every request is queryable with both views and otel_traces stops growing
    (engine-step spans come in their own batches); returns how many requests are present."""
    deadline, present, last_rows = time.monotonic() + timeout_s, 0, -1
    while time.monotonic() < deadline:
        present = stack.requests_present(trace_ids)
        on_progress(present)
        rows = stack.span_rows()
        if present == len(trace_ids) and rows == last_rows:
            break
        last_rows = rows
        time.sleep(0.5)
    return present


def _since(elapsed_s: float) -> str:
    """A `--since` window covering this run (and a little before it)."""
    return f"{int(elapsed_s) + 30}s"


def _raise_interrupt(*_):
    raise KeyboardInterrupt


def run(opts: DemoOptions, console: Console) -> int:
    """The demo; returns the exit code (see `run_guarded`)."""
    data_dir = opts.data_dir or tempfile.mkdtemp(prefix="phaselens-demo-")
    stack = Stack(data_dir, model=opts.model, device=opts.device, server_kind=opts.server, shards=opts.shards)

    def session() -> bool:
        ok = _session(stack, opts, console)
        if opts.keep_running:
            _print_howto(stack, console)
            _sleep_until_interrupted()
        return ok

    return run_guarded(session, stack.stop, stack.log_dir, data_dir, opts.data_dir is None, console)


def run_guarded(
    session: Callable[[], bool],
    stop: Callable[[], object],
    log_dir: Path,
    data_dir: str,
    temporary: bool,
    console: Console,
) -> int:
    """Every demo's frame: `session` (True: every request of the run queryable) → exit 0, else 1;
    Ctrl-C or SIGTERM → 130; a stack or analysis error → 1, printed with the logs' folder. `stop`
    always runs, uninterrupted; a `temporary` data folder is removed unless something failed (its
    logs/ tell why)."""
    signal.signal(signal.SIGTERM, _raise_interrupt)
    code = 1
    try:
        code = 0 if session() else 1
    except KeyboardInterrupt:
        console.print("interrupted: stopping")
        code = 130
    except (StackError, AnalysisError, RuntimeError, OSError) as e:
        console.print(f"[red]error:[/] {e}\nlogs: {log_dir}")
    finally:
        stopping = time.monotonic()
        for sig in (signal.SIGTERM, signal.SIGINT):  # a second Ctrl-C must not cut the ordered stop short
            signal.signal(sig, signal.SIG_IGN)
        with console.status("stopping…"):
            stop()
        console.print(f"stopped in {time.monotonic() - stopping:.1f} s")
        if temporary and code in (0, 130):
            shutil.rmtree(data_dir, ignore_errors=True)
    return code


def _session(stack: Stack, opts: DemoOptions, console: Console) -> bool:
    """Start, load, wait, budget, report; True when every request of the run was queryable."""
    begin = time.monotonic()
    with console.status("starting…") as status:
        stack.start(on_phase=lambda phase: status.update(f"starting {phase}…"))
    console.print(
        f"[green]✓[/] {stack.storage.describe()} · collector OTLP/gRPC {stack.otlp_grpc_endpoint} "
        f"· server {stack.server_url} ({opts.server}, {opts.model}, {opts.device}) "
        f"· up in {time.monotonic() - begin:.1f} s"
    )
    run_dir = Path(stack.data_dir) / "run"
    run_dir.mkdir(parents=True, exist_ok=True)
    console.print(f"load: {opts.requests} requests, Poisson {opts.rate:g} req/s, mixed prompt lengths")
    load = run_load(stack, opts, run_dir)
    rps = load.summary.get("summary", {}).get("throughput", {}).get("requests_per_s") or 0.0
    console.print(
        f"[green]✓[/] load done in {load.wall_s:.1f} s: {len(load.trace_ids)} ok, {load.failed} failed, "
        f"{rps:.2f} req/s completed (client view)"
    )
    with console.status("waiting for spans…") as status:
        present = wait_for_spans(
            stack,
            load.trace_ids,
            opts.span_timeout_s,
            lambda n: status.update(f"queryable: {n}/{len(load.trace_ids)} requests"),
        )
    console.print(f"[green]✓[/] {present}/{len(load.trace_ids)} requests queryable with client and server views")
    _refresh_rollups(stack)
    since = _since(time.monotonic() - begin)
    _print_budget(stack, since, opts, console)
    _write_report(stack, since, opts, load, console)
    console.print(f"demo finished in {time.monotonic() - begin:.1f} s")
    return bool(load.trace_ids) and present == len(load.trace_ids)


def _sleep_until_interrupted() -> None:
    try:
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass


def _refresh_rollups(stack: Stack) -> None:
    """The run's last requests into every node's live rollup table now, not at its next refresh:
    the printed `phaselens budget` (rollups by default) then counts every request of the run."""
    assert stack.storage is not None  # started with the stack
    for url in stack.storage.node_urls():
        client = connect(url)
        try:
            rollup.refresh_now(client, stack.database)
        finally:
            client.close()


def _print_budget(stack: Stack, since: str, opts: DemoOptions, console: Console) -> None:
    with stack.client() as client:
        summary = budget(client, database=stack.database, since=since, slo=opts.goodput_slo())
    console.print(budget_format.to_rich(summary))


def _write_report(stack: Stack, since: str, opts: DemoOptions, load: LoadRun, console: Console) -> None:
    config = {
        "command": "phaselens demo",
        **{f"demo.{k}": v for k, v in asdict(opts).items()},
        "server": f"phaselens serve --model {opts.model} --device {opts.device}",
        "storage": stack.storage.describe(),
        "services": f"{SERVER_SERVICE} (server), {CLIENT_SERVICE} (client)",
        **{f"workload.{k}": v for k, v in load.workload.items()},
        "load wall time": f"{load.wall_s:.1f} s",
        **{
            f"bench.{k}": json.dumps(v)
            for k, v in (
                ("arrival", load.summary.get("config", {}).get("arrival")),
                ("throughput", load.summary.get("summary", {}).get("throughput")),
                ("versions", load.summary.get("config", {}).get("versions")),
            )
        },
    }
    with stack.client() as client:
        data = build_report(
            client,
            database=stack.database,
            since=since,
            slo=opts.goodput_slo(),
            config=config,
            title="phaselens demo report",
        )
    report_page.write(opts.report_path, data)
    console.print(f"[green]✓[/] report written to {Path(opts.report_path).resolve()}")


def _print_howto(stack: Stack, console: Console) -> None:
    """Commands against what runs; on a cluster, any node's views read every shard, so only the
    schema and collector commands need its flags."""
    ch, node = stack.clickhouse_url, urlsplit(stack.clickhouse_url)
    schema_flags = "".join(f" {shlex.quote(flag)}" for flag in stack.storage.schema_flags)
    otel = " ".join(
        f"{k}={v}"
        for k, v in stack.otel_env(CLIENT_SERVICE).items()
        if k.startswith("OTEL_") and k != "OTEL_BSP_SCHEDULE_DELAY"
    )
    sql = (
        "SELECT trace_id, client_ttft_ms, queue_ms, prefill_ms FROM otel.phaselens_requests "
        "ORDER BY client_ttft_ms DESC LIMIT 5 FORMAT PrettyCompact"
    )
    console.print(
        f"""
[bold]Everything stays up until Ctrl-C.[/]
  storage:   {stack.storage.describe()}
  schema:    phaselens schema apply --clickhouse {ch} --database {stack.database}{schema_flags}
  collector: phaselens {shlex.join(stack.collector_argv)}
  budget:    phaselens budget --clickhouse {ch} --since 1h
  diagnose:  phaselens diagnose --clickhouse {ch} --since 1h
  report:    phaselens report --clickhouse {ch} --since 1h --out report.html
  SQL:       curl '{ch}/' --data-binary '{sql}'
  Python:    clickhouse_connect.get_client(host='{node.hostname}', port={node.port})
  more load: env {otel} phaselens bench --url {stack.server_url} --model {stack.served_model()} --rate 2 --requests 50
  OTLP in:   gRPC {stack.otlp_grpc_endpoint}, HTTP http://127.0.0.1:{stack.http_port}/v1/traces""",
        soft_wrap=True,
    )
