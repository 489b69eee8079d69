"""Serving throughput: the reference engine vs Hugging Face `generate()` with static batches.

CPU mode (default): the same mixed-length workload (prompt and output lengths drawn from one
seeded RNG; greedy; EOS ignored so both sides produce exactly the requested tokens) runs through

- the engine: all requests submitted at once, continuous batching (`max_num_seqs`), one token
  stamp per output token;
- the baseline: `generate()` on static batches of the same size in arrival order, left-padded;
  a batch runs until its longest request is done (the waste static batching pays); per-step
  stamps come from a StoppingCriteria called after every step.

    output tokens/s = Σ requested output tokens / wall time of the run
    TPOT per request = (t_last_token − t_first_token) / (n − 1),   reported p50 / p99

The two sides alternate `--repeats` times and each reports its fastest run, so a burst of load
from other processes does not land on one side only; tokens per CPU-second are given as well.
`--engine process` (or `both`) runs the engine side in its own process (`phaselens serve --engine
process`): the jobs go over its socket from an asyncio loop, a token is stamped as that loop reads
it, and CPU time is this process's plus the engine process's over the run.

CUDA mode (`--device cuda`, needs a GPU; not run where none is present): a ~1.1B-parameter
random-initialised Llama (TinyLlama shape: hidden 2048, 22 layers, 32 heads, 4 KV heads) in
bf16; decode step time at batch 1 and 64 against the HBM roofline

    roofline_s = (weight bytes + KV bytes read) / 4.8e12 B/s
    KV bytes   = B · ctx · layers · 2 (K and V) · kv_heads · head_dim · 2 (bf16)
    ctx        = the mean context over the measured decode steps (prompt + steps / 2)

Prints one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from typing import Self

import torch

from phaselens.common.quantile import quantile

HBM_BYTES_PER_S = 4.8e12


def workload(n: int, seed: int, max_prompt: int, max_output: int, shape: str) -> list[tuple[list[int], int]]:
    """(prompt ids, output tokens) pairs of printable bytes. `uniform`: lengths uniform in [8, max];
    `longtail`: log-normal lengths (σ = 1, median max/6, clipped to [4, max]), the shape of chat
    traces such as ShareGPT, where a few long answers dominate a static batch."""
    rng = random.Random(seed)

    def length(top: int) -> int:
        if shape == "uniform":
            return rng.randint(8, top)
        return min(top, max(4, round(rng.lognormvariate(0.0, 1.0) * top / 6)))

    return [([rng.randint(35, 129) for _ in range(length(max_prompt))], length(max_output)) for _ in range(n)]


def summary(jobs, stamps: list[list[int]], wall_s: float, cpu_s: float) -> dict:
    tokens = sum(n for _, n in jobs)
    tpots = [(s[-1] - s[0]) / (len(s) - 1) / 1e6 for s in stamps if len(s) > 1]
    return {
        "output_tokens": tokens,
        "wall_s": round(wall_s, 3),
        "output_tokens_per_s": round(tokens / wall_s, 1),
        "output_tokens_per_cpu_s": round(tokens / cpu_s, 1),
        "tpot_p50_ms": round(quantile(sorted(tpots), 0.50), 3),
        "tpot_p99_ms": round(quantile(sorted(tpots), 0.99), 3),
    }


class Clock:
    """Wall and process CPU time of one run."""

    def __enter__(self) -> Self:
        self.wall, self.cpu = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc) -> None:
        self.wall, self.cpu = time.perf_counter() - self.wall, time.process_time() - self.cpu


def run_engine(jobs, batch: int, budget: int) -> dict:
    from phaselens.reference_server import Engine, EngineConfig, SamplingParams

    engine = Engine(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=budget, kv_cache_tokens=1 << 16))
    stamps: list[list[int]] = [[] for _ in jobs]
    for i, (prompt, n) in enumerate(jobs):
        engine.submit(
            prompt,
            SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True),
            sink=lambda out, s=stamps[i]: s.append(time.monotonic_ns()),
        )
    with Clock() as clock:
        while engine.scheduler.has_work() or engine.num_waiting:
            engine.step()
    return {**summary(jobs, stamps, clock.wall, clock.cpu), "steps": engine.stats.steps}


def run_engine_process(jobs, batch: int, budget: int) -> dict:
    from phaselens.reference_server import EngineConfig
    from phaselens.reference_server.process.engine_client import EngineClient

    client = EngineClient(EngineConfig(max_num_seqs=batch, max_num_batched_tokens=budget, kv_cache_tokens=1 << 16))
    try:
        return asyncio.run(_drive(client, jobs))
    finally:
        client.stop()


async def _drive(client, jobs) -> dict:
    from phaselens.instrumentation.hotpath.observer import NULL_REQUEST
    from phaselens.reference_server import SamplingParams

    client.attach()
    stamps: list[list[int]] = [[] for _ in jobs]
    finished = asyncio.Semaphore(0)

    def sink(out, times: list[int]) -> None:
        times.append(time.monotonic_ns())
        if out.finish_reason:
            finished.release()

    engine_cpu = _process_cpu_s(client.pid)
    with Clock() as clock:
        for i, (prompt, n) in enumerate(jobs):
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            client.submit(prompt, params, NULL_REQUEST, lambda out, s=stamps[i]: sink(out, s))
        for _ in jobs:
            await finished.acquire()
    engine_cpu = _process_cpu_s(client.pid) - engine_cpu
    return {**summary(jobs, stamps, clock.wall, clock.cpu + engine_cpu), "engine_process_cpu_s": round(engine_cpu, 3)}


def _process_cpu_s(pid: int) -> float:
    """utime + stime of a live process (fields 14 and 15 of /proc/PID/stat)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_static(jobs, batch: int) -> dict:
    from transformers import StoppingCriteria, StoppingCriteriaList

    from phaselens.reference_server.engine.model_loader import build_tiny, tiny_suppressed_ids

    model = build_tiny().model

    class Stamp(StoppingCriteria):
        def __init__(self) -> None:
            self.times: list[int] = []

        def __call__(self, input_ids, scores, **kwargs):
            self.times.append(time.monotonic_ns())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    stamps: list[list[int]] = []
    with Clock() as clock:
        for first in range(0, len(jobs), batch):
            group = jobs[first : first + batch]
            width = max(len(p) for p, _ in group)
            ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in group])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in group])
            stamp = Stamp()
            with torch.inference_mode():
                model.generate(
                    ids,
                    attention_mask=mask,
                    max_new_tokens=max(n for _, n in group),
                    do_sample=False,
                    suppress_tokens=list(tiny_suppressed_ids()),
                    pad_token_id=0,
                    eos_token_id=None,
                    stopping_criteria=StoppingCriteriaList([stamp]),
                )
            stamps += [stamp.times[:n] for _, n in group]
    return summary(jobs, stamps, clock.wall, clock.cpu)


def cpu_benchmark(args) -> dict:
    jobs = workload(args.requests, args.seed, args.max_prompt, args.max_output, args.lengths)
    modes = ("thread", "process") if args.engine == "both" else (args.engine,)
    engines = {"thread": run_engine, "process": run_engine_process}
    runs = [
        (
            *(engines[mode](jobs, args.batch, args.max_num_batched_tokens) for mode in modes),
            run_static(jobs, args.batch),
        )
        for _ in range(args.repeats)
    ]
    fastest = [min((run[i] for run in runs), key=lambda r: r["wall_s"]) for i in range(len(modes) + 1)]
    engine, static = fastest[0], fastest[-1]
    figures = {f"engine_{mode}" if mode == "process" else "engine": fastest[i] for i, mode in enumerate(modes)}
    return {
        "benchmark": "serving_throughput",
        "device": "cpu",
        "model": "tiny",
        "torch_threads": torch.get_num_threads(),
        "workload": {
            "requests": len(jobs),
            "lengths": args.lengths,
            "max_prompt_tokens": args.max_prompt,
            "max_output_tokens": args.max_output,
            "mean_output_tokens": round(sum(n for _, n in jobs) / len(jobs), 1),
            "batch": args.batch,
            "seed": args.seed,
        },
        "engine_mode": args.engine,
        **figures,
        "baseline_hf_generate_static": static,
        "repeats": args.repeats,
        "speedup_tokens_per_s": round(engine["output_tokens_per_s"] / static["output_tokens_per_s"], 2),
        "speedup_tokens_per_cpu_s": round(engine["output_tokens_per_cpu_s"] / static["output_tokens_per_cpu_s"], 2),
        "target_speedup": 2.0,
        **(
            {
                "process_vs_thread_tokens_per_s": round(
                    fastest[1]["output_tokens_per_s"] / engine["output_tokens_per_s"], 2
                )
            }
            if args.engine == "both"
            else {}
        ),
    }


def one_b_model(device: str):
    from transformers import ByT5Tokenizer, LlamaConfig, LlamaForCausalLM

    from phaselens.reference_server.engine.detokenizer import decode_bytes
    from phaselens.reference_server.engine.model_loader import LoadedModel

    config = LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=22,
        num_attention_heads=32,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=None,
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    model.set_attn_implementation("phaselens_paged")
    # only the ByT5 byte range may be sampled, so the byte tokenizer can detokenize every output
    suppressed = tuple(range(384, config.vocab_size))
    return LoadedModel(
        model=model,
        tokenizer=ByT5Tokenizer(),
        decode=decode_bytes,
        eos_ids=frozenset(),
        max_context=4096,
        suppressed_ids=suppressed,
        name="llama-1.1b-random",
    )


def decode_step_ms(loaded, batch: int, ctx: int, steps: int, device: str) -> float:
    from phaselens.reference_server import Engine, EngineConfig, SamplingParams
    from phaselens.reference_server.engine.model_runner import ModelRunner

    config = EngineConfig(
        model=loaded.name,
        device=device,
        dtype="bfloat16",
        max_num_seqs=batch,
        max_num_batched_tokens=max(2048, batch),
        kv_cache_tokens=batch * (ctx + steps + 32),
    )
    engine = Engine(config, runner=ModelRunner(config, loaded))
    for i in range(batch):
        engine.submit(
            [35 + (i + j) % 90 for j in range(ctx)], SamplingParams(max_tokens=steps, temperature=0.0, ignore_eos=True)
        )
    times = []
    while engine.scheduler.has_work() or engine.num_waiting:
        start = time.perf_counter()
        batch_run = engine.step()
        if batch_run.decode_tokens == batch and batch_run.prefill_tokens == 0:
            times.append(time.perf_counter() - start)
    return statistics.median(times[2:]) * 1e3


def cuda_benchmark(args) -> dict:
    loaded = one_b_model(args.device)
    cfg = loaded.model.config
    params = sum(p.numel() for p in loaded.model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    rows = []
    for batch in (1, 64):
        measured = decode_step_ms(loaded, batch, args.cuda_context, args.cuda_steps, args.device)
        ctx = args.cuda_context + args.cuda_steps // 2
        kv_bytes = batch * ctx * cfg.num_hidden_layers * 2 * cfg.num_key_value_heads * head_dim * 2
        roofline_ms = (params * 2 + kv_bytes) / HBM_BYTES_PER_S * 1e3
        rows.append(
            {
                "batch": batch,
                "mean_context": ctx,
                "decode_step_ms": round(measured, 4),
                "roofline_ms": round(roofline_ms, 4),
                "fraction_of_roofline": round(roofline_ms / measured, 4),
            }
        )
    device = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    return {
        "benchmark": "serving_throughput",
        "device": device,
        "model": loaded.name,
        "parameters": params,
        "dtype": "bfloat16",
        "hbm_bytes_per_s": HBM_BYTES_PER_S,
        "decode": rows,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="a short run (fewer requests)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--requests", type=int, default=None)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--lengths", choices=("longtail", "uniform"), default="longtail")
    parser.add_argument("--max-prompt", type=int, default=256)
    parser.add_argument("--max-output", type=int, default=256)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=2, help="alternating runs per side; the fastest counts")
    parser.add_argument(
        "--engine",
        choices=("thread", "process", "both"),
        default="thread",
        help="the engine in this process (thread), in its own (process), or both in the same run",
    )
    parser.add_argument("--cuda-context", type=int, default=1024)
    parser.add_argument("--cuda-steps", type=int, default=32)
    args = parser.parse_args()
    if args.requests is None:
        args.requests = 128 if args.quick else 384
    result = cuda_benchmark(args) if args.device == "cuda" else cpu_benchmark(args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
