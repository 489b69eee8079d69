"""vLLM's residual with and without the delivery middleware, in the same run (docs/vllm.md).

One embedded ClickHouse and one collector; then, alternately, a vLLM with the phaselens plugin only
(the first chunk's delivery unobserved: in the residual) and one that also has the delivery
middleware (`--middleware phaselens.integrations.vllm.middleware.FirstChunkMiddleware`), each
serving the same bounded `phaselens bench` (client spans to the collector). Prints ONE JSON object:
per run, the residual's p50/p90/max (and its p90 over the requests whose first-chunk read the
client did not find coalesced with later packets, and its p50/p90 with the estimate
`client_late_est_ms` left in it, as before that term) and the bound max(5 ms, 5 % of client TTFT p90), the first
chunk's and held-back's p50/p90 (None where unobserved), and the API server's CPU µs per request
(/proc/<pid>/task/*/schedstat), so the middleware's cost is with − without.

    python benchmarks/vllm_residual.py [--rounds 1] [--requests 32] [--concurrency 2]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.vllm_plugin_overhead import _cpu_ns, bench_argv
from phaselens.common.quantile import quantile
from phaselens.integrations.vllm.delivery import MIDDLEWARE_PATH
from phaselens.integrations.vllm.launcher import VllmServer, default_python
from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.stack import Stack

CONFIGS: dict[str, tuple[str, ...]] = {"plugin": (), "plugin_delivery": (MIDDLEWARE_PATH,)}
COLUMNS = (
    "residual_ms",
    "client_ttft_ms",
    "server_ttfc_ms",
    "ingress_ms",
    "first_chunk_ms",
    "held_back_ms",
    "loop_wait_ms",
    "encode_ms",
    "write_ms",
    "inbound_ms",
    "kernel_wait_ms",
    "dispatch_ms",
    "client_ms",
    "client_send_ms",
    "client_read_ms",
    "client_late_est_ms",
)


def _bench(stack: Stack, url: str, model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, bool]:
    """One bounded bench; its requests' trace ids → whether the client's first-chunk read was
    coalesced (TCP stamped it with a later packet: `client_read` understated)."""
    argv = [*bench_argv(url, model_dir, args), "--per-request", str(out)]
    subprocess.run(argv, env=stack.otel_env("bench"), check=True, capture_output=True, timeout=600)
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    return {line["trace_id"]: bool(line.get("client_read_coalesced")) for line in lines}


def _rows(stack: Stack, trace_ids: list[str], timeout_s: float = 60.0) -> list[dict]:
    sql = (
        f"SELECT trace_id, {', '.join(COLUMNS)} FROM {stack.database}.phaselens_request_facts "
        "WHERE trace_id IN {ids:Array(String)} AND has_client AND has_server"
    )
    deadline = time.monotonic() + timeout_s
    with stack.client() as client:
        while True:
            rows = list(client.query(sql, parameters={"ids": trace_ids}).named_results())
            if len(rows) == len(trace_ids) or time.monotonic() > deadline:
                return rows
            time.sleep(0.5)


def _figures(rows: list[dict], coalesced: dict[str, bool]) -> dict:
    exact = sorted(r["residual_ms"] for r in rows if not coalesced.get(r["trace_id"]))
    out: dict = {
        "rows": len(rows),
        "coalesced_reads": sum(coalesced.get(r["trace_id"], False) for r in rows),
        "residual_ms_p90_exact_reads": quantile(exact, 0.9),
    }
    # before the estimate named a late client's hidden wait, the residual held it
    before = sorted(r["residual_ms"] + (r["client_late_est_ms"] or 0.0) for r in rows)
    out["residual_ms_before_estimate"] = {"p50": quantile(before, 0.5), "p90": quantile(before, 0.9)}
    for column in COLUMNS:
        values = sorted(r[column] for r in rows if r[column] is not None)
        out[column] = {
            "observed": len(values),
            "p50": quantile(values, 0.5),
            "p90": quantile(values, 0.9),
            "max": values[-1] if values else None,
        }
    ttft_p90 = out["client_ttft_ms"]["p90"]
    out["residual_bound_ms"] = max(5.0, 0.05 * ttft_p90) if ttft_p90 is not None else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=2)
    p.add_argument("--input-len", type=int, default=40)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--configs", default=",".join(CONFIGS), help="which of %(default)s to run")
    p.add_argument("--rows", action="store_true", help="also print each run's rows")
    args = p.parse_args()
    configs = {name: CONFIGS[name] for name in args.configs.split(",")}
    python = default_python()
    if python is None:
        sys.exit("no vLLM virtualenv: ./setup.sh --vllm (or PHASELENS_VLLM_PYTHON)")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = save_tiny_llama(tmp_path / "model")
        stack = Stack(str(tmp_path / "stack")).start_pipeline()
        try:
            for round_index in range(args.rounds):
                for name, middleware in configs.items():
                    env = {k: v for k, v in stack.otel_env(f"vllm-{name}").items() if k.startswith("OTEL_")}
                    server = VllmServer(
                        python,
                        model_dir,
                        tmp_path / f"vllm-{name}-{round_index}.log",
                        otlp_endpoint=stack.otlp_grpc_endpoint,
                        env={**env, "VLLM_PLUGINS": "phaselens", "OTEL_METRICS_EXPORTER": "none"},
                        middleware=middleware,
                    )
                    with server:
                        _bench(stack, server.url, model_dir, tmp_path / f"warm-{name}-{round_index}.jsonl", args)
                        before = _cpu_ns(server.proc.pid)
                        ids = _bench(stack, server.url, model_dir, tmp_path / f"{name}-{round_index}.jsonl", args)
                        cpu_us = (_cpu_ns(server.proc.pid) - before) / len(ids) / 1000
                    rows = _rows(stack, list(ids))
                    run = {"config": name, "round": round_index, "api_server_cpu_us_per_request": cpu_us}
                    runs.append({**run, **_figures(rows, ids), **({"each": rows} if args.rows else {})})
        finally:
            stack.stop()
    print(json.dumps({"benchmark": "vllm_residual", **vars(args), "runs": runs}, indent=2))


if __name__ == "__main__":
    main()
