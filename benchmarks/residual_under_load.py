"""What no stamp explains, under load: the residual at 1, 4, 8 and 16 concurrent streams, with the
edge terms that took it over. Prints ONE JSON object.

For each concurrency: a fresh stack (embedded ClickHouse, collector, `phaselens serve` with the tiny
model), `phaselens bench --concurrency C --input-len uniform:32:256 --output-len 24 --ignore-eos`
(the issue's load), then p50/p90/max of each term over every request (the first burst included).
The same-run baseline is the residual as it was computed before the edge terms, from the same rows:
`residual_without_edges_ms = client_ttft − server_ttfc = residual + inbound + client + client_late_est`,
and the residual as it was before the estimate of a late client's hidden wait,
`residual_without_late_est_ms = residual + client_late_est`. Goal: residual
p90 ≤ max(5 ms, 5 % of client TTFT p90) at every concurrency.

    .venv/bin/python benchmarks/residual_under_load.py [--concurrency 1,4,8,16] [--requests 48]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

from phaselens.common.quantile import quantile
from phaselens.stack import Stack

TERMS = (
    "client_ttft_ms",
    "server_ttfc_ms",
    "inbound_ms",
    "kernel_wait_ms",
    "dispatch_ms",
    "first_chunk_ms",
    "loop_wait_ms",
    "client_ms",
    "client_send_ms",
    "client_read_ms",
    "client_late_est_ms",
    "residual_ms",
)


def load_argv(concurrency: int, requests: int) -> list[str]:
    """This benchmark's load as `Stack.bench` arguments (benchmarks/engine_process.py runs it too)."""
    return [
        *("--model", "tiny", "--concurrency", str(concurrency), "--requests", str(requests)),
        *("--input-len", "uniform:32:256", "--output-len", "24", "--ignore-eos", "--quiet"),
    ]


def run(concurrency: int, requests: int) -> dict:
    with tempfile.TemporaryDirectory() as data, Stack(data, server_args=("--max-num-seqs", "16")) as stack:
        if stack.bench(load_argv(concurrency, requests), timeout_s=600) != 0:
            raise SystemExit(f"bench failed at concurrency {concurrency}")
        stack.server.stop(30)
        stack.collector.stop(30)
        with stack.client() as ch:
            rows = list(
                ch.query(
                    f"SELECT {', '.join(TERMS)} FROM {stack.database}.phaselens_request_facts "
                    "WHERE client_ttft_ms IS NOT NULL"
                ).named_results()
            )
    figures = {term: _stats([r[term] for r in rows]) for term in TERMS}
    figures["residual_without_edges_ms"] = _stats(
        [
            r["residual_ms"] + (r["inbound_ms"] or 0) + (r["client_ms"] or 0) + (r["client_late_est_ms"] or 0)
            for r in rows
        ]
    )
    figures["residual_without_late_est_ms"] = _stats([r["residual_ms"] + (r["client_late_est_ms"] or 0) for r in rows])
    bound = max(5.0, 0.05 * figures["client_ttft_ms"]["p90"])
    figures["goal_residual_p90_ms"] = round(bound, 2)
    figures["goal_met"] = figures["residual_ms"]["p90"] <= bound
    figures["requests"] = len(rows)
    return figures


def _stats(values: list) -> dict:
    ordered = sorted(v for v in values if v is not None)
    if not ordered:
        return {"n": 0}
    return {
        "n": len(ordered),
        "p50": round(quantile(ordered, 0.5), 2),
        "p90": round(quantile(ordered, 0.9), 2),
        "max": round(ordered[-1], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", default="1,4,8,16")
    parser.add_argument("--requests", type=int, default=48)
    args = parser.parse_args()
    start, cpu = time.monotonic(), os.times()
    result = {str(c): run(c, args.requests) for c in map(int, args.concurrency.split(","))}
    end_cpu = os.times()
    result["wall_s"] = round(time.monotonic() - start, 1)
    result["orchestrator_cpu_s"] = round(end_cpu.user + end_cpu.system - cpu.user - cpu.system, 1)
    result["note"] = "wall-clock figures; on a shared 2-core machine they are disturbed by other load"
    print(json.dumps(result))


if __name__ == "__main__":
    main()
