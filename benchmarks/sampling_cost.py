"""What tracing costs at 100 %, 10 % and 1 % head sampling, every request still budgeted.

    python benchmarks/sampling_cost.py [--requests 300] [--concurrency 4] [--ratios 1,0.1,0.01]
                                       [--tail-quantile 0.95]

Prints one JSON object. Per ratio: the reference server (`phaselens serve`, tiny model) and `phaselens
bench` (the same seeded workload each time) export with OTEL_TRACES_SAMPLER=parentbased_traceidratio
to phaselens's collector, running in this process, into a database of its own in an embedded
ClickHouse. The tail rule (PHASELENS_TAIL_SLO) is what a healthy server sees, on any machine: the
first ratio's run (keep it 1) sets the threshold for the others, its server TTFT and TPOT at
`--tail-quantile` (so about 1 − q of their requests are tail-kept; `tail_slo` in the output).
Figures per request:

    spans_per_request        = rows of otel_traces / requests sent
    stored_bytes_per_request = otel_traces' compressed bytes on disk (system.parts, after OPTIMIZE
                               FINAL: one part) / requests sent
    builder_cpu_us           = the span-builder process's CPU (utime + stime, read before the server
                               stops) / requests sent
    collector_cpu_us         = this process's CPU over the run (the collector; the loadgen and the
                               server are other processes) / requests sent
    full_trees               = requests with a full tree, by reason (phaselens.trace.full)
    budget                   = `phaselens budget --exact`: requests counted, server and client TTFT
                               p50/p90; `p50_vs_full`, `p90_vs_full`: / the 100 % run's (two runs of the
                               same workload: their timing differs by the machine's noise)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import clickhouse_connect

from phaselens.analysis.budget.latency_budget import budget
from phaselens.analysis.schema import schema as S
from phaselens.analysis.sql import ddl
from phaselens.collectors import schema as collector_schema
from phaselens.collectors.service import Collector
from phaselens.instrumentation import names
from phaselens.storage.embedded import EmbeddedClickHouse

TICKS_PER_S = os.sysconf("SC_CLK_TCK")
UNREACHED = "ttft:3600000,tpot:3600000"  # the first run's tail threshold (ms): none (its trees are all head at 1)


def _env(endpoint: str, service: str, ratio: float, tail: str) -> dict[str, str]:
    return os.environ | {
        names.ENV_TAIL_SLO: tail,
        "OTEL_SERVICE_NAME": service,
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{endpoint}",
        "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        names.ENV_TRACES_SAMPLER: "parentbased_traceidratio",
        names.ENV_TRACES_SAMPLER_ARG: str(ratio),
    }


def _children_cpu_s(pid: int) -> float:
    """CPU seconds (utime + stime) of a process's live children: the server's span builder."""
    total = 0.0
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        fields = Path(f"/proc/{child}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / TICKS_PER_S
    return total


def _run(endpoint: str, ratio: float, tail: str, args: argparse.Namespace) -> float:
    """The workload against a fresh server; returns its span builder's CPU seconds."""
    serve = subprocess.Popen(
        [sys.executable, "-m", "phaselens", "serve", "--port", "0", "--max-num-seqs", str(args.concurrency)],
        stdout=subprocess.PIPE, text=True, env=_env(endpoint, "phaselens-server", ratio, tail),
    )  # fmt: skip
    try:
        url = serve.stdout.readline().split()[-1]
        subprocess.run(
            [sys.executable, "-m", "phaselens", "bench", "--url", url, "--model", "tiny", "--concurrency",
             str(args.concurrency), "--requests", str(args.requests), "--input-len", "16", "--output-len", "8",
             "--ignore-eos", "--seed", "11", "--quiet"],
            check=True, env=_env(endpoint, "phaselens-loadgen", ratio, tail), capture_output=True, timeout=1800,
        )  # fmt: skip
        time.sleep(1.0)  # the builder's last records
        return _children_cpu_s(serve.pid)
    finally:
        serve.send_signal(signal.SIGTERM)
        serve.wait(120)


def _measure(client, clickhouse_url: str, ratio: float, tail: str, args: argparse.Namespace, tmp: str) -> dict:
    database = f"sampling_{str(ratio).replace('.', '_')}"
    client.command(f"DROP DATABASE IF EXISTS {database}")
    collector_schema.apply(client, ddl.all_statements(database))
    collector = Collector(clickhouse_url, database=database, spool_dir=f"{tmp}/{database}").start()
    cpu_start = time.process_time()
    builder_cpu_s = _run(collector.grpc_endpoint, ratio, tail, args)
    collector.stop()
    collector_cpu_s = time.process_time() - cpu_start
    client.command(f"OPTIMIZE TABLE {database}.otel_traces FINAL")
    spans = int(client.command(f"SELECT count() FROM {database}.otel_traces"))
    stored = int(
        client.command(
            f"SELECT sum(data_compressed_bytes) FROM system.parts WHERE database = '{database}' "
            "AND table = 'otel_traces' AND active"
        )
    )
    reasons = client.query(
        f"SELECT SpanAttributes['{names.PL_TRACE_FULL}'] AS full, count() FROM {database}.otel_traces "
        "WHERE SpanKind = 'Server' GROUP BY full"
    ).result_rows
    report = budget(client, database=database, since=None)
    n = args.requests
    return {
        "ratio": ratio,
        "database": database,
        "tail_slo": tail,
        "spans_per_request": spans / n,
        "stored_bytes_per_request": stored / n,
        "builder_cpu_us": builder_cpu_s / n * 1e6,
        "collector_cpu_us": collector_cpu_s / n * 1e6,
        "full_trees": dict(reasons),
        "budget": {
            "requests": report.requests,
            "with_client": report.with_client,
            **{
                f"{name}_{level}": getattr(report.distributions[name], level)
                for name in ("server_ttft_ms", "client_ttft_ms")
                for level in ("p50", "p90")
            },
        },
    }


def _tail_slo(client, database: str, quantile: float) -> str:
    """PHASELENS_TAIL_SLO at the run's server TTFT and TPOT `quantile` (ms)."""
    ttft_ms, tpot_ms = client.query(
        f"SELECT quantileExact({quantile})(server_ttft_ms), quantileExact({quantile})(server_tpot_ms) "
        f"FROM {database}.{S.FACTS_VIEW}"
    ).result_rows[0]
    return f"ttft:{ttft_ms:.3f},tpot:{tpot_ms:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=300)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--ratios", default="1,0.1,0.01")
    parser.add_argument("--tail-quantile", type=float, default=0.95)
    args = parser.parse_args()
    first, *others = [float(r) for r in args.ratios.split(",")]
    with tempfile.TemporaryDirectory() as tmp, EmbeddedClickHouse(f"{tmp}/clickhouse") as clickhouse:
        client = clickhouse_connect.get_client(host=clickhouse.host, port=clickhouse.http_port)
        runs = [_measure(client, clickhouse.url, first, UNREACHED, args, tmp)]
        tail = _tail_slo(client, runs[0]["database"], args.tail_quantile)
        runs += [_measure(client, clickhouse.url, ratio, tail, args, tmp) for ratio in others]
    base = runs[0]["budget"]
    for run in runs:
        for level in ("p50", "p90"):
            key = f"server_ttft_ms_{level}"
            run["budget"][f"server_ttft_{level}_vs_full"] = run["budget"][key] / base[key]
        run["spans_vs_full"] = run["spans_per_request"] / runs[0]["spans_per_request"]
        run["bytes_vs_full"] = run["stored_bytes_per_request"] / runs[0]["stored_bytes_per_request"]
    print(json.dumps({"requests": args.requests, "concurrency": args.concurrency, "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
