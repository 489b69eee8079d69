"""The vLLM plugin's cost, in CPU per request of the processes and threads it runs in, next to vLLM's own tracing.

One embedded ClickHouse and one collector (OTLP/gRPC and OTLP/HTTP); then, alternately, `--rounds`
times, one vLLM per configuration, each serving the same bounded closed-loop `phaselens bench`
(after a warm-up bench, which also starts the plugin's span-builder child outside the window):

    off           no tracing (no --otlp-traces-endpoint, plugin excluded by VLLM_PLUGINS)
    vllm_tracing  vLLM's own spans (--otlp-traces-endpoint alone, over gRPC, vLLM's default)
    plugin        the phaselens plugin and its FirstChunkMiddleware, spans over OTLP/HTTP
    plugin_grpc   the same over OTLP/gRPC (grpcio), as vLLM's default endpoint makes it
    plugin_sdk    (with --configs) the plugin's span-builder child on its SDK backend

Over each bench, CPU ns from /proc/<pid>/task/<tid>/schedstat (the scheduler's per-thread clock)
of: the API server's event-loop thread (`api_main`), phaselens's own threads in it (OS names
`pl-*`, `common/threads.py`), the whole API server, the span-builder child, and the rest (EngineCore);
per request = delta / requests served. On a shared machine a process's CPU moves with the load (cache
and frequency), so every figure is a median over rounds with its [min, max], the API server's delta is
also taken per window against the `off` window of the same round and index, and the load average is printed.
The plugin's added CPU per request = its API server − off's (median of the rounds' deltas) + its child;
vLLM's own tracing's = its API server − off's. The same for the EngineCore, whose busy loop on a CPU build
(~300 ms a request) hides any difference. Also: output tokens/s per configuration (the noise: spread
between runs of one configuration), and the SERVER spans each configuration stored (0 would mean its
export failed). The event-loop thread runs vLLM and the plugin's hooks and middleware alike, so its
delta is noise-sized; `--profile-api PY_SPY` samples the API server with py-spy (250 Hz, not stopping
it) in every configuration's windows (the sampler's own CPU then weighs on all alike: sampling the
traced ones alone halved their tokens/s against `off`'s on 2 cores) and takes phaselens's and OpenTelemetry's shares of the
event-loop thread's samples (the innermost frame of phaselens's source or of an installed package owns
a sample) × its CPU: figures of one run, no subtraction; with the API server's other threads against
`off`'s (~0.3 ms a request there) and the child, `own_total`, for the plugin and vLLM's tracing alike.
Also the EngineCore output batches per request (vLLM's Prometheus `vllm:iteration_tokens_total`
count: one ZMQ message each, what vLLM's `ZMQbg/IO` thread's CPU follows; `vllm_hooks_cost.py`
measures that thread per message). vLLM's batch span processor runs on the SDK's default schedule (5 s), as users run it. Each run's line is appended to `--runs-out` as it ends; ONE JSON object at the end.

    python benchmarks/vllm_plugin_overhead.py [--rounds 3] [--windows 1] [--requests 64] [--profile-api PY_SPY]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import urllib.request
from pathlib import Path
from subprocess import DEVNULL

from phaselens.common.threads import THREAD_PREFIX
from phaselens.integrations.vllm.delivery import MIDDLEWARE_PATH
from phaselens.integrations.vllm.launcher import PROTOCOL_GRPC, VllmServer, default_python, trace_export
from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.stack import Stack

PLUGIN = {"VLLM_PLUGINS": "phaselens"}
# name → (environment, traced, plugin, protocol or None for trace_export's choice)
CONFIGS = {
    "off": ({"VLLM_PLUGINS": ""}, False, False, None),
    "vllm_tracing": ({"VLLM_PLUGINS": ""}, True, False, None),
    "plugin": (PLUGIN, True, True, None),
    "plugin_grpc": (PLUGIN, True, True, PROTOCOL_GRPC),
    "plugin_sdk": ({**PLUGIN, "PHASELENS_SPAN_BACKEND": "sdk"}, True, True, None),
}
DEFAULT_CONFIGS = "off,vllm_tracing,plugin,plugin_grpc"
WARMUP_REQUESTS = 4
READY_TIMEOUT_S = 900.0  # a vLLM start on 2 loaded cores took over 240 s
ROOT = str(Path(__file__).resolve().parent.parent) + "/"  # phaselens's source (an editable install)
PARTS = ("api_server", "api_main", "api_threads", "api_phaselens", "span_builder", "engine")
OWNERS = ("phaselens", "opentelemetry", "other")
SAMPLE_HZ = 250
BATCHES_METRIC = "vllm:iteration_tokens_total_count"
# vLLM's batch span processor's schedule: the SDK's default, as users run it (the launcher's 100 ms
# is for tests that wait for vLLM's spans; in the plugin's configuration that idle processor woke
# 10 times a second in the API server)
BSP_DELAY_MS = 5000


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


def _threads_cpu_ns(pid: int) -> dict[int, tuple[str, int]]:
    """tid → (OS name, CPU ns: schedstat's first field) of `pid`'s live threads; {} when it is gone."""
    threads = {}
    try:
        tasks = list(Path(f"/proc/{pid}/task").iterdir())
    except OSError:  # gone
        return {}
    for task in tasks:
        try:
            threads[int(task.name)] = (
                (task / "comm").read_text().strip(),
                int((task / "schedstat").read_text().split()[0]),
            )
        except OSError:  # the thread ended meanwhile
            continue
    return threads


def _descendants(root: int) -> set[int]:
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
    return tree - {root}


def _tree_cpu_ns(root: int) -> dict:
    """CPU ns of vLLM's process tree by PARTS: the API server (`root`) whole, its event-loop thread,
    its other threads, phaselens's threads among them; the span-builder child; the rest (EngineCore
    and its workers); and `api_thread_names`: the API server's other threads' CPU ns by OS name."""
    api = _threads_cpu_ns(root)
    cpu = dict.fromkeys(PARTS, 0)
    names = cpu["api_thread_names"] = {}
    for tid, (name, ns) in api.items():
        if tid != root:
            names[name] = names.get(name, 0) + ns
    cpu["api_server"] = sum(ns for _, ns in api.values())
    cpu["api_main"] = api.get(root, ("", 0))[1]
    cpu["api_threads"] = cpu["api_server"] - cpu["api_main"]
    cpu["api_phaselens"] = sum(ns for name, ns in api.values() if name.startswith(THREAD_PREFIX))
    for pid in _descendants(root):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:  # gone
            continue
        part = "span_builder" if b"builder_child" in command else "engine"
        cpu[part] += sum(ns for _, ns in _threads_cpu_ns(pid).values())
    return cpu


def _output_batches(url: str) -> float:
    """The EngineCore output batches vLLM's API server has processed (its Prometheus histogram
    `vllm:iteration_tokens_total`, observed once per batch: one ZMQ message from the EngineCore)."""
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(BATCHES_METRIC))


def _owner(frames: list[str]) -> str:
    """Whose code a sample's time is: the innermost frame in phaselens's source or in an installed
    package decides (the standard library's frames count for their caller): "phaselens",
    "opentelemetry" (the OTel SDK and exporters: vLLM's own tracing) or "other"."""
    for frame in reversed(frames):
        path = frame[frame.rfind("(") + 1 : frame.rfind(":")]
        if path.startswith(ROOT) and "/.venv" not in path:
            return "phaselens"
        if "site-packages/opentelemetry/" in path:
            return "opentelemetry"
        if "site-packages" in path:
            return "other"
    return "other"


def _shares(raw: Path) -> dict[str, float]:
    """Each owner's share of the event-loop thread's samples (py-spy's raw format: `frame;frame...
    count`; other threads start in threading's `Thread._bootstrap`); {} without samples."""
    counts = dict.fromkeys(OWNERS, 0)
    for line in raw.read_text().splitlines() if raw.exists() else ():
        stack, _, count = line.rpartition(" ")
        frames = stack.split(";")
        if frames[0].split(" (")[0].endswith("_bootstrap"):  # `Thread._bootstrap`: another thread
            continue
        counts[_owner(frames)] += int(count)
    main = sum(counts.values())
    return {owner: counts[owner] / main for owner in OWNERS if owner != "other"} if main else {}


def _sampler(py_spy: str | None, pid: int, out: Path) -> subprocess.Popen | None:
    """py-spy sampling `pid` SAMPLE_HZ times a second without stopping it, until SIGINT."""
    if py_spy is None:
        return None
    argv = [py_spy, "record", "--pid", str(pid), "--rate", str(SAMPLE_HZ), "--format", "raw", "--nonblocking"]
    return subprocess.Popen([*argv, "--full-filenames", "-o", str(out)], stdout=DEVNULL, stderr=DEVNULL)


def _stop_sampler(sampler: subprocess.Popen | None, out: Path) -> dict[str, float]:
    if sampler is None:
        return {}
    sampler.send_signal(signal.SIGINT)  # py-spy writes its file and exits
    sampler.wait(60)
    return _shares(out)


def _server(name: str, python: Path, model_dir: Path, log: Path, stack: Stack) -> VllmServer:
    env, traced, plugin, protocol = CONFIGS[name]
    endpoint, chosen = trace_export(stack.otlp_grpc_endpoint, stack.otlp_http_traces_endpoint, plugin)
    if protocol == PROTOCOL_GRPC:
        endpoint, chosen = stack.otlp_grpc_endpoint, protocol
    return VllmServer(
        python,
        model_dir,
        log,
        otlp_endpoint=endpoint if traced else None,
        otlp_protocol=chosen,
        env={"OTEL_SERVICE_NAME": f"vllm-{name}", "OTEL_METRICS_EXPORTER": "none", **env},
        middleware=(MIDDLEWARE_PATH,) if plugin else (),
        bsp_delay_ms=BSP_DELAY_MS,
    )


def _run(name: str, round_index: int, python: Path, model_dir: Path, tmp: Path, stack: Stack, args) -> list[dict]:
    """One vLLM of configuration `name`: a warm-up bench, then `args.windows` measured benches."""
    warm_up = argparse.Namespace(**{**vars(args), "requests": 8})
    served, runs = args.requests + WARMUP_REQUESTS, []
    server = _server(name, python, model_dir, tmp / f"vllm-{name}-{round_index}.log", stack)
    server.start(READY_TIMEOUT_S)
    try:
        _bench(server.url, model_dir, tmp / f"warm-{name}-{round_index}.json", warm_up)
        for window in range(args.windows):
            samples = tmp / f"{name}-{round_index}-{window}.raw"
            sampler = _sampler(args.profile_api, server.proc.pid, samples)
            before, batches = _tree_cpu_ns(server.proc.pid), _output_batches(server.url)
            figures = _bench(server.url, model_dir, tmp / f"{name}-{round_index}-{window}.json", args)
            after = _tree_cpu_ns(server.proc.pid)
            cpu = {f"{k}_cpu_us_per_request": (after[k] - before[k]) / served / 1000 for k in PARTS}
            # the ZMQ I/O thread's work goes with these (one message each), not with the plugin's bytes
            cpu["output_batches_per_request"] = (_output_batches(server.url) - batches) / served
            cpu["api_thread_names_cpu_us_per_request"] = {
                thread: (ns - before["api_thread_names"].get(thread, 0)) / served / 1000
                for thread, ns in after["api_thread_names"].items()
            }
            for owner, share in _stop_sampler(sampler, samples).items():
                cpu[f"api_main_{owner}_share"] = share
                cpu[f"api_main_{owner}_cpu_us_per_request"] = share * cpu["api_main_cpu_us_per_request"]
            load = os.getloadavg()[0]
            runs.append(
                {"config": name, "round": round_index, "window": window, "load_average_1m": load, **figures, **cpu}
            )
    finally:
        server.stop()
    return runs


def _server_spans(stack: Stack) -> dict[str, int]:
    """SERVER spans stored per service (vllm-<config>), after the collector's last flush."""
    with stack.client() as client:
        rows = client.query(
            "SELECT ServiceName, count() FROM otel.otel_traces WHERE SpanKind IN ('Server', 'SPAN_KIND_SERVER') GROUP BY ServiceName"
        ).result_rows
    return dict(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--windows", type=int, default=1, help="measured benches per vLLM start (a start is minutes)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--configs", default=DEFAULT_CONFIGS, help=f"comma list of {', '.join(CONFIGS)}")
    p.add_argument(
        "--profile-api", metavar="PY_SPY", help="py-spy: sample the plugin's API servers (phaselens's share)"
    )
    p.add_argument("--runs-out", type=Path, help="append each run's JSON line here as it ends")
    args = p.parse_args()
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = sorted(set(configs) - set(CONFIGS))
    if unknown:
        sys.exit(f"--configs: unknown {unknown}")
    python = default_python()
    if python is None:
        sys.exit("no vLLM virtualenv: ./setup.sh --vllm (or PHASELENS_VLLM_PYTHON)")
    runs: list[dict] = []
    load_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = save_tiny_llama(tmp_path / "model")
        stack = Stack(str(tmp_path / "stack")).start_pipeline()  # ClickHouse + schema + collector, no server
        try:
            for round_index in range(args.rounds):
                for name in configs:
                    done = _run(name, round_index, python, model_dir, tmp_path, stack, args)
                    runs += done
                    if args.runs_out:
                        with args.runs_out.open("a") as out:
                            out.writelines(json.dumps(run) + "\n" for run in done)
            stored = _server_spans(stack)
        finally:
            stack.stop()
    print(json.dumps(_result(runs, configs, args, load_start, stored), indent=2))


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def _result(runs: list[dict], configs: list[str], args, load_start: float, stored: dict[str, int]) -> dict:
    of = {name: [r for r in runs if r["config"] == name] for name in configs}
    tokens = {name: [r["output_tokens_per_s"] for r in of[name]] for name in configs}
    medians = {name: statistics.median(values) for name, values in tokens.items()}
    noise = max((max(v) - min(v)) / statistics.fmean(v) * 100 for v in tokens.values()) if args.rounds > 1 else None
    return {
        "benchmark": "vllm_plugin_overhead",
        "requests": args.requests,
        "concurrency": args.concurrency,
        "input_tokens": args.input_len,
        "output_tokens": args.output_len,
        "load_average_1m": {"start": load_start, "runs": _spread([r["load_average_1m"] for r in runs])},
        "runs": runs,
        "output_tokens_per_s_median": medians,
        "change_pct_of_medians_vs_off": {n: (medians[n] - medians["off"]) / medians["off"] * 100 for n in configs}
        if "off" in configs
        else None,
        "same_config_spread_pct": noise,
        "cpu_us_per_request": {
            name: {part: _spread([r[f"{part}_cpu_us_per_request"] for r in of[name]]) for part in PARTS}
            for name in configs
        },
        **{
            f"{name}_span_builder_cpu_us_per_request": statistics.median(
                r["span_builder_cpu_us_per_request"] for r in of[name]
            )
            for name in configs
            if CONFIGS[name][2]
        },
        "added_cpu_us_per_request": {name: _added(of[name], of["off"]) for name in configs if name != "off"}
        if "off" in configs
        else None,
        "output_batches_per_request": {
            name: _spread([r["output_batches_per_request"] for r in of[name]]) for name in configs
        },
        "server_spans_stored": {name: stored.get(f"vllm-{name}", 0) for name in configs},
    }


def _added(runs: list[dict], off: list[dict]) -> dict:
    """What a configuration adds to `off`, per request: the API server's and the EngineCore's delta per
    round (against the same round's `off`), the child, and their sum (API delta + child, medians) as a
    % of off's API-server CPU per request (a figure of the API server: the EngineCore's is not added).
    With `--profile-api`, also `own_total`: tracing's share of the event-loop thread's samples
    (phaselens's and OTel's frames) × that thread's CPU, + the API server's other threads (phaselens's
    `pl-*`, vLLM's span processor and exporter, vLLM's own: ~0.3 ms a request without tracing) less
    off's (a difference, of a small part; 0 if negative) + the child (medians); and that as a % of
    off's API-server CPU."""

    def deltas(part: str) -> list[float]:
        key = f"{part}_cpu_us_per_request"
        return [r[key] - o[key] for r, o in zip(runs, off, strict=False)]

    api, child = _spread(deltas("api_server")), _spread([r["span_builder_cpu_us_per_request"] for r in runs])
    off_api = statistics.median(o["api_server_cpu_us_per_request"] for o in off)
    total = api["median"] + child["median"]
    sampled = [r for r in runs if "api_main_phaselens_share" in r]
    own = {}
    if sampled:
        main = [
            r["api_main_phaselens_cpu_us_per_request"] + r["api_main_opentelemetry_cpu_us_per_request"] for r in sampled
        ]
        threads = _spread(deltas("api_threads"))
        own_total = statistics.median(main) + max(0.0, threads["median"]) + child["median"]
        own = {
            "api_main_phaselens_sampled": _spread([r["api_main_phaselens_cpu_us_per_request"] for r in sampled]),
            "api_main_opentelemetry_sampled": _spread(
                [r["api_main_opentelemetry_cpu_us_per_request"] for r in sampled]
            ),
            "api_threads_delta": threads,
            "own_total": own_total,
            "own_total_pct_of_off_api_server": own_total / off_api * 100,
        }
    return {
        **own,
        "api_server_delta": api,
        "api_main_delta": _spread(deltas("api_main")),
        "api_phaselens_threads": _spread([r["api_phaselens_cpu_us_per_request"] for r in runs]),
        "span_builder": child,
        "engine_delta": _spread(deltas("engine")),
        "total": total,
        "total_pct_of_off_api_server": total / off_api * 100,
    }


if __name__ == "__main__":
    main()
