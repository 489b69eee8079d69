"""CPU per output token of the engine loop alone (no HTTP), split by the step's phases.

The peers workload (benchmarks/peers.py: 8 seats, 64-token prompts, 32 output tokens, EOS
ignored; greedy, or sampled at `--temperature`: the peers' client sends none, so 1.0) is submitted in one go and `Engine.step()` is called until it drains, in this process, on
the byte-level tiny Llama saved as a folder (the model the peers serve) or the built-in `tiny`.
Each phase is timed by wrapping its method, in process CPU time (torch's intra-op threads
included; other processes on a shared machine do not count):

    cpu_us_per_output_token[phase] = Σ process CPU ns in the phase / 1e3 / output tokens
    phases: schedule (scheduler.schedule), forward (runner.run less sampling), sample
    (sampler.sample, its host sync included), postprocess (scheduler.postprocess: stop checks and
    detokenization), other (the rest of step(): stamps, hand-out, step record)

The best of `--repeats` runs counts (the least disturbed). Runs alternate between the lean Llama
forward (reference_server.engine.llama_forward, what the engine uses) and transformers' own forward
of the same model, the same-run baseline. Prints ONE JSON object, with the load average beside the
figures.

    python -m benchmarks.engine_token_cost [--model folder|tiny] [--repeats 3] [--temperature 1]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from phaselens.integrations.vllm.tiny_model import save_tiny_llama
from phaselens.reference_server import Engine, EngineConfig, SamplingParams

PHASES = ("schedule", "forward", "sample", "postprocess")


def timed(fn: Callable, totals: dict[str, int], phase: str) -> Callable:
    def wrapper(*args, **kwargs):
        start = time.process_time_ns()
        try:
            return fn(*args, **kwargs)
        finally:
            totals[phase] += time.process_time_ns() - start

    return wrapper


def instrument(engine: Engine, totals: dict[str, int]) -> None:
    """Wrap each phase's method on the instances; `forward` then includes `sample`, subtracted later."""
    engine.scheduler.schedule = timed(engine.scheduler.schedule, totals, "schedule")  # type: ignore[method-assign]
    engine.scheduler.postprocess = timed(engine.scheduler.postprocess, totals, "postprocess")  # type: ignore[method-assign]
    engine.runner.run = timed(engine.runner.run, totals, "forward")  # type: ignore[method-assign]
    engine.runner.sampler.sample = timed(engine.runner.sampler.sample, totals, "sample")  # type: ignore[method-assign]


def drain(engine: Engine, jobs: list[list[int]], output_len: int, temperature: float) -> None:
    for prompt in jobs:
        engine.submit(prompt, SamplingParams(max_tokens=output_len, temperature=temperature, ignore_eos=True))
    while engine.scheduler.has_work() or engine.num_waiting:
        engine.step()


def one_run(engine: Engine, jobs: list[list[int]], output_len: int, temperature: float) -> dict:
    totals = dict.fromkeys(PHASES, 0)
    instrument(engine, totals)
    start = time.process_time_ns()
    drain(engine, jobs, output_len, temperature)
    total = time.process_time_ns() - start
    for name in ("schedule", "postprocess"):
        delattr(engine.scheduler, name)
    delattr(engine.runner, "run")
    delattr(engine.runner.sampler, "sample")
    tokens = len(jobs) * output_len
    split = {**totals, "forward": totals["forward"] - totals["sample"]}
    split["other"] = total - sum(split.values())
    return {
        "cpu_us_per_output_token": round(total / 1e3 / tokens, 1),
        "split_us_per_output_token": {k: round(v / 1e3 / tokens, 1) for k, v in split.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=("folder", "tiny"), default="folder")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    # 0: greedy; 1.0 is what the peers' client gets (it sends none: OpenAI's default)
    p.add_argument("--temperature", type=float, default=0.0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = str(save_tiny_llama(Path(tmp) / "model")) if args.model == "folder" else "tiny"
        engine = Engine(EngineConfig(model=model, max_num_seqs=args.concurrency))
        vocab = engine.vocab_size
    rng = random.Random(0)
    jobs = [[rng.randrange(2, vocab) for _ in range(args.input_len)] for _ in range(args.requests)]
    drain(engine, jobs[:8], args.output_len, args.temperature)  # warm-up
    load_before = os.getloadavg()
    lean = engine.runner.lean
    runs: dict[str, list[dict]] = {"lean": [], "transformers": []}
    for _ in range(args.repeats):
        for name, forward in (("lean", lean), ("transformers", None)):
            engine.runner.lean = forward
            runs[name].append(one_run(engine, jobs, args.output_len, args.temperature))
    print(
        json.dumps(
            {
                "benchmark": "engine_token_cost",
                "model": args.model,
                "workload": {
                    k: getattr(args, k) for k in ("requests", "concurrency", "input_len", "output_len", "temperature")
                },
                **{name: best(rs) for name, rs in runs.items()},
                "load_average_before_after": [round(x, 1) for x in (*load_before, *os.getloadavg())],
            }
        )
    )


def best(runs: list[dict]) -> dict:
    """The least disturbed run, beside every run's total."""
    least = min(runs, key=lambda r: r["cpu_us_per_output_token"])
    return {**least, "runs_cpu_us_per_output_token": [r["cpu_us_per_output_token"] for r in runs]}


if __name__ == "__main__":
    main()
