"""The vLLM plugin's cost: vLLM's output tokens/s with and without it, in the same run.

One embedded ClickHouse and one collector; then, alternately, a vLLM with only its native tracing
(`--otlp-traces-endpoint`, plugin excluded by VLLM_PLUGINS), a vLLM with the phaselens plugin
(same endpoint) and one with the plugin's span-builder child on its SDK backend
(PHASELENS_SPAN_BACKEND=sdk), each serving the same bounded closed-loop `phaselens bench` (after a
warm-up). Alternating, `--rounds` times, spreads drift (thermal, other work on the machine) over all.
Prints ONE JSON object: each run's output tokens/s and client TTFT p50, the means, and the plugin's
change in % next to the spread between runs of the same configuration (the noise); and, on the
deterministic footing of benchmarks/instrumentation_overhead.py, CPU µs per request over the bench
(its warm-up included; a first short bench, outside the window, starts the plugin's span-builder
child) of vLLM's API server process, of phaselens's span-builder child and of the rest
(EngineCore), from /proc/<pid>/task/*/schedstat (ns; threads alive at the end), and the plugin's
cost in the API server = its CPU per request with the plugin − without.

    python benchmarks/vllm_plugin_overhead.py [--rounds 2] [--requests 64] [--concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from phaselens.integrations.vllm.launcher import VllmServer, default_python
from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.stack import Stack

CONFIGS = {
    "native": {"VLLM_PLUGINS": ""},
    "plugin": {"VLLM_PLUGINS": "phaselens"},  # the span-builder child's fast backend (the default)
    "plugin_sdk": {"VLLM_PLUGINS": "phaselens", "PHASELENS_SPAN_BACKEND": "sdk"},  # its SDK backend
}
WARMUP_REQUESTS = 4


def bench_argv(url: str, model_dir: Path, args: argparse.Namespace) -> list[str]:
    """A bounded `phaselens bench` against `url` with the tiny model's tokenizer, sized by `args`
    (concurrency, requests, input and output lengths); the caller adds what it records."""
    return [
        *(sys.executable, "-m", "phaselens", "bench", "--url", url, "--model", "tiny"),
        *("--tokenizer", str(model_dir), "--concurrency", str(args.concurrency), "--requests", str(args.requests)),
        *("--input-len", str(args.input_len), "--output-len", str(args.output_len)),
        *("--ignore-eos", "--quiet", "--timeout", "120"),
    ]


def _bench(url: str, model_dir: Path, out: Path, args) -> dict:
    argv = [*bench_argv(url, model_dir, args), "--warmup", str(WARMUP_REQUESTS), "--json", str(out)]
    env = {
        "OTEL_TRACES_EXPORTER": "none",
        "OTEL_METRICS_EXPORTER": "none",
        "OTEL_LOGS_EXPORTER": "none",
        "PATH": "/usr/bin:/bin",
    }
    subprocess.run(argv, env=env, check=True, capture_output=True, timeout=600)
    summary = json.loads(out.read_text())["summary"]
    return {
        "output_tokens_per_s": summary["throughput"]["output_tokens_per_s"],
        "client_ttft_p50_ms": summary["latency_ms"]["ttft"]["percentiles"]["p50"],
        "failed": summary["requests"]["failed"],
    }


def _cpu_ns(pid: int) -> int:
    """CPU ns of `pid`'s live threads (schedstat's first field); 0 when it is gone."""
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
        return sum(int((task / "schedstat").read_text().split()[0]) for task in tasks)
    except OSError:  # gone
        return 0


def _tree_cpu_ns(root: int) -> dict[str, int]:
    """CPU ns of vLLM's process tree: the API server (`root`), the span-builder child, the rest."""
    parents = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            parents[int(entry)] = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (ValueError, OSError, IndexError):  # gone meanwhile
            continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in tree} - tree
        tree, grew = tree | more, bool(more)
    cpu = {"api_server": _cpu_ns(root), "span_builder": 0, "engine": 0}
    for pid in tree - {root}:
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone
            continue
        cpu["span_builder" if b"builder_child" in command else "engine"] += _cpu_ns(pid)
    return cpu


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    args = p.parse_args()
    python = default_python()
    if python is None:
        sys.exit("no vLLM virtualenv: ./setup.sh --vllm (or PHASELENS_VLLM_PYTHON)")
    runs: list[dict] = []
    warm_up = argparse.Namespace(**{**vars(args), "requests": 8})
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = save_tiny_llama(tmp_path / "model")
        stack = Stack(str(tmp_path / "stack")).start_pipeline()  # ClickHouse + schema + collector, no server
        try:
            for round_index in range(args.rounds):
                for name, env in CONFIGS.items():
                    log = tmp_path / f"vllm-{name}-{round_index}.log"
                    with VllmServer(
                        python,
                        model_dir,
                        log,
                        otlp_endpoint=stack.otlp_grpc_endpoint,
                        env={"OTEL_SERVICE_NAME": f"vllm-{name}", "OTEL_METRICS_EXPORTER": "none", **env},
                    ) as server:
                        # a first bench starts the plugin's span-builder child (imports: ~0.5 s of CPU), outside the window
                        _bench(server.url, model_dir, tmp_path / f"warm-{name}-{round_index}.json", warm_up)
                        before = _tree_cpu_ns(server.proc.pid)
                        figures = _bench(server.url, model_dir, tmp_path / f"{name}-{round_index}.json", args)
                        after = _tree_cpu_ns(server.proc.pid)
                    served = args.requests + WARMUP_REQUESTS
                    cpu = {f"{k}_cpu_us_per_request": (after[k] - before[k]) / served / 1000 for k in after}
                    runs.append({"config": name, "round": round_index, **figures, **cpu})
        finally:
            stack.stop()
    print(json.dumps(_result(runs, args), indent=2))


def _result(runs: list[dict], args) -> dict:
    by = {name: [r["output_tokens_per_s"] for r in runs if r["config"] == name] for name in CONFIGS}
    means = {name: statistics.fmean(values) for name, values in by.items()}
    medians = {name: statistics.median(values) for name, values in by.items()}
    noise = max((max(v) - min(v)) / statistics.fmean(v) * 100 for v in by.values()) if args.rounds > 1 else None
    return {
        "benchmark": "vllm_plugin_overhead",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "input_tokens": args.input_len,
        "output_tokens": args.output_len,
        "runs": runs,
        "output_tokens_per_s_mean": means,
        "output_tokens_per_s_median": medians,
        "plugin_change_pct": (means["plugin"] - means["native"]) / means["native"] * 100,
        "plugin_change_pct_of_medians": (medians["plugin"] - medians["native"]) / medians["native"] * 100,
        "same_config_spread_pct": noise,
        "cpu_us_per_request_median": _cpu_medians(runs),
    }


def _cpu_medians(runs: list[dict]) -> dict:
    """Per config, the median over rounds of each process's CPU µs per request; and the plugin's
    own cost in the API server (with − without) and in its span-builder child."""
    keys = [k for k in runs[0] if k.endswith("_cpu_us_per_request")]
    medians = {
        name: {k: statistics.median(r[k] for r in runs if r["config"] == name) for k in keys} for name in CONFIGS
    }
    native = medians["native"]["api_server_cpu_us_per_request"]
    return {
        **medians,
        **{
            f"{name}_api_server_cpu_us_per_request": medians[name]["api_server_cpu_us_per_request"] - native
            for name in CONFIGS
            if name != "native"
        },
        **{
            f"{name}_span_builder_cpu_us_per_request": medians[name]["span_builder_cpu_us_per_request"]
            for name in CONFIGS
            if name != "native"
        },
    }


if __name__ == "__main__":
    main()
